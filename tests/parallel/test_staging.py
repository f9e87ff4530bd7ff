"""Which staging buffers a communicator keeps (dasktrain.parallel.comm.
staging.Staging), driven as DaskComm drives it, with an allocator that
records what it makes and frees in place of pinned memory: the cache's
rule, not the GPU's copies (tests/gpu/test_gpu_ranks.py runs those)."""
import pytest

from dasktrain.parallel.comm.staging import Staging


class Allocator:
    """Buffers as records: each ``allocate`` makes a new object, each
    ``release`` must free a live one, once."""

    def __init__(self):
        self.made, self.freed, self.live = [], [], {}

    def allocate(self, key):
        buffer = object()
        self.made.append(key)
        self.live[id(buffer)] = key
        return buffer

    def release(self, key, buffer):
        assert self.live.pop(id(buffer)) == key  # its own key, once
        self.freed.append(key)


def steps(staging, plan, n):
    """``n`` steps of all-reduces, one per entry of ``plan`` (the keys each
    asks for, in batch order); each buffer handed out must not be freed
    before its round ends."""
    live = staging.allocate.__self__.live  # its Allocator's
    for _ in range(n):
        for keys in plan:
            staging.next_round()
            buffers = [staging.take(key) for key in keys]
            assert staging.used() == buffers  # what its copies mark
            assert {id(b) for b in buffers} <= set(live)


def fresh():
    alloc = Allocator()
    return alloc, Staging(alloc.allocate, alloc.release)


def key(k, size, gpu=0):
    return (k, '<f4', size, gpu)


BUCKETS = [[key(0, 1000)], [key(0, 700)], [key(0, 300)]]


@pytest.mark.parametrize('buckets,twice', [(2, 0), (3, 3), (8, 8)])
def test_a_steady_pattern_is_kept_whole_and_made_no_more(buckets, twice):
    # Gradient buckets, an all-reduce each, every step: each buffer is
    # made in the first step, and where its gap is longer than the slack
    # once more (its second use teaches its gap); none after.
    alloc, staging = fresh()
    plan = [[key(0, 100 * (b + 1))] for b in range(buckets)]
    steps(staging, plan, 2)
    made = list(alloc.made)
    assert len(made) == buckets + twice and set(made) == {k for (k,) in plan}
    steps(staging, plan, 20)
    assert alloc.made == made and len(alloc.freed) == twice
    assert sorted(staging.keys()) == sorted(k for (k,) in plan)


def test_after_sizes_change_only_the_current_buffers_remain():
    # Another bucket plan (or a model of other sizes): the old buffers are
    # freed one period later, each once; the new ones stay.
    alloc, staging = fresh()
    steps(staging, BUCKETS, 5)
    new = [[key(0, 900)], [key(0, 1100)]]
    steps(staging, new, 3)  # two periods of the old plan: 6 rounds
    assert len(staging.keys()) == 3  # the last old one is not yet gone
    steps(staging, new, 1)
    assert sorted(staging.keys()) == sorted(k for (k,) in new)
    assert sorted(alloc.live.values()) == sorted(k for (k,) in new)
    for (k,) in BUCKETS:
        assert alloc.made.count(k) == alloc.freed.count(k)


def test_one_batch_of_another_size_is_freed_and_the_pattern_kept():
    # An epoch's last, smaller batch: its buffer goes two rounds later;
    # the buckets' buffers are neither freed nor made again.
    alloc, staging = fresh()
    steps(staging, BUCKETS, 3)
    made, freed = len(alloc.made), len(alloc.freed)
    steps(staging, [[key(0, 1000)], [key(0, 700)], [key(0, 299)]], 1)
    steps(staging, BUCKETS, 3)
    assert alloc.made[made:] == [key(0, 299)]
    assert alloc.freed[freed:] == [key(0, 299)]
    assert sorted(staging.keys()) == sorted(k for (k,) in BUCKETS)


def test_sizes_that_never_repeat_keep_three_rounds_of_buffers_at_most():
    # Arrays of a new length at every all-reduce (a batch of sequences):
    # what is kept is bounded by the last rounds, not by every size seen.
    alloc, staging = fresh()
    for n in range(1, 200):
        staging.next_round()
        staging.take(key(0, n))
        staging.take(key(1, 2 * n))  # two batches in one all-reduce
        assert len(alloc.live) <= 6
    assert len(alloc.made) == 2 * 199 and len(alloc.freed) == 2 * 196


def test_an_occasional_sum_learns_its_gap_and_stays():
    # A sum every 10 steps (an evaluation's): made twice, then kept.
    alloc, staging = fresh()
    every = key(0, 42)
    for step in range(100):
        plan = BUCKETS + ([[every]] if step % 10 == 0 else [])
        steps(staging, plan, 1)
    assert alloc.made.count(every) == 2 and alloc.freed.count(every) == 1
    assert every in staging.keys()


def test_batches_of_one_all_reduce_are_kept_together():
    # Batch positions are keys of their own: one all-reduce of three
    # dtypes on two GPUs asks for six buffers, each handed out once.
    alloc, staging = fresh()
    batches = [(k, dtype, 10 * k + 1, gpu) for k, (dtype, gpu) in enumerate(
        [(d, g) for d in ('<f2', '<f4', '<f8') for g in (0, 1)])]
    steps(staging, [batches], 4)
    assert sorted(staging.keys()) == sorted(batches)
    assert alloc.freed == [] and sorted(alloc.made) == sorted(batches)


def test_clear_frees_every_buffer_once():
    alloc, staging = fresh()
    steps(staging, BUCKETS, 3)
    staging.clear()
    assert alloc.live == {} and staging.keys() == []
    assert sorted(alloc.made) == sorted(alloc.freed)


@pytest.mark.parametrize('remembered,made', [(0, 80), (4096, 8)])
def test_what_is_remembered_of_freed_keys_is_bounded(remembered, made):
    # Forgotten, a key needed again starts over: made at every use.
    alloc = Allocator()
    staging = Staging(alloc.allocate, alloc.release, remembered=remembered)
    steps(staging, [[key(0, n)] for n in range(4)], 20)
    assert len(alloc.made) == made
    assert len(staging._seen) <= len(staging.keys()) + remembered
