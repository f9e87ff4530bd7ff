"""Persistent flat buffers for dg's gradient buckets: the gradients of a
bucket are views of them, as in PyTorch DDP.

A :class:`FlatBuckets` is made once per bucket plan: for each bucket and
each dtype on the wire one contiguous buffer on the master's device, and
for each parameter a view of its place there. A step copies each gradient
into its view once (:meth:`FlatBuckets.fill`; in float16, scaled by its
power of two on the way), the communicator sums the buffers in place (one
array per dtype: nothing re-flattened, one host transfer per buffer), and
:meth:`FlatBuckets.bind` makes each parameter's gradient the view of the
summed buffer (no copy back), or, in float16, an array of its own
holding the unscaled sum (one copy out). Two copies where there were four
(gradient, a copy to send, the communicator's flat buffer, the copy, the
gradient).

In float16 each bucket's buffer ends with one *probe* per array (each
rank's largest magnitude at its scale,
:mod:`~dasktrain.parallel.exchange.wire`), summed in the same all-reduce: the
ranks agree on the next scales, and on whether this sum stands, without a
collective of their own.

A parameter's gradient is such a view from :meth:`~FlatBuckets.bind` to
the next ``cleargrads()``; the next step's backward pass makes new
gradient arrays, so no backward kernel ever writes into a buffer that
an all-reduce reads. Double buffering keeps two :class:`FlatBuckets`, the
one in flight and the one being filled.

It sums nothing and knows no communicator; :func:`layout` is the pure
decision of where each gradient lies.
"""
import contextlib

import chainer
import numpy as np

from dasktrain.parallel.exchange.fused import FusedFill, fusable
from dasktrain.parallel.exchange.wire import TINY


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
    master's parameters in
    :func:`~dasktrain.parallel.exchange.buckets.parameters`' order) on
    ``device``, in the dtype ``wire`` (None: each gradient's own), with
    ``probes`` (float16's scaled wire: one per array, behind the bucket's
    arrays in its one buffer). Allocated once, here; every step reuses them.

    Attributes
    ----------
    plan : list of lists of int
    buffers : list of lists
        Each bucket's flat buffers, one per dtype in a fixed order (what
        an all-reduce sums).
    probes : list or None
        Each bucket's probes: the views of its buffer's last elements.
    """

    def __init__(self, params, plan, device, wire=None, probes=False):
        self.plan = [list(b) for b in plan]
        self.device, self.wire = device, wire
        counts, where = layout([p.array.dtype for p in params],
                               [p.array.size for p in params],
                               self.plan, wire)
        if probes:  # one dtype per bucket on a wire: the probes behind it
            key = np.dtype(wire).str
            for mine, bucket in zip(counts, self.plan):
                mine[key] = mine.get(key, 0) + len(bucket)
        xp = device.xp
        with chainer.using_device(device):
            by_key = [{key: xp.empty(count, np.dtype(key))
                       for key, count in sorted(mine.items())}
                      for mine in counts]
        self.buffers = [list(mine.values()) for mine in by_key]
        self._decoded = {}  # float16's sums, decoded: by parameter index
        self._where = where
        self._fused = {}  # float16 on a GPU: each bucket's two kernels
        self.probes = [mine[np.dtype(wire).str][-len(bucket):]
                       for mine, bucket in zip(by_key, self.plan)] \
            if probes else None
        # Each parameter's view, in its shape (a slice of a contiguous
        # buffer reshaped: contiguous, as Chainer's update rules expect).
        self.views = {}
        for i, (k, key, offset) in where.items():
            shape = params[i].array.shape
            size = params[i].array.size
            self.views[i] = by_key[k][key][offset:offset + size] \
                .reshape(shape)

    def fill(self, k, grads, scales=1.0, probes=None):
        """Copy bucket ``k``'s gradients ``grads`` (in the plan's order)
        into its buffers, each times its scale (a list, or one for all),
        and with ``probes`` (a factor per array) each one's largest
        magnitude times its factor into the bucket's probe (at least
        :data:`~dasktrain.parallel.exchange.wire.TINY` where the array is not
        all zero; NaN stays NaN); returns the buffers. A value beyond the
        wire's range becomes inf (what the probes reveal), quietly."""
        scales = scales if isinstance(scales, list) else \
            [scales] * len(grads)
        xp = self.device.xp
        if xp is not np and self.wire is not None and \
                np.dtype(self.wire) == np.float16 and fusable(grads):
            return self._fill_fused(k, grads, scales, probes)
        with chainer.using_device(self.device), _quiet(xp):
            for i, g, s in zip(self.plan[k], grads, scales):
                if s == 1.0:
                    xp.copyto(self.views[i], g, casting='unsafe')
                else:  # computed in g's dtype (float16's in float32,
                    # where every 2**k is), rounded once to the wire's
                    xp.multiply(g, s, out=self.views[i], casting='unsafe',
                                dtype=_computed(g.dtype))
            if self.probes is not None and probes is None:
                self.probes[k].fill(0)  # a second send: nothing to probe
            elif probes is not None:
                # max and -min: two reads of g, no |g| array written
                tops = xp.stack([
                    xp.maximum(g.max(), -g.min()).astype(_computed(g.dtype))
                    * f for g, f in zip(grads, probes)])
                xp.copyto(self.probes[k], xp.where(
                    tops == 0, 0, xp.maximum(tops, TINY)), casting='unsafe')
        return self.buffers[k]

    def _fill_fused(self, k, grads, scales, probes):
        """:meth:`fill` of float32 gradients into a float16 bucket on a
        GPU: two kernels for the bucket
        (:mod:`~dasktrain.parallel.exchange.fused`),
        the same bits."""
        import cupy
        with chainer.using_device(self.device):
            fused = self._fused.get(k)
            if fused is None:
                fused = self._fused[k] = FusedFill(
                    [int(g.size) for g in grads],
                    [self._where[i][2] for i in self.plan[k]])
            (buffer,) = self.buffers[k]  # one dtype on the wire
            wanted = probes is not None and self.probes is not None
            fused(grads, [float(s) for s in scales], buffer.view(cupy.uint16),
                  factors=[float(f) for f in probes] if wanted else None,
                  probes=self.probes[k].view(cupy.uint16) if wanted
                  else None)
            if self.probes is not None and probes is None:
                self.probes[k].fill(0)  # a second send: nothing to probe
        return self.buffers[k]

    def read_probes(self, k):
        """Bucket ``k``'s summed probes, on the host (after the sum: a
        read of a few numbers on this thread's stream, which ran it)."""
        return chainer.backends.cuda.to_cpu(self.probes[k]).tolist()

    def bind(self, k, params, scales=1.0):
        """After the sum: each parameter of bucket ``k`` (``params``, all
        the master's) takes its view as its gradient where the dtypes
        match; else (float16 on the wire) its decoded array: the view
        times the inverse of its scale (a power of two: exact), computed
        in the gradient's dtype, in an array of these buffers' own (made
        once), not in the gradient the parameter had: that one may be
        needed to send the bucket again (double buffering's float16 sums
        are judged a step later, and its two buffer sets alternate)."""
        scales = scales if isinstance(scales, list) else \
            [scales] * len(self.plan[k])
        xp = self.device.xp
        with chainer.using_device(self.device):
            for i, s in zip(self.plan[k], scales):
                p, view = params[i], self.views[i]
                if view.dtype == p.array.dtype and s == 1.0:
                    p.grad = view
                    continue
                out = self._decoded.get(i)
                if out is None:
                    out = self._decoded[i] = xp.empty_like(p.array)
                # dtype=: computed in the gradient's dtype, never the
                # wire's float16 (nor a float16 gradient's: 2**-k is
                # beyond its range), rounded once to the gradient's
                xp.multiply(view, 1.0 / s, out=out,
                            dtype=_computed(out.dtype), casting='unsafe')
                p.grad = out


def _computed(dtype):
    """The dtype a gradient of ``dtype`` is scaled in: its own, float32
    for float16 (whose range holds no power of two beyond 2**15).

    >>> _computed(np.dtype(np.float16)), _computed(np.dtype(np.float64))
    (dtype('float32'), dtype('float64'))
    """
    return np.promote_types(dtype, np.float32)


def _quiet(xp):
    """NumPy's overflow warnings off (a first float16 send may overflow;
    the probes tell, and it is sent again); nothing for CuPy."""
    return np.errstate(over='ignore', invalid='ignore') if xp is np \
        else contextlib.nullcontext()


def largest(grads, device):
    """Each of ``grads``' largest magnitude, as floats: one read of them
    all (a GPU waits once per bucket, not once per array)."""
    with chainer.using_device(device):
        xp = device.xp
        return chainer.backends.cuda.to_cpu(xp.stack(
            [xp.maximum(g.max(), -g.min()) for g in grads])).tolist()
