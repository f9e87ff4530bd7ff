"""Collectives and the gradient exchange between Dask worker processes:
real LocalClusters on 127.0.0.1."""
import glob
import sys
import time

import chainer
import chainer.links
import cloudpickle
import numpy as np
import pytest

from dasktrain.parallel.comm import CollectiveError, DaskComm

# The ranks' test functions below travel to the workers by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


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


def _big(rank):
    return np.random.default_rng(100 + rank).standard_normal(
        20_000).astype(np.float32)


def _both_paths(name, rank, size):
    out = {}
    for shared in (False, True):
        with DaskComm.rendezvous(f'{name}-{shared}', rank, size, timeout=30,
                                 shared_memory=shared) as comm:
            rng = np.random.default_rng(rank)
            a = rng.standard_normal(1001).astype(np.float32)
            base = rng.standard_normal((6, 5))
            i = np.arange(7, dtype=np.int32) * (rank + 1)
            # a flat buffer large enough to travel as itself (a gradient
            # bucket's), beside small arrays of its dtype, joined
            big = _big(rank)
            comm.allreduce([a, base[:, ::2], i, big])  # a non-contiguous view
            comm.allreduce([a])  # the other result segment
            out[shared] = (a, base, i, big, comm.shared_memory)
    return out


def test_shared_memory_sums_the_bits_tcp_sums(dask_client):
    before = set(glob.glob('/dev/shm/dasktrain-*'))  # others' are theirs
    workers = sorted(dask_client.scheduler_info()['workers'])
    results = dask_client.gather([
        dask_client.submit(_both_paths, 'paths', r, 2, workers=[w],
                           pure=False) for r, w in enumerate(workers)])
    for rank_result in results:
        tcp, shared = rank_result[False], rank_result[True]
        assert not tcp[-1] and shared[-1]  # the second used /dev/shm
        for x, y in zip(tcp[:-1], shared[:-1]):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(tcp[3], _big(0) + _big(1))
    np.testing.assert_array_equal(results[0][True][0], results[1][True][0])
    np.testing.assert_array_equal(results[0][True][2],
                                  np.arange(7, dtype=np.int32) * 3)
    assert set(glob.glob('/dev/shm/dasktrain-*')) <= before  # unlinked


def _start_weights(name, rank, size):
    from dasktrain.parallel import GPUDistributedGradient
    from dasktrain.training.models import get_model
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


def _one_bcast_then(name, rank, size):
    comm = DaskComm.rendezvous(name, rank, size, timeout=30)
    try:
        comm.bcast('x' if rank == 0 else None)
        if rank == 0:
            return 'left'  # its connections close in finally
        try:
            comm.allgather(rank)
        except CollectiveError as e:
            return str(e)
        return 'gathered'
    finally:
        comm.close()


def test_a_lost_rank_is_named_with_the_collective_not_a_count(dask_client):
    workers = sorted(dask_client.scheduler_info()['workers'])
    left, said = dask_client.gather([
        dask_client.submit(_one_bcast_then, 'lost-test', r, 2, workers=[w],
                           pure=False) for r, w in enumerate(workers)])
    assert left == 'left'
    # The user called one bcast and one allgather: no message count.
    assert said.startswith('rank 0 closed its connection during an '
                           'allgather: '), said
    assert '#' not in said


def test_a_missing_rank_fails_the_rendezvous_after_the_timeout(dask_client):
    began = time.monotonic()
    future = dask_client.submit(
        lambda: DaskComm.rendezvous('lonely', 1, 2, timeout=1.5),
        pure=False)
    with pytest.raises(CollectiveError, match=r'rank 0 of 2 did not start '
                                              r'within 1.5 s'):
        future.result()
    assert time.monotonic() - began < 30


# ------------------------------------------------------- gradient exchange

def _overlapped(name, rank, size, bucket_mb):
    from dasktrain.parallel import GPUDistributedGradient
    from dasktrain.training.models import get_model
    np.random.seed(0)
    with DaskComm.rendezvous(name, rank, size, timeout=30) as comm:
        model = GPUDistributedGradient(get_model('cifar10'), ['@numpy'],
                                       comm=comm, bucket_mb=bucket_mb)
        model.setup(chainer.optimizers.MomentumSGD(lr=0.01))
        rng = np.random.RandomState(rank)
        for _ in range(3):
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
