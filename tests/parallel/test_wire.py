"""float16 on the wire (dasktrain.parallel.exchange.wire): the ranks agree on
each array's power of two inside the all-reduce that sums it, one collective
per bucket; a jump or drop is sent again, never summed into inf."""
import collections
import threading

import chainer
import numpy as np
import pytest
from test_parallel import Mirror, batch, fresh

from dasktrain.parallel import GPUDistributedGradient
from dasktrain.parallel.comm import Communicator
from dasktrain.parallel.exchange.flat import FlatBuckets, largest
from dasktrain.parallel.exchange.wire import (
    GUARD,
    SLACK,
    WireScales,
    first,
    judge,
    probe_exponent,
    spread,
)

F16 = float(np.finfo(np.float16).max)


class Ranks:
    """``n`` ranks of one job as threads of this process: each array summed
    in rank order (float16 as float16), every call counted per rank."""

    def __init__(self, n):
        self.n, self.slots = n, [None] * n
        self.barrier = threading.Barrier(n, timeout=30)

    def swap(self, rank, obj):
        self.slots[rank] = obj
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()
        return everyone


class Threaded(Communicator):
    solo, sums_on_device = False, False

    def __init__(self, ranks, rank):
        super().__init__(rank, ranks.n, 30.0)
        self.ranks, self.calls = ranks, collections.Counter()

    def allreduce(self, arrays, check=False):
        self.calls['allreduce'] += 1
        everyone = self.ranks.swap(self.rank, [a.copy() for a in arrays])
        with np.errstate(over='ignore', invalid='ignore'):
            for i, a in enumerate(arrays):
                acc = everyone[0][i].copy()
                for theirs in everyone[1:]:
                    acc += theirs[i]
                a[...] = acc
        return arrays

    def allgather(self, obj):
        self.calls['allgather'] += 1
        return self.ranks.swap(self.rank, obj)

    def gather(self, obj):
        return self.allgather(obj)

    def bcast(self, obj):
        return self.allgather(obj)[0]

    def close(self):
        pass


def test_the_pure_rules():
    # steady: 4-fold growth passes; more is sent again at the scale P tells
    assert spread(2) < 1.01 and probe_exponent(2) == 14
    exact, after = first([1.0], 2)
    assert after == [exact[0] - GUARD]
    probe = 2.0 ** (after[0] - probe_exponent(2))  # P of the same maxima
    now, ask, nxt = judge([probe], after, 2)
    assert now == [None] and not ask[0] and nxt == after
    assert judge([4 * probe], after, 2)[0] == [None]
    now, ask, _ = judge([1000 * probe], after, 2)
    # 1000x (2**9.97) past the 2**GUARD spare: 7 bits lower, as it fits
    assert now[0] == after[0] - 7 and not ask[0]
    # a drop of 2**SLACK passes; of more, sent again; far more: ask
    assert judge([probe / 2 ** SLACK], after, 2)[0] == [None]
    assert judge([probe / 2 ** (SLACK + 2)], after, 2)[0] != [None]
    assert judge([probe / 2 ** 14], after, 2)[1] == [True]
    assert judge([float('inf')], after, 2)[1] == [True]


def _rank(comm, steps, plan, shapes, magnitudes, seed, dtype=np.float32):
    """One rank sending each step's gradients (of ``dtype``) through
    FlatBuckets and WireScales: its decoded sums, scales and calls per
    step."""
    device = chainer.get_device('@numpy')
    params = [chainer.Parameter(np.zeros(s, dtype)) for s in shapes]
    flat = FlatBuckets(params, plan, device, np.dtype(np.float16),
                       probes=True)
    wire = WireScales(comm, device, largest)
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        grads = [(rng.standard_normal(s) * magnitudes[step][i] *
                  (1 + 10 * (comm.rank == i % comm.size))).astype(dtype)
                 for i, s in enumerate(shapes)]
        before = dict(comm.calls)
        sums, used = [], []
        for k, bucket in enumerate(plan):
            mine = [grads[i] for i in bucket]
            sent, record = wire.send(flat, k, mine)
            comm.allreduce(sent)
            scale = wire.settle(flat, k, mine, record, comm.allreduce)
            flat.bind(k, params, scale)
            used.append(scale)
        sums = [p.grad.copy() for p in params]
        calls = {c: comm.calls[c] - before.get(c, 0) for c in comm.calls
                 if comm.calls[c] > before.get(c, 0)}
        out.append((grads, sums, used, calls))
    return out


@pytest.mark.parametrize('n', [2, 3, 5])
def test_ranks_agree_and_no_sum_overflows_through_jumps_and_drops(n):
    # Each array's magnitude walks, jumps 1000-fold and 1e6-fold, drops,
    # turns zero and comes back; one rank's arrays are 11 times the rest.
    shapes = [(7, 5), (3,), (300,), (2, 2)]
    plan = [[2, 0], [1, 3]]
    walk = [1.0, 1.5, 0.8, 1000.0, 1200.0, 1e-3, 1e-3, 1e6, 3e5, 1e-6, 0.0,
            1.0, 2.0, 3.0, 2.5]
    magnitudes = [[m * (10.0 ** (i - 2)) if i != 3 or step < 12 else m
                   for i in range(len(shapes))]
                  for step, m in enumerate(walk)]
    ranks = Ranks(n)
    results = [None] * n

    def run(rank):
        results[rank] = _rank(Threaded(ranks, rank), len(walk), plan,
                              shapes, magnitudes, seed=rank)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None for r in results)
    for step in range(len(walk)):
        per_rank = [r[step] for r in results]
        for theirs in per_rank[1:]:  # the same scales, the same bits
            assert theirs[2] == per_rank[0][2]
            for a, b in zip(theirs[1], per_rank[0][1]):
                np.testing.assert_array_equal(a, b)
        exact = [sum(r[0][i].astype(np.float64) for r in per_rank)
                 for i in range(len(shapes))]
        bound = [sum(np.abs(r[0][i]).max() for r in per_rank)
                 for i in range(len(shapes))]
        for i, (got, want) in enumerate(zip(per_rank[0][1], exact)):
            assert np.isfinite(got).all(), (step, i)
            # float16's rounding: 11 bits of each addend and of each sum
            assert np.abs(got - want).max() <= 2.0 ** -9 * bound[i], \
                (step, i)
        calls = per_rank[0][3]
        if step in (1, 2, 6, 12, 13, 14):  # steady: one all-reduce each
            assert calls == {'allreduce': len(plan)}, (step, calls)
        if step in (3, 5, 7):  # 1000x: once more; 1e6x, 1e-3: ask first
            assert calls['allreduce'] > len(plan), (step, calls)


def test_float16_gradients_travel_at_scales_beyond_float16_s_range():
    # mixed16's gradients are float16 already: each is scaled by its
    # power of two (2**20 for these small ones, inf in float16) in
    # float32, exactly, and decoded back into float16.
    shapes, plan = [(40,), (3, 5)], [[0, 1]]
    walk = [1e-3, 1.2e-3, 2.0, 3e-3, 1e-4]
    ranks, results = Ranks(2), [None] * 2

    def run(rank):
        results[rank] = _rank(Threaded(ranks, rank), len(walk), plan,
                              shapes, [[m, m] for m in walk], seed=rank,
                              dtype=np.float16)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert max(max(k) for _, _, used, _ in results[0]
               for k in used) > 2.0 ** 15  # the largest float16 power
    for step in range(len(walk)):
        mine, theirs = results[0][step], results[1][step]
        for got, other, i in zip(mine[1], theirs[1], range(len(shapes))):
            np.testing.assert_array_equal(got, other)
            assert got.dtype == np.float16 and np.isfinite(got).all()
            exact = mine[0][i].astype(np.float64) + theirs[0][i]
            bound = np.abs(mine[0][i]).max() + np.abs(theirs[0][i]).max()
            assert np.abs(got - exact).max() <= 2.0 ** -9 * bound, step


class Scaled(chainer.Chain):
    """A classifier whose loss is multiplied by ``factor``: every gradient
    jumps with it."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.inner = fresh()
        self.factor = 1.0

    def forward(self, x, t):
        return self.inner(x, t) * self.factor


class Counting(Mirror):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def allreduce(self, arrays, check=False):
        self.calls['allreduce'] += 1
        return super().allreduce(arrays, check)

    def allgather(self, obj):
        self.calls['allgather'] += 1
        return super().allgather(obj)


OPTIONS = [{'bucket_mb': 1e-3}, {'bucket_mb': 0},
           {'double_buffering': True, 'warmup': 0, 'stale': 'plain'}]


@pytest.mark.parametrize('options', OPTIONS, ids=str)
def test_a_sudden_1000x_jump_is_summed_without_inf(options):
    # lr 0: the weights stay, so the float16 run's gradients differ from
    # the exact run's by float16's rounding alone, step after step.
    factors = [1, 1, 1, 1000, 1000, 1e6, 1, 1e-4, 1]
    runs = {}
    for dtype in (None, 'float16'):
        np.random.seed(0)
        comm = Counting()
        model = GPUDistributedGradient(Scaled(), ['@numpy'], comm=comm,
                                       comm_dtype=dtype, **options)
        model.setup(chainer.optimizers.SGD(lr=0))
        grads, calls = [], []
        for step, factor in enumerate(factors):
            model.master.factor = factor
            before = dict(comm.calls)
            model.step(*batch(6, step), total=12)
            calls.append({c: comm.calls[c] - before.get(c, 0)
                          for c in comm.calls
                          if comm.calls[c] > before.get(c, 0)})
            grads.append({k: p.grad.copy() for k, p in
                          sorted(model.master.namedparams())})
        model.end_epoch()
        runs[dtype] = grads, calls, model
    stale = options.get('double_buffering', False)
    exact, half = runs[None][0], runs['float16'][0]
    for step in range(1 if stale else 0, len(factors)):
        for key, want in exact[step].items():
            got = half[step][key]
            assert np.isfinite(got).all(), (step, key)
            tolerance = 2.0 ** -9 * np.abs(want).max() + 1e-30
            assert np.abs(got - want).max() <= tolerance, (step, key)
    wire = runs['float16'][2].exchange.wire
    assert wire.resent >= 2 and wire.asked >= 1
    if not stale:  # steps 1, 2: one all-reduce per bucket, as float32's
        buckets = runs[None][1][2]['allreduce']
        assert runs['float16'][1][2] == {'allreduce': buckets}


@pytest.mark.parametrize('options', OPTIONS[::2], ids=str)
def test_float16_runs_resume_bit_identical(tmp_path, options):
    # The scales predicted from the last sum are forgotten at every
    # epoch's end: a resumed run sends what an uninterrupted one sends.
    batches = [batch(6, seed) for seed in range(10)]

    def make():
        model = GPUDistributedGradient(fresh(), ['@numpy'], comm=Mirror(),
                                       comm_dtype='float16', **options)
        model.setup(chainer.optimizers.MomentumSGD(lr=0.05))
        return model

    def epoch(model, part):
        for x, t in part:
            model.step(x, t, total=2 * len(x))
        model.end_epoch()
    whole = make()
    epoch(whole, batches[:5])
    epoch(whole, batches[5:])
    first_half = make()
    epoch(first_half, batches[:5])
    chainer.serializers.save_npz(tmp_path / 'c.npz', first_half)
    resumed = make()
    with np.load(tmp_path / 'c.npz') as npz:
        resumed.restore(npz)
    epoch(resumed, batches[5:])
    for (key, a), (_, b) in zip(sorted(whole.master.namedparams()),
                                sorted(resumed.master.namedparams())):
        np.testing.assert_array_equal(a.array, b.array, err_msg=key)


def test_gradients_too_small_for_any_scale_cost_no_extra_collectives():
    # 1e-38 (float32's normal floor) needs a scale past 2**126: the
    # largest stands, no all-gather every step for what cannot improve.
    shapes, plan = [(5,), (40,)], [[0, 1]]
    magnitudes = [[1e-38, 1.0]] * 6
    ranks, results = Ranks(2), [None, None]

    def run(rank):
        results[rank] = _rank(Threaded(ranks, rank), len(magnitudes), plan,
                              shapes, magnitudes, seed=rank)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for step in range(2, len(magnitudes)):
        assert results[0][step][3] == {'allreduce': 1}, step
        grads, sums = [r[step][0] for r in results], results[0][step][1]
        want = grads[0][0].astype(np.float64) + grads[1][0]
        assert np.abs(sums[0] - want).max() <= 2.0 ** -9 * sum(
            np.abs(g[0]).max() for g in grads)
