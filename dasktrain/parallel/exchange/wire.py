"""float16 on the wire: each gradient array's power of two, agreed by the
ranks inside the very all-reduce that sums the array.

A gradient bucket travels in float16 as each array times its own power of
two ``2**k`` (the same on every rank), so that the sum over the ranks
cannot overflow float16 and small gradients keep their bits. The ranks
must agree on ``k`` before they send, yet a sum all-reduce offers no max.
What bounds the sum is itself a sum: ``|sum_r x_r| <= sum_r max|x_r|``.
So every bucket carries, behind its arrays, one float16 *probe* per array:
each rank's largest magnitude ``m_r`` at the scale it used, times
``2**-PROBE``; the all-reduce that sums the arrays sums the probes too, and
every rank reads the same ``P = sum_r m_r 2**(k - PROBE)`` (every rank gets
the same sums: dg already rests on it, each rank applying its own copy of
the summed gradient).

One collective per bucket:

1. ``k`` is *predicted* from the array's last sum (:func:`judge`'s
   ``after``), ``GUARD`` bits below the ideal: the largest ``k`` with
   ``2**k * F * sum_r m_r <= fmax / 2``, where ``F`` bounds float16's
   rounding of N addends (:func:`spread`) and ``fmax / 2`` keeps one bit
   more. A bucket's first step of an epoch has nothing to predict from:
   its ranks all-gather their exact maxima first (:func:`first`; the
   predictions are forgotten at every epoch's end, so that a run resumed
   from a checkpoint sends what an uninterrupted one sends, bit for bit).
2. The bucket and its probes are summed (one all-reduce).
3. :func:`judge` reads ``P`` on every rank alike: while the array's sum of
   maxima grew at most ``2**GUARD``-fold since the last step (the sum
   cannot have overflowed: the bound holds) and shrank at most
   ``2**SLACK``-fold (its smallest elements keep their bits), the sum
   stands. Otherwise the bucket is sent again at the ideal
   scale ``P`` tells (a second collective, rare: a sudden jump or drop),
   and where ``P`` cannot tell (a probe beyond float16, or too small to be
   precise) the ranks first all-gather their exact maxima, as on a
   bucket's first step (:func:`ideal`).

So an overflow is never silent: the decision rests on a bound of the sum
itself, computed identically on every rank from bits every rank holds, not
on noticing infinities after the fact (a sum can lose bits without one).
Every decision here is a pure function of those bits, tested on the CPU;
:class:`WireScales` applies them for one exchange (the all-gathers they
ask for go over its communicator). The buckets and when they travel are
:mod:`~dasktrain.parallel.exchange.gradients`'s, the buffers and probes
:mod:`~dasktrain.parallel.exchange.flat`'s.
"""
import logging
import math

import numpy as np

logger = logging.getLogger(__name__)

#: Bits below the ideal scale a predicted one starts: the growth from one
#: step to the next that needs no second collective (4-fold).
GUARD = 2
#: Bits a scale may lie below the ideal one beyond GUARD (a drop of up to
#: 2**SLACK = 256-fold since the last step) before the bucket is sent
#: again at the ideal one: below it the smallest elements lose bits.
SLACK = 8
#: The largest scale exponent either way: 2**126 and 2**-126 are normal
#: float32 numbers, so every gradient can be multiplied by them.
KMAX = 126
#: float16's smallest normal number: a probe raised to it where its rank's
#: array is not zero, so that the sum of probes is never less than the
#: sum of the maxima and tells zero from small.
TINY = 2.0 ** -14


def spread(ranks):
    """``F``: how much float16's rounding can inflate a sum of ``ranks``
    addends beyond the sum of their magnitudes, and the sum of their
    rounded probes fall below it: ``((1 + u) / (1 - u))**N`` with
    ``u = 2**-11``, bounded exactly in binary (the same on every machine):
    ``1 + N 2**-9`` up to 256 ranks, ``2**ceil(N / 256)`` beyond.

    >>> spread(2), spread(512)
    (1.00390625, 4.0)
    """
    if ranks <= 256:
        return 1.0 + ranks * 2.0 ** -9
    return 2.0 ** -(-ranks // 256)


def probe_exponent(ranks):
    """``PROBE`` for a job of ``ranks``: probes are sent times
    ``2**(k - PROBE)``, so that at a predicted scale each rank's probe is
    about 1/8 to 1/4 (their sum about ``N/4``): normal float16 numbers,
    with room for a ``2**18 / N``-fold jump before the sum overflows.

    >>> probe_exponent(1), probe_exponent(2), probe_exponent(5)
    (15, 14, 12)
    """
    return 15 - (ranks - 1).bit_length()


def floor_log2(value):
    """The largest integer ``e`` with ``2**e <= value`` (positive and
    finite), exactly, from the float's own exponent.

    >>> floor_log2(1.0), floor_log2(0.75), floor_log2(1024.5)
    (0, -1, 10)
    """
    return math.frexp(value)[1] - 1


def clamp(k):
    return max(-KMAX, min(KMAX, int(k)))


def raw_ideal(bound, ranks, wire=np.float16):
    """The largest ``k`` with ``2**k * F * bound <= fmax / 2``, not yet
    clamped to KMAX (how far beyond it matters to the prediction); None
    where ``bound`` is 0 (the sum is 0 at any scale) or not finite (a NaN
    or inf gradient travels as it is, as in float32).

    >>> raw_ideal(1.0, 4), raw_ideal(2.0 ** -140, 2), raw_ideal(0.0, 2)
    (14, 154, None)
    """
    if not (math.isfinite(bound) and bound > 0):
        return None
    return floor_log2(float(np.finfo(wire).max) /
                      (2 * spread(ranks)) / bound)


def ideal(bounds, ranks, wire=np.float16):
    """Each array's exponent for the exact ``bounds`` (the sum over the
    ranks of each array's largest magnitude, from an all-gather):
    :func:`raw_ideal` within KMAX, 0 (a scale of 1) where it has none.

    >>> ideal([1.0, 0.0, float('nan'), 2.0 ** -140], 4)
    [14, 0, 0, 126]
    >>> 4 * 3.0 * 2.0 ** ideal([4 * 3.0], 4)[0] <= 65504
    True
    """
    raw = [raw_ideal(b, ranks, wire) for b in bounds]
    return [0 if r is None else clamp(r) for r in raw]


def judge(probes, used, ranks, wire=np.float16):
    """What the summed ``probes`` of a bucket sent at the exponents
    ``used`` say, on every rank alike.

    Parameters
    ----------
    probes : sequence of float
        ``P`` per array: the probes' sum, as read back after the all-reduce.
    used : list of int
        The exponents the arrays were sent at.
    ranks : int

    Returns
    -------
    (list, list, list)
        ``now``: per array, the exponent to send it at again, or None where
        its sum stands; ``ask``: per array, whether ``P`` cannot tell (the
        exact maxima must be all-gathered first); ``after``: the exponent
        predicted for the next step (None where it must ask). A scale at
        its limit stands where no other could do better: gradients below
        2**-100 or so at 2**KMAX, and at 2**-KMAX (warned) ones beyond
        float16 at any scale.

    Examples
    --------
    Steady, 4-fold growth, 8-fold growth (sent again 1 bit lower), a
    probe past float16 (ask), all zero, too small to tell at the largest
    scale:

    >>> judge([0.25, 1.0, 2.0, float('inf'), 0.0, 1e-6],
    ...       [0, 0, 0, 0, 5, 126], 2)  # doctest: +NORMALIZE_WHITESPACE
    ([None, None, -1, None, None, None],
     [False, False, False, True, False, False], [0, -2, -3, None, 5, 126])
    """
    fmax = float(np.finfo(wire).max)
    top = fmax / (2.0 ** (probe_exponent(ranks) + 1) * spread(ranks))
    now, ask, after = [], [], []
    for p, k in zip(probes, used):
        p = float(p)
        stuck = (math.isinf(p) and k <= -KMAX) or \
            (p < ranks * TINY * 2 and k >= KMAX)
        if p == 0 or math.isnan(p) or stuck:  # zero, NaN, no better scale
            if stuck and math.isinf(p):
                logger.warning('a gradient beyond float16 even at a scale '
                               'of 2**-%d: its sum is inf', KMAX)
            now.append(None), ask.append(False), after.append(k)
            continue
        if math.isinf(p) or p < ranks * TINY * 2:  # P cannot tell
            now.append(None), ask.append(True), after.append(None)
            continue
        raw = k + floor_log2(top / p)
        if raw < -KMAX:
            logger.warning('gradients whose largest magnitudes sum to '
                           '%.3g over the ranks are beyond float16 even '
                           'at a scale of 2**-%d: their sum may be inf',
                           p * 2.0 ** (probe_exponent(ranks) - k), KMAX)
        new = clamp(raw)
        again = new < k or new > k + GUARD + SLACK
        now.append(new if again else None)
        ask.append(False)
        after.append(clamp(raw - GUARD))
    return now, ask, after


def settle_asked(used, bounds, ranks, wire=np.float16):
    """After an all-gather of the exact maxima: per array, the exponent to
    send it at again (None: as it was sent: its sum stands, or nothing
    can help a NaN or inf gradient), and the next step's prediction.

    >>> settle_asked([0, 3], [1.0, float('inf')], 2)
    ([14, None], [12, 3])
    """
    now, after = [], []
    for k, b in zip(used, bounds):
        raw = raw_ideal(b, ranks, wire)
        if raw is None:
            now.append(None), after.append(k)
            continue
        now.append(clamp(raw) if clamp(raw) != k else None)
        after.append(clamp(raw - GUARD))
    return now, after


def first(bounds, ranks, wire=np.float16):
    """A bucket's first step of an epoch: its exponents from the exact
    ``bounds`` (an all-gather before sending) and the next step's
    prediction.

    >>> first([1.0, 0.0, 2.0 ** -140], 2)
    ([14, 0, 126], [12, 0, 126])
    """
    raw = [raw_ideal(b, ranks, wire) for b in bounds]
    return ([0 if r is None else clamp(r) for r in raw],
            [0 if r is None else clamp(r - GUARD) for r in raw])


def bounds_of(maxima):
    """Each array's sum over the ranks of its largest magnitude, given
    every rank's list (an all-gather's answer), added in rank order in
    float64: the same bits on every rank.

    >>> bounds_of([[1.0, 0.5], [2.0, 0.25]])
    [3.0, 0.75]
    """
    return [float(sum(float(m) for m in column)) for column in zip(*maxima)]


def merge(now, ask, after, asked_now, asked_after):
    """:func:`judge`'s answers, with those of the arrays it asked about
    replaced by :func:`settle_asked`'s.

    >>> merge([1, None], [False, True], [0, None], [5, 9], [3, 7])
    ([1, 9], [0, 7])
    """
    return ([an if a else n for n, a, an in zip(now, ask, asked_now)],
            [aa if a else x for x, a, aa in zip(after, ask, asked_after)])


def scales(exponents):
    """The powers of two themselves."""
    return [2.0 ** e for e in exponents]


def _now(work):
    return work()


class WireScales:
    """float16's scales for one :class:`~dasktrain.parallel.exchange.gradients.
    GradientExchange`: each bucket's predicted exponents, by the bucket's
    parameter indices, and the two steps around its all-reduce
    (:meth:`send`, :meth:`settle`), over the exchange's communicator
    ``comm`` (for the all-gathers of exact maxima it asks for) and master
    ``device``. :meth:`forget` (every epoch's end) drops the predictions,
    so that a run resumed from a checkpoint sends what an uninterrupted
    one sends, bit for bit.

    Attributes
    ----------
    resent, asked : int
        Buckets sent a second time, all-gathers of exact maxima after a
        sum, since made (a bucket's first step of an epoch not counted).
    """

    def __init__(self, comm, device, largest):
        self.comm, self.device, self._largest = comm, device, largest
        self._next = {}
        self.resent = self.asked = 0

    def _bounds(self, grads):
        return bounds_of(self.comm.allgather(self._largest(grads,
                                                           self.device)))

    def send(self, flat, k, grads, timed=None):
        """Fill bucket ``k`` of ``flat`` (a FlatBuckets with probes) with
        ``grads`` at the predicted scales, or, the first time, at scales
        from exact maxima all-gathered now (inside ``timed``). Returns the
        buffers to sum and what :meth:`settle` needs of this send."""
        timed = timed or _now
        key = tuple(flat.plan[k])
        used = self._next.get(key)
        judged = used is not None
        if not judged:
            used, after = first(timed(lambda: self._bounds(grads)),
                                self.comm.size)
            self._put(key, after)
        probe = probe_exponent(self.comm.size)
        return flat.fill(k, grads, scales(used),
                         probes=[2.0 ** (u - probe) for u in used]), \
            (used, judged)

    def settle(self, flat, k, grads, sent, resend, timed=None):
        """After the sum of bucket ``k``: the scales its sum stands at,
        once ``resend(buffers)`` (an all-reduce, inside ``timed``) summed
        it again where :func:`judge` says so; the predictions for the
        next step kept."""
        timed = timed or _now
        used, judged = sent
        if not judged:  # sent at exact scales
            return scales(used)
        now, ask, after = judge(flat.read_probes(k), used, self.comm.size)
        if any(ask):
            self.asked += 1
            asked = settle_asked(used, timed(lambda: self._bounds(grads)),
                                 self.comm.size)
            now, after = merge(now, ask, after, *asked)
        self._put(flat.plan[k], after)
        if all(n is None for n in now):
            return scales(used)
        final = [u if n is None else n for n, u in zip(now, used)]
        self.resent += 1
        buffers = flat.fill(k, grads, scales(final))
        timed(lambda: resend(buffers))
        return scales(final)

    def _put(self, key, after):
        key = tuple(key)
        if any(a is None for a in after):
            self._next.pop(key, None)
        else:
            self._next[key] = list(after)

    def forget(self):
        self._next.clear()
