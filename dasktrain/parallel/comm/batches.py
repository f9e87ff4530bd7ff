"""The arrays of one collective, as they travel: :func:`signature` (what
an all-reduce sums, for comparing ranks), :func:`batches` and
:func:`packing` (the pure decisions of which arrays travel as one flat
buffer and how it is made: a flat buffer already, such as a gradient
bucket's, travels as itself, nothing re-flattened), :func:`place` (where
an array lies) and :func:`scaled` (a sum made a mean in place).

It knows NumPy's arrays and, by their ``device``, CuPy's; it never
imports CuPy or Chainer.
"""
import numpy as np


def scaled(arrays, scale):
    """``a *= scale`` for each of ``arrays`` (nothing where ``scale`` is
    None), a GPU array on its own device and current stream: after the
    work queued there that wrote it.

    Examples
    --------
    >>> a = np.ones(2, np.float32)
    >>> scaled([a], 0.5)[0]
    array([0.5, 0.5], dtype=float32)
    """
    if scale is not None:
        for a in arrays:
            if isinstance(a, np.ndarray):
                a *= scale
            else:
                with a.device:
                    a *= scale
    return arrays


def signature(arrays, where=False):
    """What an all-reduce of ``arrays`` sums, for comparing ranks: each
    array's dtype and size, and with ``where`` whether it is on a GPU
    (NcclComm sums those apart from host arrays).

    Examples
    --------
    >>> signature([np.zeros(3, np.float32)], where=True)
    [('<f4', 3, False)]
    """
    return [(np.dtype(a.dtype).str, int(a.size)) +
            ((not isinstance(a, np.ndarray),) if where else ())
            for a in arrays]


def place(a):
    """Where ``a`` lies, for :func:`packing`: (its GPU's id, None for a
    host array; whether it is C-contiguous).

    Examples
    --------
    >>> place(np.zeros((2, 3))[:, :2])
    (None, False)
    """
    device = None if isinstance(a, np.ndarray) else a.device.id
    return device, bool(a.flags.c_contiguous)


#: Bytes from which an array travels as itself (a flat buffer already,
#: e.g. a gradient bucket's): copying it into one with the small arrays of
#: its dtype would cost more than the message it saves.
ITSELF_BYTES = 1 << 16


def batches(arrays):
    """The arrays of one all-reduce, as the flat buffers they travel in:
    each array of at least :data:`ITSELF_BYTES` on its own, then the
    others by dtype (joined as :func:`packing` says). Decided by dtypes
    and sizes alone, which ranks compare (:func:`signature`): the same
    batches on every rank.

    Returns
    -------
    list of (str, list)
        Each batch's dtype (``numpy.dtype.str``) and arrays, in an order
        every rank with the same arrays agrees on.

    Examples
    --------
    >>> big, small = np.zeros(2 ** 15), np.zeros(3)
    >>> [(key, len(members)) for key, members in
    ...  batches([small, big, small.astype(np.float32), small])]
    [('<f8', 1), ('<f8', 2), ('<f4', 1)]
    """
    alone, joined = [], {}
    for a in arrays:
        key = np.dtype(a.dtype).str
        if a.nbytes >= ITSELF_BYTES:
            alone.append((key, [a]))
        else:
            joined.setdefault(key, []).append(a)
    return alone + list(joined.items())


def packing(places):
    """How the arrays of one dtype, at ``places`` (from :func:`place`),
    become one flat buffer to sum: ``'itself'`` (one contiguous array,
    a flat buffer already: summed where it lies, nothing copied),
    ``'host'`` (host arrays, copied into one), ``'device'`` (GPU arrays
    all on one GPU: joined there, one transfer to the host) or ``'each'``
    (mixed: one transfer per array).

    Examples
    --------
    >>> packing([(None, True)]), packing([(0, True), (0, False)])
    ('itself', 'device')
    >>> packing([(None, True), (None, True)]), packing([(0, True), (1, True)])
    ('host', 'each')
    """
    if len(places) == 1 and places[0][1]:
        return 'itself'
    devices = {device for device, _ in places}
    if devices == {None}:
        return 'host'
    return 'device' if len(devices) == 1 else 'each'
