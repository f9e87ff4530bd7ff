"""An epoch's data for each replica: shards, minibatch order, prefetch.

The training images are cut into one contiguous shard per replica
(:func:`shard_bounds`); every epoch each replica visits its shard in the
order of the epoch's seeded global permutation (:func:`shard_batches`), so
every image is used exactly once per epoch, whatever the number of
processes holding the replicas. :class:`EpochLoader` augments the shards a
process owns, an epoch ahead of the training loop.

Owns batching and sharding; what happens to each image is
:mod:`dasktrain.data.augment`'s. Knows nothing of models or devices.
"""
import concurrent.futures
import threading
import time

import dask.array as da
import numpy as np

from dasktrain.data.augment import DEFAULT_CHUNK, as_images, augment, normalize


def epoch_permutation(n, seed, epoch):
    """The order of the ``n`` training images in ``epoch`` (seeded)."""
    return np.random.default_rng([seed, epoch, 0x5eed]).permutation(n)


def shard_bounds(n, parts):
    """(start, stop) of each part's contiguous shard of ``n`` images; sizes
    differ by at most one, larger first (as ``numpy.array_split``)."""
    edges = np.cumsum([0] + [len(a) for a in np.array_split(np.empty(n),
                                                              parts)])
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def _shard_plan(n, batch_size, parts, drop_last):
    """Validate; return (images per part per step, shard sizes, steps)."""
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f'batch_size must be an int >= 1, got {batch_size!r}')
    if not isinstance(parts, (int, np.integer)) or not 1 <= parts <= \
            max(1, min(n, batch_size)) or batch_size % parts:
        raise ValueError(f'parts must be an int >= 1 that divides batch_size'
                         f' ({batch_size}) and is at most the number of '
                         f'images ({n}), got {parts!r}')
    per = batch_size // parts
    sizes = [b - a for a, b in shard_bounds(n, parts)]
    steps = min(sizes) // per if drop_last else -(-max(sizes) // per)
    return per, sizes, steps


def shard_batches(n, batch_size, seed, epoch, parts=1, shuffle=True,
                  drop_last=False):
    """One epoch's minibatches as index arrays, one per part per step.

    Part ``p`` (a replica) owns the ``p``-th contiguous shard of the ``n``
    images and visits it in the order of the epoch's global permutation,
    ``batch_size // parts`` images a step; so every image is used exactly
    once per epoch, and a worker that holds some parts needs only their
    shards. With ``parts=1`` this is plain shuffled minibatching.

    Returns
    -------
    list of list of numpy.ndarray
        ``steps x parts`` index arrays (the last step's may be shorter,
        even empty, for some parts).
    """
    per, _, steps = _shard_plan(n, batch_size, parts, drop_last)
    order = epoch_permutation(n, seed, epoch) if shuffle else np.arange(n)
    shards = [order[(order >= lo) & (order < hi)] if parts > 1 else order
              for lo, hi in shard_bounds(n, parts)]
    return [[s[i * per:(i + 1) * per] for s in shards] for i in range(steps)]


def minibatch_indices(n, batch_size, seed, epoch, shuffle=True,
                      drop_last=False, parts=1):
    """Index arrays of one epoch's minibatches; each index exactly once
    (each step's parts concatenated; see :func:`shard_batches`)."""
    return [np.concatenate(step) for step in shard_batches(
        n, batch_size, seed, epoch, parts, shuffle, drop_last)]


class EpochLoader:
    """Augmented minibatches, epoch after epoch, prefetching the next epoch.

    While the caller trains on epoch ``e``, epoch ``e + 1`` is already being
    augmented in the background (as dask futures on a distributed client,
    else by a background thread driving the threaded scheduler). The time
    the caller spends blocked waiting for an epoch's data is recorded in
    :attr:`wait_times`.

    Parameters
    ----------
    images : dask.array.Array
        uint8 (N, 3, H, W) training images.
    labels : array-like
        int labels, length N.
    batch_size : int
        Images per minibatch (all replicas together).
    seed : int, default 0
        Fixes the permutations and the augmentation.
    augment_options : dict or None, default None
        Keyword arguments of :func:`~dasktrain.data.augment.augment`;
        ``None`` means no augmentation (normalisation only, with
        ``normalization``'s mean and std; CIFAR-10's by default).
    normalization : (mean, std) or False, optional
        Per-channel statistics of the images; False: the inputs are not
        images (any shape), passed on as they are, floats as float32.
    drop_last : bool, default False
        Drop the last minibatch when it is short.
    client : distributed.Client or False, optional
        Compute on this client; default: the active one if any, else
        threads; False: always threads (e.g. inside a Dask worker).
    prefetch : bool, default True
        Compute the next epoch while the current one is consumed.
    epochs : int, optional
        Number of epochs the caller will take; no epoch past it is
        prefetched.
    parts : int, default 1
        Replicas in the whole job; each owns a contiguous shard of the
        images (see :func:`shard_batches`) and ``batch_size // parts`` of
        every minibatch.
    own : range, optional
        The parts this loader serves (default: all). Only their shards are
        read and augmented; minibatches hold their parts, concatenated.
    cache : bool, default False
        Read the (own shards of the) images into memory once, now, rather
        than from ``images``' source every epoch.

    Examples
    --------
    >>> loader = EpochLoader(cifar.train_images, cifar.train_labels,
    ...                      128)  # doctest: +SKIP
    >>> for x, t in loader.epoch(0):  # doctest: +SKIP
    ...     model.step(x, t)
    """

    def __init__(self, images, labels, batch_size, seed=0,
                 augment_options=None, drop_last=False, client=None,
                 prefetch=True, shuffle=True, epochs=None, parts=1,
                 own=None, cache=False, normalization=None):
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f'batch_size must be an int >= 1, got '
                             f'{batch_size!r}')
        self.normalization = normalization
        if normalization is False:
            if augment_options is not None:
                raise ValueError('augment_options apply to images only')
            images = images if isinstance(images, da.Array) else \
                da.from_array(np.asarray(images), chunks=DEFAULT_CHUNK)
        else:
            images = as_images(images, 'images')
        self.labels = np.asarray(labels, dtype=np.int32)
        if self.labels.shape != (len(images),):
            raise ValueError(f'labels must have shape ({len(images)},), got '
                             f'{self.labels.shape}')
        self.parts = parts
        self.own = range(parts) if own is None else own
        _shard_plan(len(self.labels), batch_size, parts, drop_last)
        if not (isinstance(self.own, range) and self.own.step == 1 and
                0 <= self.own.start < self.own.stop <= parts):
            raise ValueError(f'own must be a range of parts within '
                             f'range({parts}), got {own!r}')
        bounds = shard_bounds(len(self.labels), parts)
        self.start = bounds[self.own.start][0]
        self.stop = bounds[self.own.stop - 1][1]
        self.images = images[self.start:self.stop] \
            if (self.start, self.stop) != (0, len(images)) else images
        if cache:
            self.images = self.images.rechunk(
                (DEFAULT_CHUNK,) + (-1,) * (self.images.ndim - 1)).persist(
                    scheduler='threads')
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.augment_options = augment_options
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.client = client
        self.prefetch = prefetch
        self.epochs = epochs
        self.wait_times = {}
        self._pending = {}
        self._buffers = [None, None]
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix='dasktrain-prefetch')

    def __len__(self):
        return _shard_plan(len(self.labels), self.batch_size, self.parts,
                           self.drop_last)[2]

    def epoch_array(self, epoch):
        """The lazy float32 array of ``epoch``'s inputs for this loader's
        shards (images ``start:stop``), in dataset order."""
        if self.normalization is False:  # not images
            x = self.images
            return x.astype(np.float32) if x.dtype.kind == 'f' else x
        stats = dict(zip(('mean', 'std'), self.normalization or ()))
        if self.augment_options is None:
            return normalize(self.images, **stats)
        return augment(self.images, self.seed, epoch, offset=self.start,
                       **stats, **self.augment_options)

    def _client(self):
        if self.client is False:
            return None
        if self.client is not None:
            return self.client
        try:
            from distributed import default_client
            client = default_client()
        except (ImportError, ValueError):
            return None
        return client if client.status == 'running' else None

    def _start(self, epoch):
        with self._lock:
            if epoch in self._pending:
                return
            array = self.epoch_array(epoch)
            client = self._client()
            if client is not None:
                self._pending[epoch] = client.compute(array)
            else:
                self._pending[epoch] = self._pool.submit(
                    self._store, array, epoch % 2)

    def _store(self, array, slot):
        # Two buffers, reused in turn: epoch e + 2 is written only after
        # epoch e was consumed (batches are copies), and reuse spares the
        # page faults of a fresh 600 MB array and dask's final concatenate.
        buffer = self._buffers[slot]
        if buffer is None or buffer.shape != array.shape:
            buffer = self._buffers[slot] = np.empty(array.shape, array.dtype)
        da.store(array, buffer, lock=False, scheduler='threads')
        return buffer

    def _take(self, epoch):
        self._start(epoch)
        with self._lock:
            future = self._pending.pop(epoch)
        began = time.perf_counter()
        data = future.result()
        self.wait_times[epoch] = time.perf_counter() - began
        return data

    def epoch(self, epoch):
        """Yield (x float32, t int32) minibatches of ``epoch``."""
        data = self._take(epoch)
        if self.prefetch and (self.epochs is None or epoch + 1 < self.epochs):
            self._start(epoch + 1)
        for step in shard_batches(len(self.labels), self.batch_size,
                                  self.seed, epoch, self.parts, self.shuffle,
                                  self.drop_last):
            index = np.concatenate(step[self.own.start:self.own.stop])
            yield data[index - self.start], self.labels[index]

    def step_totals(self):
        """Images per step in the whole job (all parts); the same every
        epoch, as only the order within shards changes."""
        per, sizes, steps = _shard_plan(len(self.labels), self.batch_size,
                                        self.parts, self.drop_last)
        return [sum(min(per, max(0, size - i * per)) for size in sizes)
                for i in range(steps)]

    def close(self):
        """Drop prefetched epochs and stop the background thread."""
        with self._lock:
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
