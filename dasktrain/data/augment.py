"""Dask-parallel CIFAR augmentation and test-time views, per image.

Each image's random crop offset, flip and cutout position come from a hash
of (seed, epoch, global image index), never from the chunk or worker that
happens to process it, so an epoch is bit-identical under any chunking,
scheduler or number of workers. The operations work on a whole chunk at
once: one gather picks every image's crop, with no per-image Python loop.

Owns what happens to an image; batching, sharding and prefetching an epoch
are :mod:`dasktrain.data.loader`'s.
"""
import dask
import dask.array as da
import numpy as np

from dasktrain.config import MAX_TTA_VIEWS

# Per-channel statistics of the 50,000 CIFAR-10 training images, in uint8
# units, so normalisation is one multiply-add from the raw pixels.
CIFAR10_MEAN = (125.307, 122.950, 113.865)
CIFAR10_STD = (62.993, 62.089, 66.705)

# Test-time views: (dy, dx, flip); shifts are in pixels and stay inside the
# padding, so every view is a real crop of the padded image.
_TTA_VIEWS = ((0, 0, False), (0, 0, True), (-2, -2, False), (2, 2, False),
              (-2, 2, False), (2, -2, False), (-2, -2, True), (2, 2, True),
              (-2, 2, True), (2, -2, True))
assert len(_TTA_VIEWS) == MAX_TTA_VIEWS  # what TrainConfig accepts

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


def as_images(x, name='x'):
    """Validate uint8 or float (N, C, H, W) images, C in {1, 3}; return
    them as a dask array (chunks of :data:`DEFAULT_CHUNK` images for an
    in-memory array). ``name`` names the argument in the ValueError."""
    if not isinstance(x, da.Array):
        x = np.asarray(x)
    if x.dtype != np.uint8 and x.dtype.kind != 'f':
        raise ValueError(f'{name} must be uint8 or float images, got dtype '
                         f'{x.dtype}')
    if x.ndim != 4 or x.shape[1] not in (1, 3):
        raise ValueError(f'{name} must have shape (N, C, H, W) with C 1 or '
                         f'3, got {tuple(x.shape)}')
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
                      block.dtype)
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
    """Lazily augment uint8 images: crop after padding, flip, cutout,
    normalise.

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
    x = as_images(x)
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


def scaled_pad(height, at32=4):
    """Padding for images ``height`` pixels high: ``at32`` pixels at
    CIFAR's 32, in proportion elsewhere, at least 1.

    >>> scaled_pad(32), scaled_pad(16), scaled_pad(28), scaled_pad(8, 2)
    (4, 2, 4, 1)
    """
    return max(1, round(height * at32 / 32))


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
    x = as_images(x)
    pad = scaled_pad(x.shape[2], 2)  # 2 pixels at 32
    views = []
    for dy, dx, flip in _TTA_VIEWS[:k]:  # shifts of 2 at 32: scaled
        options = dict(dy=dy * pad // 2, dx=dx * pad // 2, flip=flip,
                       pad=pad, mean=tuple(mean),
                       std=tuple(std))
        name = 'tta-' + dask.base.tokenize(x.name, options)
        views.append(x.map_blocks(_view_block, dtype=np.float32, name=name,
                                  **options))
    return views
