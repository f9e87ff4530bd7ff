"""Weight prediction for double buffering: each stale step's gradient is
computed at the weights it will be applied to.

Double buffering applies at step t+1 the gradient computed at step t, to
weights that have moved by one update since. Heavy-ball momentum (and
Adam's first moment, the same recurrence) turns that delay into
instability: on a quadratic of curvature ``h`` the stale recurrence stays
stable only while ``lr h < 0.1`` at momentum 0.9, against ``3.8`` exact.
The cure used for pipelined training (PipeMare, SpecTrain) is to
extrapolate: a step whose gradient will be applied one update late runs
its forward and backward passes at ``w + (w - w_before_last_update)``,
the weights one update ahead (consecutive updates of a momentum method are
close), and the master goes back to ``w`` exactly (a saved copy, not a
subtraction) before its update. Measured in ``docs/scale-out.md``.

Only a step that applies an update while its own gradient travels is
shifted: the first step of an epoch applies none (the epoch's end applied
what was in flight), so its gradient lands on the weights it sees. The last
update is forgotten at every epoch's end, so the first shifted step of an
epoch depends on nothing from before it: a resumed run shifts exactly as
an uninterrupted one, with nothing more in its checkpoint.

Owns the saved weights and the shift; when to shift is
:class:`~dasktrain.parallel.gradient.GPUDistributedGradient`'s, copying the
master into the other replicas :mod:`~dasktrain.parallel.replicas`'.
"""
import contextlib

import chainer


class WeightPrediction:
    """Shift the master of ``replicas`` (a
    :class:`~dasktrain.parallel.replicas.Replicas`) one update ahead, and
    back; every method does nothing unless ``enabled``.

    Examples
    --------
    >>> import chainer.links as L
    >>> from dasktrain.parallel.comm.base import Solo
    >>> from dasktrain.parallel.devices import resolve_devices
    >>> from dasktrain.parallel.replicas import Replicas
    >>> group = Replicas(L.Linear(2, 1), resolve_devices(['@numpy']), Solo())
    >>> group.master.W.array[...] = 1.0
    >>> ahead = WeightPrediction(group)
    >>> ahead.before_update()              # then an update moves W by -0.5
    >>> group.master.W.array -= 0.5
    >>> with ahead.shifted():
    ...     print(group.master.W.array)    # one more such update ahead
    [[0. 0.]]
    >>> group.master.W.array
    array([[0.5, 0.5]], dtype=float32)
    """

    def __init__(self, replicas, enabled=True):
        self.replicas, self.enabled = replicas, bool(enabled)
        self._before = None   # the master's weights before the last update
        self._now = None      # the weights a shift left, to restore
        self._list = None     # the master's parameters, found once

    def _params(self):
        # Found at the first update (lazily initialised links are sized by
        # then) and kept: sorting namedparams() every step costs per step.
        if self._list is None:
            self._list = [p for _, p in sorted(
                self.replicas.master.namedparams()) if p.array is not None]
        return self._list

    @staticmethod
    def _save(params, into):
        """Copies of ``params``' arrays, in the buffers ``into`` when they
        fit (allocated once, not every step), each made with its array's
        device current: CuPy's ``ndarray.copy`` copies to the current
        device (``_core/core.pyx``), and a kernel reading another GPU's
        array needs peer access."""
        fresh = into is None or len(into) != len(params)
        saved = []
        for i, p in enumerate(params):
            with chainer.using_device(
                    chainer.backend.get_device_from_array(p.array)):
                if fresh:
                    saved.append(p.array.copy())
                else:
                    into[i][...] = p.array
        return saved if fresh else into

    def before_update(self):
        """Save the master's weights an update is about to change."""
        if self.enabled:
            self._before = self._save(self._params(), self._before)

    def forget(self):
        """No last update to extrapolate from (an epoch's end)."""
        self._before = None

    @contextlib.contextmanager
    def shifted(self, when=True):
        """Inside, every replica holds ``w + (w - w_before_last_update)``
        of the master (``when`` and an update saved since :meth:`forget`;
        else nothing changes); on leaving, the master holds ``w`` again, bit
        for bit. The other replicas keep the shifted weights: the update
        that follows copies the master into them."""
        if not (self.enabled and when and self._before is not None):
            yield False
            return
        params = self._params()
        self._now = self._save(params, self._now)
        for p, before, now in zip(params, self._before, self._now):
            with chainer.using_device(
                    chainer.backend.get_device_from_array(p.array)):
                p.array += now - before
        if len(self.replicas.links) > 1:
            self.replicas.copy_master(persistents=False)
        try:
            yield True
        finally:
            for p, now in zip(params, self._now):
                with chainer.using_device(
                        chainer.backend.get_device_from_array(p.array)):
                    p.array[...] = now
