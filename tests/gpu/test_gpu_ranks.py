"""Ranks on real GPUs: float16 buckets over NCCL, the Dask comm paths with
CuPy arrays and their pinned staging buffers, two ranks refused on one
GPU, a peer dying while NCCL sums on the side stream, ranks as
threads of one multi-GPU worker, two GPUs per rank, ipm's optimizer state
over NCCL against the CPU. Each rank body runs on a Dask worker (sent by
value); each test says what it needs and is skipped, with the reason,
where a machine has less."""
import collections
import os
import sys
import time

import cloudpickle
import numpy as np
import pytest
from distributed import Client
from gpu_marks import COUNT, needs, needs_nccl

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _batch(n, seed):
    rng = np.random.RandomState(seed)
    return (rng.randn(n, 3, 32, 32).astype(np.float32),
            rng.randint(0, 10, n).astype(np.int32))


def _counted(comm):
    """Count the communicator's all-reduces and all-gathers (the exchange
    calls them through ``comm``'s attributes)."""
    calls = collections.Counter()
    for what in ('allreduce', 'allgather'):
        real = getattr(comm, what)

        def counted(*args, _real=real, _what=what, **kw):
            calls[_what] += 1
            return _real(*args, **kw)
        setattr(comm, what, counted)
    return calls


def workers(gpu_cluster, visible):
    """One worker per CUDA_VISIBLE_DEVICES value, one GPU each; a client."""
    for v in visible:
        gpu_cluster.worker(gpus=len(v.split(',')), visible=v)
    client = Client(gpu_cluster.address)
    client.wait_for_workers(len(visible))
    return client, sorted(client.scheduler_info()['workers'])


def on_ranks(client, addresses, fn, name, *args):
    futures = [client.submit(fn, name, r, len(addresses), *args,
                             workers=[w], pure=False)
               for r, w in enumerate(addresses)]
    return client.gather(futures)


# ------------------------------------------------- float16 over NCCL

def _float16_buckets(name, rank, size):
    import chainer
    import cupy

    from dasktrain.parallel import GPUDistributedGradient
    from dasktrain.parallel.comm import DaskComm, NcclComm
    from dasktrain.training.models import get_model
    x, t = _batch(8, rank)
    with DaskComm.rendezvous(name, rank, size, timeout=120) as host:
        comm = NcclComm(host, 0)
        calls = _counted(comm)
        out = {}
        try:
            with chainer.using_config('cudnn_deterministic', True), \
                    cupy.cuda.Device(0):
                for dtype in (None, 'float16'):
                    np.random.seed(0)
                    model = GPUDistributedGradient(
                        get_model('resnet20'), ['@cupy:0'], comm=comm,
                        comm_dtype=dtype, bucket_mb=0.05)
                    model.setup(chainer.optimizers.SGD(lr=0))  # w stays
                    grads, steps, wall, comm_time = [], [], 0.0, 0.0
                    for step in range(5):
                        before, spent = dict(calls), model.comm_time
                        cupy.cuda.Device(0).synchronize()
                        began = time.perf_counter()
                        model.step(x, t, total=8 * size, observe=False)
                        cupy.cuda.Device(0).synchronize()
                        if step >= 2:  # buckets known, scales predicted
                            wall += time.perf_counter() - began
                            comm_time += model.comm_time - spent
                        steps.append({k: calls[k] - before.get(k, 0)
                                      for k in calls
                                      if calls[k] > before.get(k, 0)})
                        grads.append({n: cupy.asnumpy(p.grad) for n, p in
                                      model.master.namedparams()})
                    wire = model.exchange.wire
                    out[dtype] = dict(
                        grads=grads, calls=steps, wall=wall,
                        comm_time=comm_time, early=model.exchange.early,
                        buckets=len(model.exchange.plan),
                        resent=wire.resent if wire else 0,
                        asked=wire.asked if wire else 0)
            return out
        finally:
            comm.close()


@needs(2)
@needs_nccl
def test_float16_buckets_leave_early_over_nccl_one_collective_each(
        gpu_cluster):
    client, addresses = workers(gpu_cluster, ['0', '1'])
    with client:
        results = on_ranks(client, addresses, _float16_buckets, 'f16-nccl')
    for got in results:
        exact, half = got[None], got['float16']
        assert half['buckets'] > 2 and half['early'] > 0 and \
            exact['early'] > 0
        for step, (a, b) in enumerate(zip(exact['grads'], half['grads'])):
            for key in a:  # float16's rounding only, and no inf
                assert np.isfinite(b[key]).all(), (step, key)
                assert np.abs(b[key] - a[key]).max() <= \
                    2.0 ** -9 * np.abs(a[key]).max() + 1e-30, (step, key)
        for step in (2, 3, 4):  # as many all-reduces as float32, nothing else
            assert half['calls'][step] == exact['calls'][step] == \
                {'allreduce': half['buckets']}, step
        assert half['resent'] == half['asked'] == 0
        assert 0 < half['comm_time'] < half['wall']
    np.testing.assert_array_equal(  # both ranks hold the same sums
        results[0]['float16']['grads'][-1]['/predictor/fc/W'],
        results[1]['float16']['grads'][-1]['/predictor/fc/W'])


# ------------------------------------------------- Dask comms, CuPy arrays

def _host_paths(name, rank, size, scheduler, shared):
    import cupy

    from dasktrain.parallel.comm.batches import ITSELF_BYTES
    from dasktrain.parallel.comm.rendezvous import (
        SHARED_MEMORY,
        join,
        rank_environment,
    )
    env = rank_environment(rank, size, scheduler, name, 'tcp://127.0.0.1',
                           timeout=60)
    if not shared:
        env[SHARED_MEMORY] = '0'  # as a user sets it for a launched rank
    with join(env) as comm:
        with cupy.cuda.Device(0):
            small = [cupy.arange(6, dtype=dt) * (rank + 1)
                     for dt in ('float16', 'float32', 'float64', 'int32')]
            big = cupy.asarray(np.random.default_rng(rank).standard_normal(
                ITSELF_BYTES // 4).astype(np.float32))  # travels as itself
            base = cupy.arange(24, dtype='float32').reshape(4, 6) * \
                (rank + 1)
        on_host = np.full(5, rank + 1.0)
        comm.allreduce(small + [big, base[:, ::2], on_host])
        return comm.shared_memory, [cupy.asnumpy(a) for a in
                                    small + [big, base]] + [on_host]


@needs(1)
@pytest.mark.parametrize('shared', [True, False], ids=['shm', 'tcp'])
def test_dask_comm_sums_cupy_arrays_as_numpy_does(gpu_cluster, shared):
    # Two ranks, each on a GPU of its own (both on GPU 0 where one only).
    client, addresses = workers(gpu_cluster, ['0', '1' if COUNT > 1 else '0'])
    with client:
        results = on_ranks(client, addresses, _host_paths, f'paths-{shared}',
                           gpu_cluster.address, shared)
    big = sum(np.random.default_rng(r).standard_normal(2 ** 14).astype(
        np.float32) for r in range(2))  # rank 0's plus rank 1's, float32
    for rank, (used, got) in enumerate(results):
        assert used == shared
        for a, dt in zip(got[:4], ('float16', 'float32', 'float64',
                                   'int32')):
            assert a.dtype == dt
            np.testing.assert_array_equal(a, np.arange(6, dtype=dt) * 3)
        np.testing.assert_array_equal(got[4], big)
        base = np.arange(24, dtype='float32').reshape(4, 6)
        np.testing.assert_array_equal(got[5][:, ::2], (base * 3)[:, ::2])
        np.testing.assert_array_equal(got[5][:, 1::2],  # not in the view
                                      base[:, 1::2] * (rank + 1))
        np.testing.assert_array_equal(got[6], np.full(5, 3.0))


def _staging_as_sizes_change(name, rank, size, scheduler, shared):
    import weakref

    import cupy
    from cupy.cuda.pinned_memory import is_memory_pinned

    from dasktrain.parallel.comm.rendezvous import (
        SHARED_MEMORY,
        join,
        rank_environment,
    )
    env = rank_environment(rank, size, scheduler, name, 'tcp://127.0.0.1',
                           timeout=60)
    if not shared:
        env[SHARED_MEMORY] = '0'
    sums, seen = [], {}
    with join(env) as comm:
        for n, rounds in ((1000, 3), (3000, 4)):
            for _ in range(rounds):
                with cupy.cuda.Device(0):
                    x = cupy.full(n, rank + 1.0, dtype=cupy.float32)
                comm.allreduce([x])
                sums.append(cupy.asnumpy(x))
            kept = comm._staging.buffers()
            seen[n] = ([k[2] for k in comm._staging.keys()],
                       [b.array.ctypes.data for b in kept],
                       [weakref.ref(b) for b in kept])
            del kept  # only the communicator keeps them
        pointers = seen[1000][1] + seen[3000][1]
        return sums, {n: got[0] for n, got in seen.items()}, \
            [is_memory_pinned(p) for p in pointers], \
            [ref() is None for ref in seen[1000][2]]


@needs(1)
@pytest.mark.parametrize('shared', [True, False], ids=['shm', 'tcp'])
def test_staging_buffers_of_sizes_no_longer_summed_are_freed(gpu_cluster,
                                                             shared):
    # Two ranks sum GPU arrays through the host, 3 all-reduces of 1000
    # floats then 4 of 3000: the sums are right, and the pinned buffer of
    # the 1000 goes (its memory no longer pinned) once unused for twice
    # its gap; the current one stays, pinned.
    client, addresses = workers(gpu_cluster, ['0', '1' if COUNT > 1 else '0'])
    with client:
        results = on_ranks(client, addresses, _staging_as_sizes_change,
                           f'staging-{shared}', gpu_cluster.address, shared)
    for sums, kept, pinned, gone in results:
        for got, n in zip(sums, [1000] * 3 + [3000] * 4):
            np.testing.assert_array_equal(got, np.full(n, 3.0, np.float32))
        assert kept == {1000: [1000], 3000: [3000]}
        assert pinned == [False, True] and gone == [True]


def _nccl_on_one_gpu(name, rank, size):
    from dasktrain.parallel.comm import DaskComm, NcclComm
    from dasktrain.parallel.gpus import GpuError
    with DaskComm.rendezvous(name, rank, size, timeout=60) as host:
        try:
            NcclComm(host, 0).close()
        except GpuError as e:
            return str(e)
    return None


@needs(1)
def test_two_ranks_making_nccl_on_one_gpu_are_refused_in_one_line(
        gpu_cluster):
    # Two workers that both see GPU 0 (as a ChainerMN script on every
    # rank's device 0 would): each rank refuses before NCCL's set-up,
    # naming the GPU by its entry and the driver's UUID.
    client, addresses = workers(gpu_cluster, ['0', '0'])
    with client:
        said = on_ranks(client, addresses, _nccl_on_one_gpu, 'one-gpu')
    assert said[0] == said[1] and said[0] is not None
    assert said[0].startswith('ranks 0 and 1 would both train on GPU 0 '
                              '(GPU-') and ' of 127.0.0.1, which NCCL ' \
        'does not support' in said[0] and 'comm.intra_rank' in said[0]


# ------------------------------------------------- a peer dies mid-sum

def _dies_mid_sum(name, rank, size):
    import chainer
    import cupy

    from dasktrain.parallel import GPUDistributedGradient
    from dasktrain.parallel.comm import CollectiveError, DaskComm, NcclComm
    from dasktrain.training.models import get_model
    with DaskComm.rendezvous(name, rank, size, timeout=60) as host:
        comm = NcclComm(host, 0)
        host.timeout = comm.timeout = 10.0  # the collectives' deadline
        with cupy.cuda.Device(0):
            model = GPUDistributedGradient(get_model('tiny'), ['@cupy:0'],
                                           comm=comm, double_buffering=True,
                                           warmup=0)
            model.setup(chainer.optimizers.SGD(lr=0.01))
            model.step(*_batch(8, rank), total=16)  # its sum: side stream
            if rank == 1:
                # its part of step 1's sum done (no collective: end_epoch
                # would mix, which rank 0 never joins), then the worker
                # dies: no goodbye, no NCCL abort
                cupy.cuda.Device(0).synchronize()
                os._exit(1)
            began = time.monotonic()
            try:  # step 2's sum waits for rank 1 on the side stream;
                for step in range(2, 6):  # step 3 waits for step 2's
                    model.step(*_batch(8, step), total=16)
            except CollectiveError as e:
                return str(e), time.monotonic() - began
            return 'summed', time.monotonic() - began


@needs(2)
@needs_nccl
def test_a_peer_dying_during_a_side_stream_sum_fails_the_other_in_time(
        gpu_cluster):
    client, addresses = workers(gpu_cluster, ['0', '1'])
    with client:
        futures = [client.submit(_dies_mid_sum, 'nccl-dies', r, 2,
                                 workers=[w], pure=False)
                   for r, w in enumerate(addresses)]
        message, waited = futures[0].result(timeout=120)
        deadline = time.monotonic() + 30
        while addresses[1] in client.scheduler_info()['workers']:
            assert time.monotonic() < deadline, 'rank 1 did not die'
            time.sleep(0.2)
    assert message != 'summed', 'rank 0 summed without its dead peer'
    # NCCL's own error (the peer's connection closed), the deadline's
    # abort, or the host comm's lost peer, in one line
    assert '\n' not in message and 'rank' in message, message
    assert any(w in message for w in ('failed', 'did not finish', 'lost',
                                      'left', 'died')), message
    assert waited < 10 + 30  # the timeout, then the abort: no hang


# ------------------------------------------------- ranks as threads

def _thread_rank(name, rank, size):
    import chainer
    import cupy
    import pynvml

    from dasktrain.parallel import GPUDistributedGradient
    from dasktrain.parallel.comm import DaskComm, NcclComm
    from dasktrain.parallel.devices import device_uuids, resolve_devices
    from dasktrain.parallel.gpus import GpuPool, gpu_ids, place_devices
    from dasktrain.training.models import get_model
    held = GpuPool.acquire(1)  # as launch's rank body does, then trains
    try:
        devices = place_devices(None, [g.index for g in held])
        with DaskComm.rendezvous(name, rank, size, timeout=120) as host:
            comm = NcclComm(host, gpu_ids(devices)[0])
            try:
                with chainer.using_device(chainer.get_device(devices[0])):
                    model = GPUDistributedGradient(get_model('tiny'),
                                                   devices, comm=comm)
                    model.setup(chainer.optimizers.SGD(lr=0.1))
                    for step in range(2):
                        model.step(*_batch(8, 2 * step + rank), total=16)
                    where = sorted({p.array.device.id
                                    for p in model.master.params()})
                    weights = {n: cupy.asnumpy(p.array)
                               for n, p in model.master.namedparams()}
            finally:
                comm.close()
        ordinal = held[0].index
        pynvml.nvmlInit()
        try:
            bus = cupy.cuda.Device(ordinal).pci_bus_id  # as NVML knows it
            nvml = pynvml.nvmlDeviceGetUUID(
                pynvml.nvmlDeviceGetHandleByPciBusId(bus))
        finally:
            pynvml.nvmlShutdown()
        return dict(entry=held[0].id, ordinal=ordinal, where=where,
                    driver=device_uuids(resolve_devices(devices)),
                    nvml=nvml, weights=weights)
    finally:
        GpuPool.release(held)


def _visible_orders():
    from dasktrain.parallel.cuda_driver import driver_uuids
    uuids = driver_uuids() or []
    orders = [pytest.param(','.join(uuids[1::-1]), uuids[1::-1],
                           id='uuids-reversed')]
    if 'CUDA_VISIBLE_DEVICES' not in os.environ:  # ids as CUDA numbers them
        orders.append(pytest.param('1,0', uuids[1::-1], id='ids-reversed'))
    return orders


@needs(2)
@needs_nccl
@pytest.mark.parametrize('visible,expected', _visible_orders()
                         if COUNT > 1 else [('', [])])
def test_ranks_as_threads_each_train_on_the_gpu_they_were_handed(
        gpu_cluster, visible, expected):
    # One worker with 2 GPUs and 2 threads: 2 ranks in one process, one
    # of them on CUDA ordinal 1, each on its GPU by UUID (the driver's and
    # NVML's by PCI bus id, which know nothing of CUDA's numbering).
    gpu_cluster.worker(gpus=2, visible=visible)
    with Client(gpu_cluster.address) as client:
        client.wait_for_workers(1)
        (address,) = client.scheduler_info()['workers']
        futures = [client.submit(_thread_rank, 'thread-ranks', r, 2,
                                 workers=[address], resources={'GPU': 1},
                                 pure=False) for r in range(2)]
        results = client.gather(futures)
    assert sorted(r['ordinal'] for r in results) == [0, 1]
    for r in results:
        uuid = expected[r['ordinal']]
        assert r['where'] == [r['ordinal']]
        assert r['driver'] == {f'@cupy:{r["ordinal"]}': uuid}
        assert r['nvml'] == uuid
        assert r['entry'] == visible.split(',')[r['ordinal']]
    for key in results[0]['weights']:  # one job: the same weights
        np.testing.assert_array_equal(results[0]['weights'][key],
                                      results[1]['weights'][key])


# ------------------------------------------------- launched jobs, float64

@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(40, 40, 3)


def _config(data_dir, out, **kw):
    from dasktrain.config import TrainConfig
    base = dict(model='tiny', epochs=2, batch_size=10, lr=0.01,
                data_dir=str(data_dir), out=str(out), progress=False,
                deterministic=True)
    base.update(kw)
    return TrainConfig(**base)


def assert_same_runs(one, two, out_one, out_two):
    for a, b in zip(one['log'], two['log'], strict=True):
        for key in ('main/loss', 'main/accuracy', 'validation/main/loss'):
            assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-12), key
    for name in ('model_final.npz',):
        with np.load(out_one / name) as a, np.load(out_two / name) as b:
            for key in a.files:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-9,
                                           atol=1e-12, err_msg=key)


@needs(2)
@needs_nccl
def test_two_gpus_per_rank_equal_one_process_with_four_replicas(
        gpu_cluster, data_dir, tmp_path, float64):
    # --workers 2 --gpus-per-worker 2: each rank merges its 2 replicas,
    # then NCCL sums the ranks (on distinct GPUs: the masters' orders
    # differ where there are only 2); float64 keeps the other order of
    # the sums within 1e-9.
    from dasktrain.run.train import train
    pairs = ['0,1', '2,3'] if COUNT >= 4 else ['0,1', '1,0']
    one = train(_config(data_dir, tmp_path / 'one', in_process=True,
                        devices=('@cupy:0', '@cupy:1') * 2))
    client, _ = workers(gpu_cluster, pairs)
    with client:
        two = train(_config(data_dir, tmp_path / 'two', workers=2,
                            gpus_per_worker=2), client=client)
    assert two['devices'] == ['@cupy:0', '@cupy:1']
    assert_same_runs(one, two, tmp_path / 'one', tmp_path / 'two')


@needs(2)
@needs_nccl
def test_ipm_optimizer_state_mixed_over_nccl_equals_the_cpu(
        gpu_cluster, data_dir, tmp_path, float64):
    from dasktrain.run.train import train
    ipm = dict(mode='ipm', mix_every=2, mix_optimizer_state=True,
               optimizer='adam')
    cpu = train(_config(data_dir, tmp_path / 'cpu', in_process=True,
                        devices=('@numpy', '@numpy'), **ipm))
    client, _ = workers(gpu_cluster, ['0', '1'])
    with client:
        gpu = train(_config(data_dir, tmp_path / 'gpu', workers=2,
                            devices=('@cupy:0',), **ipm), client=client)
    assert_same_runs(cpu, gpu, tmp_path / 'cpu', tmp_path / 'gpu')
