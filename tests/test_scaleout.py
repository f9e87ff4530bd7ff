"""One job across Dask worker processes: real LocalClusters on 127.0.0.1."""
import glob
import json
import os
import signal
import sys
import time

import chainer
import chainer.links  # noqa: F401
import cloudpickle
import numpy as np
import pytest

from dasktrain.data.augment import EpochLoader, shard_batches
from dasktrain.cli import main
from dasktrain.parallel.comm import CollectiveError, DaskComm
from dasktrain.config import TrainConfig
from dasktrain.cluster.scaleout import ScaleOutError, train
from dasktrain.training import train as train_here

# The ranks' test functions below travel to the workers by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TIME_KEYS = {'elapsed_time', 'images_per_sec', 'data_wait_time',
             'comm_time'}


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(40, 30, 5)


def cluster(n):
    from distributed import LocalCluster
    return LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                        host='127.0.0.1', dashboard_address='127.0.0.1:0',
                        env={'OMP_NUM_THREADS': '1'})


def config(data_dir, out, **kw):
    base = dict(model='tiny', epochs=2, batch_size=8, lr=0.01,
                data_dir=str(data_dir), out=str(out), progress=False)
    base.update(kw)
    return TrainConfig(**base)


def log(out):
    return json.loads((out / 'log').read_text())


def assert_same_logs(a, b, val_rtol=1e-6):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert set(x) == set(y)
        for key in set(x) - TIME_KEYS:
            if key.startswith('validation/'):  # test shards summed apart
                assert y[key] == pytest.approx(x[key], rel=val_rtol), key
            elif key == 'drift':  # per-replica distances summed apart
                assert y[key] == pytest.approx(x[key], rel=1e-12), key
            else:
                assert y[key] == x[key], key


def npz(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files if k != 'state'}


# ------------------------------------------------------------ sharding

def test_sharding_covers_every_image_once_per_epoch():
    for n, batch, parts in [(103, 20, 4), (101, 200, 2), (50, 6, 3)]:
        steps = shard_batches(n, batch, 7, 1, parts)
        seen = np.concatenate([np.concatenate(s) for s in steps])
        assert sorted(seen) == list(range(n))
        bounds = np.linspace(0, n, parts + 1)
        for p in range(parts):  # a part stays inside its contiguous shard
            mine = np.concatenate([s[p] for s in steps])
            assert mine.min() >= np.floor(bounds[p]) - 1
            assert mine.max() <= np.ceil(bounds[p + 1])
            assert all(len(s[p]) <= batch // parts for s in steps)
    with pytest.raises(ValueError, match='divides batch_size'):
        shard_batches(10, 5, 0, 0, parts=2)


def test_loaders_of_some_parts_make_up_the_whole_loader():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (103, 3, 32, 32), dtype=np.uint8)
    labels = np.arange(103)
    with EpochLoader(x, labels, 20, seed=3, parts=4, client=False) as whole:
        full = list(whole.epoch(2))
    halves = []
    for own in (range(0, 1), range(1, 4)):
        with EpochLoader(x, labels, 20, seed=3, parts=4, own=own,
                         client=False, cache=True) as loader:
            assert loader.stop - loader.start < 103  # reads its shards only
            halves.append(list(loader.epoch(2)))
    assert len(full) == len(halves[0]) == len(halves[1]) == 6
    for (xf, tf), (x0, t0), (x1, t1) in zip(full, *halves):
        np.testing.assert_array_equal(xf, np.concatenate([x0, x1]))
        np.testing.assert_array_equal(tf, np.concatenate([t0, t1]))


# ------------------------------------------------------------ collectives

def _collectives(name, rank, size):
    with DaskComm.rendezvous(name, rank, size, timeout=30) as comm:
        a = np.arange(7, dtype=np.float32) * (rank + 1) + 0.1
        b = np.full((2, 3), 10.0 ** rank)
        comm.allreduce([a, b])
        return (a, b, comm.allgather(rank * 10), comm.gather(rank),
                comm.bcast('from 0' if rank == 0 else None))


def test_collectives_between_worker_processes(dask_client):
    workers = sorted(dask_client.scheduler_info()['workers'])
    futures = [dask_client.submit(_collectives, 'coll-test', r, 2,
                                  workers=[w], pure=False)
               for r, w in enumerate(workers)]
    results = dask_client.gather(futures)
    expected_a = np.float32(np.arange(7) * 1 + 0.1) + \
        np.float32(np.arange(7) * 2 + 0.1)
    for rank, (a, b, everyone, gathered, told) in enumerate(results):
        np.testing.assert_array_equal(a, expected_a)
        assert a.dtype == np.float32 and b.dtype == np.float64
        np.testing.assert_array_equal(b, np.full((2, 3), 11.0))
        assert everyone == [0, 10]
        assert gathered == ([0, 1] if rank == 0 else None)
        assert told == 'from 0'
    assert results[0][2] == results[1][2]


def _both_paths(name, rank, size):
    out = {}
    for shared in (False, True):
        with DaskComm.rendezvous(f'{name}-{shared}', rank, size, timeout=30,
                                 shared_memory=shared) as comm:
            rng = np.random.default_rng(rank)
            a = rng.standard_normal(1001).astype(np.float32)
            base = rng.standard_normal((6, 5))
            i = np.arange(7, dtype=np.int32) * (rank + 1)
            comm.allreduce([a, base[:, ::2], i])  # a non-contiguous view
            comm.allreduce([a])  # the other result segment
            out[shared] = (a, base, i, comm.shared_memory)
    return out


def test_shared_memory_sums_the_bits_tcp_sums(dask_client):
    workers = sorted(dask_client.scheduler_info()['workers'])
    results = dask_client.gather([
        dask_client.submit(_both_paths, 'paths', r, 2, workers=[w],
                           pure=False) for r, w in enumerate(workers)])
    for rank_result in results:
        tcp, shared = rank_result[False], rank_result[True]
        assert not tcp[3] and shared[3]  # the second really used /dev/shm
        for x, y in zip(tcp[:3], shared[:3]):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(results[0][True][0], results[1][True][0])
    np.testing.assert_array_equal(results[0][True][2],
                                  np.arange(7, dtype=np.int32) * 3)
    assert not glob.glob('/dev/shm/dasktrain-*')


def _start_weights(name, rank, size):
    from dasktrain.training.models import get_model
    from dasktrain.parallel import GPUDistributedGradient
    np.random.seed(100 + rank)  # each process draws other initial weights
    drawn = get_model('resnet20')
    before = drawn.predictor.fc.W.array.copy()
    with DaskComm.rendezvous(name, rank, size, timeout=30) as comm:
        model = GPUDistributedGradient(drawn, ['@numpy'] * 2, comm=comm)
        arrays = {n: p.array.copy() for n, p in
                  model.replicas[1].namedparams()}
        return before, arrays


def test_ranks_start_from_rank_0s_weights(dask_client):
    workers = sorted(dask_client.scheduler_info()['workers'])
    results = dask_client.gather([
        dask_client.submit(_start_weights, 'start-test', r, 2, workers=[w],
                           pure=False) for r, w in enumerate(workers)])
    (before0, mine0), (before1, mine1) = results
    assert not np.array_equal(before0, before1)  # they did differ
    assert set(mine0) == set(mine1)
    for key in mine0:
        np.testing.assert_array_equal(mine0[key], mine1[key])
    np.testing.assert_array_equal(mine1['/predictor/fc/W'], before0)


def _mismatched(name, rank, size):
    with DaskComm.rendezvous(name, rank, size, timeout=30) as comm:
        try:
            comm.allreduce([np.zeros(3 + rank, np.float32)])
        except CollectiveError as e:
            return str(e)
        return 'summed'


def test_ranks_summing_different_arrays_fail_instead_of_mixing(dask_client):
    workers = sorted(dask_client.scheduler_info()['workers'])
    results = dask_client.gather([
        dask_client.submit(_mismatched, 'mismatch-test', r, 2, workers=[w],
                           pure=False) for r, w in enumerate(workers)])
    assert all('out of step' in r for r in results), results


def test_a_missing_rank_fails_the_rendezvous_after_the_timeout(dask_client):
    began = time.monotonic()
    future = dask_client.submit(
        lambda: DaskComm.rendezvous('lonely', 1, 2, timeout=1.5),
        pure=False)
    with pytest.raises(CollectiveError, match=r'rank 0 of 2 did not start '
                                              r'within 1.5 s'):
        future.result()
    assert time.monotonic() - began < 30


# ------------------------------------------------------------ equivalence

@pytest.mark.parametrize('mode,model,local,extra', [
    ('dg', 'cifar10', 1, {}),                 # dropout: per-replica masks
    ('ipm', 'resnet20', 2, {'mix_every': 3,   # BatchNorm, 2 x 2 replicas
                            'optimizer': 'momentum-sgd',
                            'weight_decay': 5e-4}),
])
def test_workers_give_the_results_of_one_process_with_as_many_replicas(
        data_dir, tmp_path, mode, model, local, extra):
    common = config(data_dir, tmp_path, model=model, mode=mode,
                    batch_size=4, **extra)
    single = train_here(common.replace(
        out=str(tmp_path / 'one'), devices=('@numpy',) * 2 * local))
    with cluster(2) as c:
        address = c.scheduler_address
        assert main(['train', '--workers', '2', '--scheduler', address,
                     '--out', str(tmp_path / 'two'), '--mode', mode,
                     '--model', model, '--devices', f'cpu:{local}',
                     '--epochs', '2', '--batch-size', '4', '--lr', '0.01',
                     '--data-dir', str(data_dir), '--no-progress',
                     *(['--mix-every', '3', '--optimizer', 'momentum-sgd',
                        '--weight-decay', '5e-4'] if extra else [])]) == 0
    assert_same_logs(single['log'], log(tmp_path / 'two'))
    one, two = (npz(tmp_path / d / 'model_final.npz') for d in ('one', 'two'))
    for key in one:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-6,
                                   atol=1e-7, err_msg=key)
    if mode == 'ipm':  # every replica and optimizer state, gathered
        one, two = (npz(tmp_path / d / 'checkpoint.npz')
                    for d in ('one', 'two'))
        assert sorted(one) == sorted(two)
        for key in one:
            np.testing.assert_allclose(two[key], one[key], rtol=1e-6,
                                       atol=1e-7, err_msg=key)


# ------------------------------------------------------------ failures

def _pids(client):
    return client.run(os.getpid)


def test_several_devices_train_as_one_worker_process_each(data_dir,
                                                          tmp_path):
    # `dasktrain train --devices cpu:2`: two single-threaded worker
    # processes, the same results as the two replicas in one process.
    both = dict(devices=('@numpy',) * 2, mode='ipm', mix_every=3)
    here = train(config(data_dir, tmp_path / 'here', in_process=True, **both))
    apart = train(config(data_dir, tmp_path / 'apart', **both))
    assert 'workers' not in here and len(apart['workers']) == 2
    assert_same_logs(here['log'], apart['log'])
    args = json.loads((tmp_path / 'apart' / 'args').read_text())
    assert args['workers'] == 2 and args['devices'] == ['@numpy']


def test_float16_and_double_buffered_communication(data_dir, tmp_path):
    both = dict(devices=('@numpy',) * 2, epochs=2)
    exact = train(config(data_dir, tmp_path / 'exact', **both))['log']
    half = train(config(data_dir, tmp_path / 'half', comm_dtype='float16',
                        **both))['log']
    stale = train(config(data_dir, tmp_path / 'stale', double_buffering=True,
                         **both))['log']
    for rows in (half, stale):  # as many updates as exact dg
        assert [r['iteration'] for r in rows] == \
            [r['iteration'] for r in exact]
    for a, b in zip(exact, half):  # float16 sums: close to exact
        assert b['main/loss'] == pytest.approx(a['main/loss'], rel=0.01)
    # one step stale (the maths: test_parallel) learns, more slowly here
    assert stale[1]['main/loss'] < stale[0]['main/loss']
    # float16 rounds the sums; one-step-stale updates follow another path
    assert half[-1]['main/loss'] != exact[-1]['main/loss']
    assert stale[-1]['main/loss'] != exact[-1]['main/loss']
    # the communication thread changes nothing: the same replicas in one
    # process, double-buffered there too, give the same bits
    here = train(config(data_dir, tmp_path / 'stale-here', in_process=True,
                        double_buffering=True, **both))['log']
    assert_same_logs(here, stale)


def _overlapped(name, rank, size, bucket_mb):
    from dasktrain.training.models import get_model
    from dasktrain.parallel import GPUDistributedGradient
    np.random.seed(0)
    with DaskComm.rendezvous(name, rank, size, timeout=30) as comm:
        model = GPUDistributedGradient(get_model('cifar10'), ['@numpy'],
                                       comm=comm, bucket_mb=bucket_mb)
        model.setup(chainer.optimizers.MomentumSGD(lr=0.01))
        rng = np.random.RandomState(rank)
        for step in range(3):
            x = rng.randn(4, 3, 32, 32).astype(np.float32)
            t = rng.randint(0, 10, 4).astype(np.int32)
            model.step(x, t, total=8)
        return ({n: p.array for n, p in model.master.namedparams()},
                model.exchange.plan, model.exchange.early)


def test_buckets_leave_during_the_backward_pass_and_sum_the_same_bits(
        dask_client):
    workers = sorted(dask_client.scheduler_info()['workers'])
    runs = {mb: dask_client.gather([
        dask_client.submit(_overlapped, f'overlap-{mb}', r, 2, mb,
                           workers=[w], pure=False)
        for r, w in enumerate(workers)]) for mb in (0, 0.1)}
    (p0, plan0, early0), (p1, plan1, _) = runs[0.1]
    # 0.1 MiB: fc5's W; fc5's b with fc4's W (21 MB); fc4's b with
    # conv3's W; conv3's b to conv1's W; conv1's b with the statistics
    assert plan0 == plan1 == [[8], [9, 6], [7, 4], [5, 2, 3, 0], [1]]
    assert early0 == 4 * 2  # all but the last bucket, after the 1st step
    assert runs[0][0][1] is None and runs[0][0][2] == 0  # 0: no buckets
    for key in p0:
        np.testing.assert_array_equal(p0[key], p1[key], key)
        np.testing.assert_array_equal(p0[key], runs[0][0][0][key], key)


class _Slow(chainer.FunctionNode):
    """Identity whose backward takes a while and passes its gradient on as
    is (the same array), as Chainer's Add does."""

    def forward(self, inputs):
        return inputs[0].copy(),

    def backward(self, indexes, grad_outputs):
        time.sleep(0.3)
        return grad_outputs


class _Aliasing(chainer.Chain):
    """p's gradient is the very array that flows on, slowly, to l; c is a
    leaf Variable that is no parameter."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = chainer.links.Linear(12, 10)
            self.p = chainer.Parameter(np.zeros((4, 10), np.float32))
        self.c = chainer.Variable(np.ones((4, 10), np.float32))

    def forward(self, x):
        return _Slow().apply((self.l(x),))[0] + self.p + self.c


def _aliased(name, rank, size, bucket_mb):
    from dasktrain.parallel import GPUDistributedGradient
    np.random.seed(0)
    with DaskComm.rendezvous(name, rank, size, timeout=30) as comm:
        model = GPUDistributedGradient(
            chainer.links.Classifier(_Aliasing()), ['@numpy'], comm=comm,
            bucket_mb=bucket_mb)
        model.setup(chainer.optimizers.SGD(lr=0.1))
        rng = np.random.RandomState(rank)
        for _ in range(3):
            model.step(rng.randn(4, 12).astype(np.float32),
                       rng.randint(0, 10, 4).astype(np.int32), total=8)
        return ({n: p.array for n, p in model.master.namedparams()},
                model.exchange.early)


def test_a_bucket_in_flight_never_writes_a_gradient_still_flowing(
        dask_client):
    workers = sorted(dask_client.scheduler_info()['workers'])
    runs = {mb: dask_client.gather([
        dask_client.submit(_aliased, f'alias-{mb}', r, 2, mb, workers=[w],
                           pure=False)
        for r, w in enumerate(workers)]) for mb in (0, 1e-6)}
    assert runs[1e-6][0][1] == 2 * 2  # p's and l's W's buckets left early
    for key in runs[0][0][0]:
        np.testing.assert_array_equal(runs[1e-6][0][0][key],
                                      runs[0][0][0][key], key)
        np.testing.assert_array_equal(runs[1e-6][1][0][key],
                                      runs[0][0][0][key], key)


@pytest.mark.parametrize('policy', ['continue', 'wait'])
def test_a_worker_killed_mid_job_and_the_job_goes_on(data_dir, tmp_path,
                                                      policy):
    from distributed import Client
    common = config(data_dir, tmp_path, epochs=4, mode='ipm',
                    mix_every='epoch', workers=2, on_worker_loss=policy)
    killed = []
    with cluster(2) as c, Client(c) as client:
        pids = _pids(client)

        def kill_after_epoch_2(row):
            if row['epoch'] == 2 and not killed:
                victim = sorted(pids)[1]
                killed.append(victim)
                os.kill(pids[victim], signal.SIGKILL)

        summary = train(common.replace(out=str(tmp_path / 'k')),
                        callbacks=[kill_after_epoch_2], client=client)
    assert killed and summary['attempts'] == 2
    assert killed[0] not in summary['workers']
    # the shared-memory segments were unlinked once mapped: none outlives
    # its job, not even one of the SIGKILLed worker's
    assert not glob.glob('/dev/shm/dasktrain-*')
    rows = log(tmp_path / 'k')
    assert [r['epoch'] for r in rows] == [1, 2, 3, 4]
    if policy == 'wait':  # the nanny's new worker replaced the dead one
        assert len(summary['workers']) == 2
        return
    # Nothing before the checkpoint was lost: the first two epochs are those
    # of an uninterrupted run; the last two trained on the one worker left.
    with cluster(2) as c:
        whole = train(common.replace(out=str(tmp_path / 'w'),
                                     scheduler=c.scheduler_address))
    assert_same_logs(whole['log'][:2], rows[:2])
    assert len(summary['workers']) == 1
    assert rows[3]['iteration'] > whole['log'][3]['iteration']  # 1 replica
    assert rows[-1]['validation/main/accuracy'] > 0.3  # chance: 0.1


def test_a_hung_worker_fails_the_job_after_the_collective_timeout(
        data_dir, tmp_path):
    from distributed import Client
    with cluster(2) as c, Client(c) as client:
        pids = _pids(client)
        stopped = []

        def hang_after_epoch_1(row):
            stopped.append(pids[sorted(pids)[1]])
            os.kill(stopped[0], signal.SIGSTOP)

        began = time.monotonic()
        try:
            with pytest.raises(CollectiveError, match='collective_timeout'):
                train(config(data_dir, tmp_path / 'h', epochs=3, workers=2,
                             collective_timeout=3), client=client,
                      callbacks=[hang_after_epoch_1])
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        assert time.monotonic() - began < 60
    assert len(log(tmp_path / 'h')) == 1  # epoch 1 stays checkpointed


def test_asking_for_more_workers_than_the_cluster_has(dask_client, data_dir,
                                                      tmp_path):
    with pytest.raises(ScaleOutError, match='--workers 3 needs 3 Dask workers'
                                            r'.*has 2'):
        train(config(data_dir, tmp_path / 'x', workers=3,
                     collective_timeout=1), client=dask_client)


def test_local_workers_listen_on_loopback_only_and_require_tls(listening):
    from distributed import Client
    from dasktrain.cluster.scaleout import local_workers
    me = os.getpid()
    before = listening([me])
    with local_workers(2) as client:
        address = client.scheduler.address
        new = listening([me]) - before
        workers = set(client.run(os.getpid).values())
        assert address.startswith('tls://127.0.0.1:')
        with pytest.raises(TypeError, match='TLS expects'):
            Client(address, timeout=3)  # no certificates, no connection
    ports = {port for _, _, port in new}
    assert int(address.rsplit(':', 1)[1]) in ports
    assert workers <= {pid for pid, _, _ in new}  # each worker listens
    assert {ip for _, ip, _ in new} == {'127.0.0.1'}
