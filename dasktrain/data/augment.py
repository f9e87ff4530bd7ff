"""Dask-parallel CIFAR augmentation that never makes training wait.

Each image's random crop offset, flip and cutout position come from a hash
of (seed, epoch, global image index), never from the chunk or worker that
happens to process it, so an epoch is bit-identical under any chunking,
scheduler or number of workers. The operations work on a whole chunk at
once: one gather picks every image's crop, with no per-image Python loop.
"""
import concurrent.futures
import threading
import time

import dask
import dask.array as da
import numpy as np

# Per-channel statistics of the 50,000 CIFAR-10 training images, in uint8
# units, so normalisation is one multiply-add from the raw pixels.
CIFAR10_MEAN = (125.307, 122.950, 113.865)
CIFAR10_STD = (62.993, 62.089, 66.705)

# Test-time views: (dy, dx, flip); shifts are in pixels and stay inside the
# padding, so every view is a real crop of the padded image.
_TTA_VIEWS = ((0, 0, False), (0, 0, True), (-2, -2, False), (2, 2, False),
              (-2, 2, False), (2, -2, False), (-2, -2, True), (2, 2, True),
              (-2, 2, True), (2, -2, True))
MAX_TTA_VIEWS = len(_TTA_VIEWS)

# Images per task for in-memory inputs: 20 tasks for CIFAR-10's 50,000 keep
# every core busy to the end, and 2,500 images amortise a task's overhead.
DEFAULT_CHUNK = 2500


def _mix(x):
    """SplitMix64 finaliser: a bijective, well-mixed 64-bit hash (uint64)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over='ignore'):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def image_hashes(seed, epoch, indices):
    """One 64-bit random word per global image index, for (seed, epoch)."""
    key = _mix(_mix(np.uint64(seed & 0xFFFFFFFFFFFFFFFF)) ^
               np.uint64(epoch & 0xFFFFFFFFFFFFFFFF))
    with np.errstate(over='ignore'):
        return _mix(key + np.asarray(indices, np.uint64) *
                    np.uint64(0x9E3779B97F4A7C15))


def _as_images(x, name='x'):
    """Validate uint8 (N, 3, H, W) images; return them as a dask array."""
    if not isinstance(x, da.Array):
        x = np.asarray(x)
    if x.dtype != np.uint8:
        raise ValueError(f'{name} must be uint8 images, got dtype {x.dtype}')
    if x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f'{name} must have shape (N, 3, H, W), got '
                         f'{tuple(x.shape)}')
    if not isinstance(x, da.Array):
        x = da.from_array(x, chunks=(DEFAULT_CHUNK, -1, -1, -1))
    return x


def _check_pad(pad, padding):
    if not isinstance(pad, (int, np.integer)) or pad < 0:
        raise ValueError(f'pad must be an int >= 0, got {pad!r}')
    if padding not in ('reflect', 'zero'):
        raise ValueError(f"padding must be 'reflect' or 'zero', got "
                         f'{padding!r}')


# Images per sub-block: small enough that the padded copy, the crop and the
# float32 output of a sub-block stay in a core's L2 cache. The whole chunk at
# once is memory-bound and two cores then share one memory bus (measured on a
# 2-core EPYC: 115k images/s and no gain from a second thread, against 190k
# and 1.5-1.8x with 128-256 image sub-blocks).
_SUB_BLOCK = 192


def _transform(block, dy, dx, flip, pad, padding, cut_y=None, cut_x=None,
               cutout=0, mean=CIFAR10_MEAN, std=CIFAR10_STD):
    """Crop (offsets dy, dx into the padded image), flip, cutout, normalise.

    ``dy``, ``dx`` (ints in 0..2*pad) and ``flip`` (bools) are per image.
    Returns float32 of the block's shape.
    """
    n, c, h, w = block.shape
    scale = (1.0 / np.asarray(std, np.float32)).reshape(1, c, 1, 1)
    shift = (-np.asarray(mean, np.float32) * scale.ravel()).reshape(1, c, 1, 1)
    out = np.empty(block.shape, np.float32)
    padded = np.zeros((min(n, _SUB_BLOCK), c, h + 2 * pad, w + 2 * pad),
                      np.uint8)
    for lo in range(0, n, _SUB_BLOCK):
        hi = min(lo + _SUB_BLOCK, n)
        m, part = hi - lo, padded[:hi - lo]
        if padding == 'reflect' and pad:
            part[...] = np.pad(block[lo:hi], ((0, 0), (0, 0), (pad, pad),
                                              (pad, pad)), mode='reflect')
        else:  # the border stays zero from the allocation
            part[:, :, pad:pad + h, pad:pad + w] = block[lo:hi]
        # All (2*pad+1)**2 crops of every image as a view; one gather picks
        # each image's own crop.
        windows = np.lib.stride_tricks.sliding_window_view(
            part, (h, w), axis=(2, 3))
        crop = windows[np.arange(m), :, dy[lo:hi], dx[lo:hi]]
        flipped = flip[lo:hi]
        if flipped.any():
            crop[flipped] = crop[flipped][..., ::-1]
        o = out[lo:hi]
        np.multiply(crop, scale, out=o, dtype=np.float32)
        o += shift
        if cutout:
            half = cutout // 2
            rows = np.arange(h)[None, :] - cut_y[lo:hi, None]
            cols = np.arange(w)[None, :] - cut_x[lo:hi, None]
            inside_r = (rows >= -half) & (rows < cutout - half)
            inside_c = (cols >= -half) & (cols < cutout - half)
            # After normalisation 0 is the dataset mean: cutout removes
            # the signal without adding a colour.
            o *= ~(inside_r[:, None, :, None] & inside_c[:, None, None, :])
    return out


def augment_block(block, seed, epoch, start, pad=4, padding='zero',
                  flip=True, cutout=0, mean=CIFAR10_MEAN, std=CIFAR10_STD):
    """Augment one chunk whose first image has global index ``start``."""
    n, _, h, w = block.shape
    hashes = image_hashes(seed, epoch, np.arange(start, start + n))
    span = np.uint64(2 * pad + 1)
    dy = (hashes % span).astype(np.intp)
    dx = ((hashes >> np.uint64(8)) % span).astype(np.intp)
    flips = ((hashes >> np.uint64(16)) & np.uint64(1)).astype(bool) & flip
    cut_y = ((hashes >> np.uint64(24)) % np.uint64(h)).astype(np.intp)
    cut_x = ((hashes >> np.uint64(40)) % np.uint64(w)).astype(np.intp)
    return _transform(block, dy, dx, flips, pad, padding, cut_y, cut_x,
                      cutout, mean, std)


def _block_with_location(block, block_info=None, offset=0, **kwargs):
    start = offset + block_info[0]['array-location'][0][0]
    return augment_block(block, start=start, **kwargs)


def augment(x, seed, epoch, *, pad=4, padding='zero', flip=True,
            cutout=0, mean=CIFAR10_MEAN, std=CIFAR10_STD, offset=0):
    """Lazily augment uint8 images: crop after padding, flip, cutout, normalise.

    One task per chunk of ``x``; the result computes on whatever scheduler
    is in effect (the threaded one by default, a ``distributed.Client``
    when one is active).

    Parameters
    ----------
    x : dask.array.Array or numpy.ndarray
        uint8 images of shape (N, 3, H, W).
    seed, epoch : int
        Together with each image's index, fix all of its randomness.
    pad : int, default 4
        Pixels of padding before the random crop back to (H, W); 0 disables
        cropping.
    padding : {'zero', 'reflect'}, default 'zero'
        Zero padding as in He et al. (2016); 'reflect' mirrors the border.
    flip : bool, default True
        Random horizontal flip with probability 1/2.
    cutout : int, default 0
        Side of the square set to the mean at a random centre (0: none).
    mean, std : sequence of 3 floats
        Per-channel statistics in uint8 units; default CIFAR-10's.
    offset : int, default 0
        Index of ``x[0]`` in the whole dataset, when ``x`` is one shard of
        it: an image is augmented the same wherever it is computed.

    Returns
    -------
    dask.array.Array
        float32 of shape (N, 3, H, W), chunked like ``x``.

    Examples
    --------
    >>> import numpy as np, dask.array as da
    >>> x = da.zeros((8, 3, 32, 32), dtype=np.uint8, chunks=4)
    >>> augment(x, seed=0, epoch=0).compute().shape
    (8, 3, 32, 32)
    """
    x = _as_images(x)
    _check_pad(pad, padding)
    if not isinstance(cutout, (int, np.integer)) or cutout < 0:
        raise ValueError(f'cutout must be an int >= 0, got {cutout!r}')
    if x.chunks[1:] != tuple((s,) for s in x.shape[1:]):
        x = x.rechunk({1: -1, 2: -1, 3: -1})
    options = dict(seed=int(seed), epoch=int(epoch), pad=int(pad),
                   padding=padding, flip=bool(flip), cutout=int(cutout),
                   mean=tuple(mean), std=tuple(std), offset=int(offset))
    name = 'augment-' + dask.base.tokenize(x.name, options)
    return x.map_blocks(_block_with_location, dtype=np.float32, name=name,
                        **options)


def normalize(x, mean=CIFAR10_MEAN, std=CIFAR10_STD):
    """Only the normalisation: uint8 (N, 3, H, W) to float32, lazily."""
    return tta_views(x, 1, mean=mean, std=std)[0]


def _view_block(block, dy, dx, flip, pad, mean, std):
    n = len(block)
    full = np.full(n, 1, np.intp)
    return _transform(block, full * (pad + dy), full * (pad + dx),
                      np.full(n, flip), pad, 'reflect', mean=mean, std=std)


def tta_views(x, k, *, mean=CIFAR10_MEAN, std=CIFAR10_STD):
    """``k`` deterministic views of ``x`` for test-time augmentation.

    View 0 is the image itself, view 1 its mirror image, then crops shifted
    by 2 pixels in each diagonal direction, unflipped and flipped. Average a
    model's predicted probabilities over the views.

    Returns
    -------
    list of dask.array.Array
        ``k`` float32 arrays shaped like ``x``.
    """
    if not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_TTA_VIEWS:
        raise ValueError(f'k must be an int in 1..{MAX_TTA_VIEWS}, got {k!r}')
    x = _as_images(x)
    pad = 2
    views = []
    for dy, dx, flip in _TTA_VIEWS[:k]:
        options = dict(dy=dy, dx=dx, flip=flip, pad=pad, mean=tuple(mean),
                       std=tuple(std))
        name = 'tta-' + dask.base.tokenize(x.name, options)
        views.append(x.map_blocks(_view_block, dtype=np.float32, name=name,
                                  **options))
    return views


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
        raise ValueError(f'batch_size must be an int >= 1, got '
                         f'{batch_size!r}')
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
    augment_options : dict or None, default {}
        Keyword arguments of :func:`augment`; ``None`` means no augmentation
        (normalisation only).
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
    >>> loader = EpochLoader(cifar.train_images, cifar.train_labels, 128)  # doctest: +SKIP
    >>> for x, t in loader.epoch(0):  # doctest: +SKIP
    ...     model.step(x, t)
    """

    def __init__(self, images, labels, batch_size, seed=0,
                 augment_options=None, drop_last=False, client=None,
                 prefetch=True, shuffle=True, epochs=None, parts=1,
                 own=None, cache=False):
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f'batch_size must be an int >= 1, got '
                             f'{batch_size!r}')
        images = _as_images(images, 'images')
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
                (DEFAULT_CHUNK, -1, -1, -1)).persist(scheduler='threads')
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
        if self.augment_options is None:
            return normalize(self.images)
        return augment(self.images, self.seed, epoch, offset=self.start,
                       **self.augment_options)

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
