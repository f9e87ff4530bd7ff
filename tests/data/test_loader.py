"""The epoch's data per replica: shards, minibatch order, the prefetching
EpochLoader (dasktrain.data.loader)."""
import time

import dask.array as da
import numpy as np
import pytest

from dasktrain.data.augment import CIFAR10_MEAN, CIFAR10_STD, augment
from dasktrain.data.loader import EpochLoader, minibatch_indices, shard_batches

MEAN = np.array(CIFAR10_MEAN, np.float32).reshape(1, 3, 1, 1)
STD = np.array(CIFAR10_STD, np.float32).reshape(1, 3, 1, 1)


def images(n=50, seed=0):
    return np.random.RandomState(seed).randint(0, 256, (n, 3, 32, 32)) \
        .astype(np.uint8)


@pytest.mark.parametrize('call,message', [
    (lambda: minibatch_indices(10, 0, 0, 0), 'batch_size must be an int >= 1'),
    (lambda: EpochLoader(np.zeros((2, 3, 32, 32), np.uint8), [0, 1], 0),
     'batch_size must be an int >= 1, got 0'),
    (lambda: EpochLoader(np.zeros((2, 3, 32, 32), np.uint8), [0], 1),
     r'labels must have shape \(2,\)'),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize('drop_last', [False, True])
def test_epoch_covers_every_index_once(drop_last):
    batches = minibatch_indices(103, 10, 7, 3, drop_last=drop_last)
    sizes = [len(b) for b in batches]
    assert sizes == [10] * 10 + ([] if drop_last else [3])
    seen = np.concatenate(batches)
    assert len(np.unique(seen)) == len(seen)
    assert len(seen) == (100 if drop_last else 103)
    assert not np.array_equal(seen, np.arange(len(seen)))
    again = np.concatenate(minibatch_indices(103, 10, 7, 3,
                                             drop_last=drop_last))
    other = np.concatenate(minibatch_indices(103, 10, 7, 4,
                                             drop_last=drop_last))
    assert np.array_equal(seen, again) and not np.array_equal(seen, other)


def test_loader_yields_augmented_minibatches():
    x, labels = images(45), np.arange(45) % 10
    with EpochLoader(da.from_array(x, chunks=20), labels, 8, seed=2,
                     augment_options={}) as loader:
        batches = list(loader.epoch(0))
    full = augment(x, 2, 0).compute()
    order = np.concatenate(minibatch_indices(45, 8, 2, 0))
    assert [len(t) for _, t in batches] == [8] * 5 + [5]
    np.testing.assert_array_equal(np.concatenate([b for b, _ in batches]),
                                  full[order])
    np.testing.assert_array_equal(np.concatenate([t for _, t in batches]),
                                  labels[order])


def test_loader_on_a_client_equals_threads(dask_client):
    x, labels = images(30), np.arange(30) % 10
    with EpochLoader(da.from_array(x, chunks=10), labels, 7,
                     augment_options={'cutout': 4}) as loader:
        local = [b for b, _ in loader.epoch(1)]
    with EpochLoader(da.from_array(x, chunks=10), labels, 7,
                     augment_options={'cutout': 4},
                     client=dask_client) as loader:
        remote = [b for b, _ in loader.epoch(1)]
    for a, b in zip(local, remote, strict=True):
        assert np.array_equal(a, b)


def test_prefetch_overlaps_with_the_consumer():
    x = da.from_array(images(2000), chunks=500)
    with EpochLoader(x, np.zeros(2000), 100, augment_options={},
                     epochs=2) as loader:
        batches = loader.epoch(0)
        next(batches)  # the consumer now holds epoch 0 and is busy
        pending = loader._pending[1]
        deadline = time.monotonic() + 60
        while not pending.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pending.done(), 'epoch 1 was not computed in the background'
        assert 1 not in loader.wait_times  # nobody asked for it yet
        list(batches)
        list(loader.epoch(1))
        assert loader.wait_times[1] < 0.05
        assert 2 not in loader._pending  # no prefetch past the last epoch


def test_no_augmentation_is_plain_normalisation():
    x = images(10)
    with EpochLoader(x, np.zeros(10), 10, augment_options=None,
                     shuffle=False) as loader:
        (batch, _), = loader.epoch(0)
    np.testing.assert_allclose(batch, (x - MEAN) / STD, rtol=1e-6, atol=1e-6)


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
