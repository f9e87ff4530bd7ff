"""Where arrays lie in a shared-memory region, and which slice is whose.

The pure layout of :mod:`~dasktrain.parallel.comm.shm`'s sums: each
dtype's arrays lie in one region of a segment (:func:`layout`), each
array starting on a cache line (:func:`unit`, :func:`starts`,
:func:`counts`); rank r owns the r-th slice of each region
(:func:`bounds`: np.array_split's bounds, each moved up to a cache line),
and :func:`pieces` says which parts of which arrays a slice holds. NumPy's
loops run about half as fast on operands that do not start on a cache
line, and the slowest rank's slice is every rank's wait at the next
barrier. :func:`parts`, :func:`places`, :func:`view`, :func:`put` and
:func:`spread` map a layout onto bytes and copy through it;
:func:`disjoint` tells whether a rank's arrays may be written through
while others are still read.

No processes, files or barriers here: only NumPy over the buffers it is
given.
"""
import numpy as np

#: Bytes: each dtype's region, each array in it and each rank's slice of
#: it start on a cache line. NumPy's loops run about half as fast on
#: operands that do not (seen: the sum of a 4-byte-misaligned slice of a
#: 22 MB mean 9 ms where an aligned one took 5.5, on a 2-CPU Xeon VM).
ALIGN = 64


def unit(dtype):
    """Elements of ``dtype`` in :data:`ALIGN` bytes (1 where they do not
    divide it): the step of every start in a region.

    Examples
    --------
    >>> unit(np.float32), unit(np.float64), unit(np.dtype('V3'))
    (16, 8, 1)
    """
    itemsize = np.dtype(dtype).itemsize
    return ALIGN // itemsize if itemsize and ALIGN % itemsize == 0 else 1


def starts(sizes, step=1):
    """Where each array of ``sizes`` starts in its region, each on a
    multiple of ``step`` elements (:func:`unit`), and the region's count.

    Examples
    --------
    >>> starts([3, 16, 2], 16)
    ([0, 16, 32], 34)
    >>> starts([3, 4], 1)
    ([0, 3], 7)
    """
    found, start = [], 0
    for size in sizes:
        found.append(start)
        start += -(-size // step) * step if size else 0
    return found, (found[-1] + sizes[-1]) if sizes else 0


def counts(groups, aligned=True):
    """{dtype str: its region's count} for ``groups`` = {dtype str:
    [arrays]}, each array on a cache line (:func:`starts`) where
    ``aligned``, else end to end."""
    return {key: starts([a.size for a in arrays],
                        unit(key) if aligned else 1)[1]
            for key, arrays in groups.items()}


def layout(packed):
    """(key, dtype, byte offset, count) of each dtype's region, and the
    total bytes, for ``packed`` = {dtype str: flat array or count}."""
    regions, offset = [], 0
    for key in sorted(packed):
        count = packed[key] if isinstance(packed[key], int) else \
            packed[key].size
        dtype = np.dtype(key)
        regions.append((key, dtype, offset, count))
        offset += -(-count * dtype.itemsize // ALIGN) * ALIGN
    return regions, max(offset, ALIGN)


def bounds(count, size, step=1):
    """[lo, hi) of each rank's slice of a region of ``count`` elements:
    np.array_split's bounds, each moved up to a multiple of ``step``
    (:func:`unit`: every slice starts on a cache line). Which rank sums
    which elements changes no bit: each is summed in rank order.

    Examples
    --------
    >>> bounds(7, 3)
    [(0, 3), (3, 5), (5, 7)]
    >>> bounds(40, 2, 16), bounds(10, 2, 16)
    ([(0, 32), (32, 40)], [(0, 10), (10, 10)])
    """
    edges = [0]
    base, extra = divmod(count, size)
    for r in range(size - 1):
        even = edges[-1] + base + (1 if r < extra else 0)
        edges.append(max(edges[-1], min(count, -(-even // step) * step)))
    edges.append(count)
    return list(zip(edges[:-1], edges[1:]))


def pieces(sizes, lo, hi, step=None, align=1):
    """Where elements [lo, hi) of a region holding arrays of ``sizes``,
    each starting on a multiple of ``align`` (:func:`starts`), lie:
    ``(array index, start in it, start in the region, count)``, in order,
    each at most ``step`` long (None: unbounded); the gaps between arrays
    are in no piece.

    Examples
    --------
    >>> pieces([3, 4, 2], 2, 8)
    [(0, 2, 2, 1), (1, 0, 3, 4), (2, 0, 7, 1)]
    >>> pieces([3, 4, 2], 2, 8, step=2)
    [(0, 2, 2, 1), (1, 0, 3, 2), (1, 2, 5, 2), (2, 0, 7, 1)]
    >>> pieces([3, 4], 3, 3)
    []
    >>> pieces([3, 4, 2], 2, 9, align=4)
    [(0, 2, 2, 1), (1, 0, 4, 4), (2, 0, 8, 1)]
    """
    found = []
    for index, (size, start) in enumerate(zip(sizes,
                                              starts(sizes, align)[0])):
        a_lo, a_hi = max(lo, start), min(hi, start + size)
        while a_lo < a_hi:
            n = a_hi - a_lo if step is None else min(step, a_hi - a_lo)
            found.append((index, a_lo - start, a_lo, n))
            a_lo += n
    return found


def disjoint(arrays):
    """Whether no two of ``arrays`` (host arrays) share a byte: the sums
    can then be written into each while the others are still read.

    Examples
    --------
    >>> a = np.zeros(6)
    >>> disjoint([a[:3], a[3:], np.ones(2)])
    True
    >>> disjoint([a[:4], a[3:]]), disjoint([a, a])
    (False, False)
    """
    spans = sorted((a.__array_interface__['data'][0], a.nbytes)
                   for a in arrays)
    return all(start + n <= after for (start, n), (after, _) in
               zip(spans, spans[1:]))


def view(raw, dtype, offset, count):
    """``count`` elements of ``dtype`` at byte ``offset`` of ``raw`` (a
    uint8 array)."""
    return raw[offset:offset + count * dtype.itemsize].view(dtype)


def parts(flat, arrays, step=1):
    """``(part, array)`` for each of ``arrays``: its place in ``flat``
    (one dtype's region), as :func:`starts` lays them on multiples of
    ``step``, shaped like it."""
    for a, start in zip(arrays, starts([a.size for a in arrays], step)[0]):
        yield flat[start:start + a.size].reshape(a.shape), a


def places(groups, regions, segment, aligned=True):
    """``(part, array)`` for each array of ``groups`` = {dtype str:
    [arrays]}: its place in ``segment`` (a segment with ``.bytes``, or a
    uint8 array), as :func:`layout`'s ``regions`` and :func:`parts` lay
    the arrays (each on a cache line where ``aligned``, else end to end)."""
    raw = getattr(segment, 'bytes', segment)
    return [pair for key, dtype, offset, count in regions
            for pair in parts(view(raw, dtype, offset, count), groups[key],
                              unit(dtype) if aligned else 1)]


def put(source, target, factor):
    """``target[...] = source`` (times ``factor`` where it is given: one
    pass, the product in ``target``'s dtype as ``target *= factor``)."""
    if factor is None:
        target[...] = source
    else:
        np.multiply(source, factor, out=target)


def spread(flat, arrays, factor, align=1):
    """Each of ``arrays`` (laid in ``flat`` as :func:`parts` lays them,
    each on a multiple of ``align``) its part of ``flat``, in order
    (times ``factor`` where it is given)."""
    for part, a in parts(flat, arrays, align):
        put(part, a, factor)
