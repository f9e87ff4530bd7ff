"""Persistent flat buffers for dg's gradient buckets: the gradients of a
bucket are views of them, as in PyTorch DDP.

A :class:`FlatBuckets` is made once per bucket plan: for each bucket and
each dtype on the wire one contiguous buffer on the master's device, and
for each parameter a view of its place there. A step copies each gradient
into its view once (:meth:`FlatBuckets.fill`; in float16, scaled by its
power of two on the way), the communicator sums the buffers in place (one
array per dtype: nothing re-flattened, one host transfer per buffer), and
:meth:`FlatBuckets.bind` makes each parameter's gradient the view of the
summed buffer (no copy back), or, in float16, writes the unscaled sum into
the gradient it had (one copy out). Two copies where there were four
(gradient, a copy to send, the communicator's flat buffer, the copy, the
gradient).

A parameter's gradient is such a view from :meth:`~FlatBuckets.bind` to
the next ``cleargrads()``; the next step's backward pass makes new
gradient arrays, so no backward kernel ever writes into a buffer that
an all-reduce reads. Double buffering keeps two :class:`FlatBuckets`, the
one in flight and the one being filled.

It sums nothing and knows no communicator; :func:`layout` is the pure
decision of where each gradient lies.
"""
import math

import chainer
import numpy as np


def layout(dtypes, sizes, plan, wire=None):
    """Where each gradient lies in the buffers of ``plan``.

    Parameters
    ----------
    dtypes, sizes : list
        Each parameter's gradient dtype and element count, by index.
    plan : list of lists of int
        The buckets' parameter indices.
    wire : numpy.dtype or None
        The dtype every gradient travels in (None: its own).

    Returns
    -------
    (list, dict)
        For each bucket, {dtype str: element count} of its buffers; and
        for each parameter index, (bucket, dtype str, offset).

    Examples
    --------
    >>> f4, f8 = np.dtype('float32'), np.dtype('float64')
    >>> layout([f4, f8, f4], [3, 2, 4], [[2, 0], [1]])
    ([{'<f4': 7}, {'<f8': 2}], {2: (0, '<f4', 0), 0: (0, '<f4', 4), 1: (1, '<f8', 0)})
    """  # noqa: E501
    counts, where = [], {}
    for k, bucket in enumerate(plan):
        mine = {}
        for i in bucket:
            key = np.dtype(wire if wire is not None else dtypes[i]).str
            where[i] = (k, key, mine.get(key, 0))
            mine[key] = mine.get(key, 0) + int(sizes[i])
        counts.append(mine)
    return counts, where


class FlatBuckets:
    """The persistent buffers of one bucket ``plan`` of ``params`` (the
    master's parameters in :func:`~dasktrain.parallel.buckets.parameters`'
    order) on ``device``, in the dtype ``wire`` (None: each gradient's
    own). Allocated once, here; every step reuses them.

    Attributes
    ----------
    plan : list of lists of int
    buffers : list of lists
        Each bucket's flat buffers, one per dtype in a fixed order (what
        an all-reduce sums).
    """

    def __init__(self, params, plan, device, wire=None):
        self.plan = [list(b) for b in plan]
        self.device, self.wire = device, wire
        counts, where = layout([p.array.dtype for p in params],
                               [p.array.size for p in params],
                               self.plan, wire)
        xp = device.xp
        with chainer.using_device(device):
            by_key = [{key: xp.empty(count, np.dtype(key))
                       for key, count in sorted(mine.items())}
                      for mine in counts]
        self.buffers = [list(mine.values()) for mine in by_key]
        # Each parameter's view, in its shape (a slice of a contiguous
        # buffer reshaped: contiguous, as Chainer's update rules expect).
        self.views = {}
        for i, (k, key, offset) in where.items():
            shape = params[i].array.shape
            size = params[i].array.size
            self.views[i] = by_key[k][key][offset:offset + size] \
                .reshape(shape)

    def fill(self, k, grads, scales=1.0):
        """Copy bucket ``k``'s gradients ``grads`` (in the plan's order)
        into its buffers, each times its scale (a list, or one for all);
        returns the buffers."""
        scales = scales if isinstance(scales, list) else \
            [scales] * len(grads)
        xp = self.device.xp
        with chainer.using_device(self.device):
            for i, g, s in zip(self.plan[k], grads, scales):
                if s == 1.0:
                    xp.copyto(self.views[i], g, casting='unsafe')
                else:  # computed in g's dtype, rounded once to the wire's
                    xp.multiply(g, s, out=self.views[i], casting='unsafe')
        return self.buffers[k]

    def bind(self, k, params, scales=1.0):
        """After the sum: each parameter of bucket ``k`` (``params``, all
        the master's) takes its view as its gradient where the dtypes
        match; else (float16 on the wire) its gradient := the view divided
        by its scale (a power of two: exact)."""
        scales = scales if isinstance(scales, list) else \
            [scales] * len(self.plan[k])
        xp = self.device.xp
        with chainer.using_device(self.device):
            for i, s in zip(self.plan[k], scales):
                p, view = params[i], self.views[i]
                if view.dtype == p.array.dtype and s == 1.0:
                    p.grad = view
                    continue
                xp.copyto(p.grad, view, casting='unsafe')
                if s != 1.0:
                    p.grad /= s


def largest(grads, device):
    """Each of ``grads``' largest magnitude, as floats: one read of them
    all (a GPU waits once per bucket, not once per array)."""
    with chainer.using_device(device):
        xp = device.xp
        return chainer.backends.cuda.to_cpu(xp.stack(
            [xp.abs(g).max() for g in grads])).tolist()


def wire_scales(largest, wire, ranks):
    """The power of two each array travels scaled by in ``wire`` (a float
    dtype), given its ``largest`` magnitude over all ``ranks``: the
    largest that keeps the sum of the ranks' arrays below ``wire``'s
    maximum, so the sum cannot overflow and small gradients keep their
    bits (1 where the largest is 0, inf or nan).

    Examples
    --------
    >>> wire_scales([1.0, 0.0], np.float16, 2)
    [8192.0, 1.0]
    """
    top = float(np.finfo(wire).max) / (2 * ranks)
    return [2.0 ** math.floor(math.log2(top / m))
            if math.isfinite(m) and m > 0 else 1.0 for m in largest]
