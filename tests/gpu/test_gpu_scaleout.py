"""NCCL between processes, scale-out and jobs on real GPUs: one Dask
worker per GPU, as on a lab server. Skipped without 2 GPUs or NCCL."""
import sys
import time

import cloudpickle
import numpy as np
import pytest
from distributed import Client
from gpu_marks import needs, needs_nccl

from dasktrain.parallel.comm import CollectiveError

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [needs(2)]


def _sums(name, rank, size):
    import cupy

    from dasktrain.parallel.comm import DaskComm, NcclComm
    with DaskComm.rendezvous(name, rank, size, timeout=60) as host:
        comm = NcclComm(host, 0)
        try:
            with cupy.cuda.Device(0):
                arrays = [cupy.arange(6, dtype=dt).reshape(2, 3) * (rank + 1)
                          for dt in ('float16', 'float32', 'float64',
                                     'int32')]
                base = cupy.arange(24, dtype='float32').reshape(4, 6) * \
                    (rank + 1)
                on_host = np.full(5, rank + 1.0)
            # each worker sees one GPU: the mixed-device case is the
            # 2-GPU test of test_gpu_replicas
            comm.allreduce(arrays + [base[:, ::2], on_host], check=True)
            return [cupy.asnumpy(a) for a in arrays + [base]] + [on_host]
        finally:
            comm.close()


def _skipper(name, rank, size):
    import cupy

    from dasktrain.parallel.comm import DaskComm, NcclComm
    with DaskComm.rendezvous(name, rank, size, timeout=60) as host:
        comm = NcclComm(host, 0)
        host.timeout = 5.0  # the all-reduce's deadline
        comm.timeout = 5.0
        if rank == 1:
            time.sleep(20)  # alive, connected, and never sums
            return 'slept'
        began = time.monotonic()
        try:
            with cupy.cuda.Device(0):
                comm.allreduce([cupy.ones(1000, 'float32')])
        except CollectiveError as e:
            return (str(e), time.monotonic() - began)
        return 'summed'


def two_workers(gpu_cluster):
    gpu_cluster.worker(gpus=1, visible='0')
    gpu_cluster.worker(gpus=1, visible='1')
    client = Client(gpu_cluster.address)
    client.wait_for_workers(2)
    return client, sorted(client.scheduler_info()['workers'])


@needs_nccl
def test_nccl_sums_every_dtype_views_and_host_arrays(gpu_cluster):
    client, workers = two_workers(gpu_cluster)
    with client:
        results = client.gather([
            client.submit(_sums, 'nccl-sums', r, 2, workers=[w], pure=False)
            for r, w in enumerate(workers)])
    for got in results:
        for a, dt in zip(got[:4], ('float16', 'float32', 'float64',
                                   'int32')):
            np.testing.assert_array_equal(
                a, np.arange(6, dtype=dt).reshape(2, 3) * 3)
        base = got[4]
        np.testing.assert_array_equal(
            base[:, ::2], (np.arange(24, dtype='float32').reshape(4, 6)
                           * 3)[:, ::2])
        np.testing.assert_array_equal(got[5], np.full(5, 3.0))


@needs_nccl
def test_a_rank_that_skips_the_all_reduce_fails_the_other_in_time(
        gpu_cluster):
    client, workers = two_workers(gpu_cluster)
    with client:
        results = client.gather([
            client.submit(_skipper, 'nccl-skip', r, 2, workers=[w],
                          pure=False) for r, w in enumerate(workers)])
    message, waited = results[0]
    assert 'did not finish within the collective_timeout' in message
    assert waited < 30


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(40, 40, 3)


def _pool_bytes():
    import cupy
    return cupy.get_default_memory_pool().total_bytes()


@needs_nccl
@pytest.mark.parametrize('mode,extra', [
    ('dg', {}), ('ipm', {'mix_every': 2}),
    # the stale sums on the side stream over NCCL, from the first step
    ('dg', {'double_buffering': True, 'exact_warmup': 0}),
    # Adam's moments averaged too, over NCCL (checked signatures)
    ('ipm', {'mix_every': 2, 'mix_optimizer_state': True})])
def test_two_gpu_workers_equal_one_process_with_two_gpus(
        gpu_cluster, data_dir, tmp_path, mode, extra):
    from dasktrain.config import TrainConfig
    from dasktrain.run.train import train
    base = TrainConfig(model='resnet20', mode=mode, epochs=2, batch_size=20,
                       data_dir=str(data_dir), progress=False,
                       deterministic=True, **extra)
    one = train(base.replace(out=str(tmp_path / 'one'),
                             devices=('@cupy:0', '@cupy:1'), in_process=True))
    client, _ = two_workers(gpu_cluster)
    with client:
        two = train(base.replace(out=str(tmp_path / 'two'), workers=2,
                                 devices=('@cupy:0',)), client=client)
        pools = client.run(_pool_bytes)
    for a, b in zip(one['log'], two['log'], strict=True):
        for key in ('main/loss', 'main/accuracy',
                    'validation/main/accuracy'):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
    assert set(pools.values()) == {0}  # the ranks gave their memory back


def test_jobs_see_their_own_gpu_and_a_cpu_job_none(gpu_cluster, data_dir,
                                                   tmp_path):
    from dasktrain.config import TrainConfig
    from dasktrain.jobs.client.submit import submit
    gpu_cluster.worker(resources='GPU=2 CPU=1', nthreads=4)
    config = TrainConfig(model='tiny', epochs=1, batch_size=20,
                         data_dir=str(data_dir), train_size=200)
    with Client(gpu_cluster.address) as client:
        client.wait_for_workers(1)
        jobs = [submit(config, gpus=1, client=client, path=tmp_path / 'j')
                for _ in range(2)]
        cpu = submit(config, gpus=0, client=client, path=tmp_path / 'j')
    for job in jobs + [cpu]:
        job.result(timeout=300)
    uuids = [next(line for line in job.logs().splitlines()
                  if line.startswith('devices: ')) for job in jobs]
    assert all('GPU-' in u for u in uuids) and uuids[0] != uuids[1]
    # the worker's first two GPUs, as this machine names them (ids, or
    # the entries of a CUDA_VISIBLE_DEVICES the suite runs under)
    from dasktrain.parallel.gpus import visible_gpus
    assert {tuple(j.status()['gpus']) for j in jobs} == \
        {(e,) for e in visible_gpus(count=2)}
    assert "CUDA_VISIBLE_DEVICES=''" in cpu.logs()
    assert cpu.result()['final']['epoch'] == 1


@needs_nccl
def test_one_worker_process_per_gpu_equals_one_process(data_dir, tmp_path):
    # `dasktrain train --devices 0,1`: one worker per GPU (each sees its
    # own as @cupy:0), NCCL between them; the same as --in-process.
    from dasktrain.config import TrainConfig
    from dasktrain.run.train import train
    base = TrainConfig(model='resnet20', epochs=2, batch_size=20,
                       data_dir=str(data_dir), progress=False,
                       deterministic=True, devices=('@cupy:0', '@cupy:1'))
    here = train(base.replace(out=str(tmp_path / 'here'), in_process=True))
    apart = train(base.replace(out=str(tmp_path / 'apart')))
    assert len(apart['workers']) == 2
    for a, b in zip(here['log'], apart['log'], strict=True):
        assert b['main/loss'] == pytest.approx(a['main/loss'], rel=1e-4)


@needs_nccl
def test_buckets_overlapped_on_two_gpus_sum_what_one_all_reduce_sums(
        data_dir, tmp_path):
    # ResNet-20's 1 MB of gradients in 0.05 MiB buckets: several NCCL
    # all-reduces on the side stream during each backward pass. Two ranks
    # add two numbers per element whatever the chunking: the same bits.
    from dasktrain.config import TrainConfig
    from dasktrain.run.train import train
    base = TrainConfig(model='resnet20', epochs=2, batch_size=20,
                       data_dir=str(data_dir), progress=False,
                       deterministic=True, devices=('@cupy:0', '@cupy:1'))
    after = train(base.replace(out=str(tmp_path / 'after'), bucket_mb=0))
    during = train(base.replace(out=str(tmp_path / 'during'),
                                bucket_mb=0.05))
    for a, b in zip(after['log'], during['log'], strict=True):
        for key in ('main/loss', 'main/accuracy',
                    'validation/main/loss'):
            assert b[key] == a[key], key


@needs_nccl
def test_float16_sums_over_nccl_stay_close_to_exact(data_dir, tmp_path):
    # Each array scaled by a power of two the ranks agree on, summed in
    # float16 by NCCL, cast back: rounding only.
    from dasktrain.config import TrainConfig
    from dasktrain.run.train import train
    base = TrainConfig(model='resnet20', epochs=2, batch_size=20,
                       data_dir=str(data_dir), progress=False,
                       deterministic=True, devices=('@cupy:0', '@cupy:1'))
    exact = train(base.replace(out=str(tmp_path / 'exact')))
    half = train(base.replace(out=str(tmp_path / 'half'),
                              comm_dtype='float16'))
    for a, b in zip(exact['log'], half['log'], strict=True):
        assert b['main/loss'] == pytest.approx(a['main/loss'], rel=0.01)
        assert b['comm_time'] > 0


@needs_nccl
def test_a_two_gpu_job_resumes_where_it_stopped(data_dir, tmp_path):
    # Two worker processes over NCCL, deterministic: 1 epoch + resume + 2
    # epochs is 3 epochs bit for bit (two ranks add once per element, in
    # either order the same; cuDNN's deterministic algorithms; dropout
    # from each replica's seeded stream; float16 absent).
    from dasktrain.config import TrainConfig
    from dasktrain.run.train import train
    base = TrainConfig(model='resnet20', batch_size=20, progress=False,
                       data_dir=str(data_dir), deterministic=True,
                       devices=('@cupy:0', '@cupy:1'))
    whole = train(base.replace(out=str(tmp_path / 'whole'), epochs=3))
    train(base.replace(out=str(tmp_path / 'cut'), epochs=1))
    resumed = train(base.replace(out=str(tmp_path / 'cut'), epochs=3,
                                 resume=True))
    assert len(resumed['workers']) == 2
    assert [r['epoch'] for r in resumed['log']] == [1, 2, 3]
    for a, b in zip(whole['log'], resumed['log'], strict=True):
        for key in ('main/loss', 'main/accuracy', 'validation/main/loss'):
            assert b[key] == a[key], key
    for name in ('model_final.npz', 'checkpoint.npz'):
        with np.load(tmp_path / 'whole' / name) as a, \
                np.load(tmp_path / 'cut' / name) as b:
            for key in a.files:
                if key != 'state':  # the run's bookkeeping (times)
                    np.testing.assert_array_equal(a[key], b[key], key)
