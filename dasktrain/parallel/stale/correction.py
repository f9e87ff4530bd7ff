"""Corrected stale steps, double buffering's default: each replica applies
its own gradient at once and the job's mean one step late, in place of its
own.

Double buffering hides a step's all-reduce behind the next step's compute,
so the job's mean gradient of step t is known only at step t+1. Applying it
then (ChainerMN's way) makes every update one step stale, and heavy-ball
momentum, or Adam's first moment, turns a stale gradient into divergence
(``docs/scale-out.md``). Delayed gradient averaging (Zhu et al., NeurIPS
2021) keeps the fresh part fresh: every replica ``r`` updates its own
weights with

    g_hat_r(t) = l_r(t) + (G(t-1) - l_r(t-1))

where ``l_r(t)`` is its own mean gradient of step t (of its images) and
``G(t-1)`` the job's mean gradient of step t-1, just arrived. Summed over
steps the local terms cancel: after T steps a replica has applied
``G(0) + ... + G(T-2) + l_r(T-1)``, and with equal shares the replicas'
mean applies exactly ``G(t)`` at every step t: exact dg's recurrence. Each
replica carries its own weights and optimizer state between epoch ends
(like ipm), and at every epoch's end the wrapper averages weights,
BatchNorm statistics and optimizer state over the job's replicas, so
evaluation, checkpoints and the next epoch start from one model; for SGD
and momentum SGD, linear in the gradients, that mean is exactly exact dg's
recurrence driven by the same ``G``.

What is late is only each replica's distance from the mean, and that has
a smaller stable range: on a quadratic of curvature ``h`` under heavy-ball
momentum ``m`` the distance obeys ``e(t+1) = (m - lr h) e(t)`` (its steps'
differences), stable while ``lr h < 1 + m``, half of exact dg's
``2 (1 + m)``. A run that starts corrected from its first step settles
where that holds. A run trained exactly first sits at exact dg's edge of
stability (the sharpness rises until ``lr h`` nears ``2 (1 + m)``, Cohen et
al., ICLR 2021), and switching straight to corrected steps there throws
it off (measured: momentum SGD fell to chance for an epoch). So after an
exact warm-up the correction fades in: ``l_r(t) + w (G(t-1) - l_r(t-1))``
with ``w`` growing from 0 to 1 over as many steps as the warm-up took
(:func:`fade_in`). Every ``w`` keeps the replicas' mean exact; at ``w = 0``
each replica takes its own steps (stable as exact dg, drifting apart by
its own noise until the epoch's end), and the stable range narrows to
``2 (1 + m) / (1 + w)`` gradually enough for the training to follow.

Owns each replica's kept local gradient, the corrected gradient it writes
into the replica's parameters and the replicas' own updates (their
optimizers take the master's state after exact steps and follow its
hyperparameters); the all-reduce is
:mod:`~dasktrain.parallel.exchange.gradients`'s, when a step is stale and the
epoch's mix :mod:`~dasktrain.parallel.gradient`'s.
"""
import chainer
import numpy as np
from chainer.serializers import DictionarySerializer, NpzDeserializer

from dasktrain.parallel.devices import transfer
from dasktrain.parallel.exchange.buckets import gradients, parameters


def fade_in(iteration, stale_from):
    """The correction's weight at step ``iteration`` of a run whose
    corrected steps began at ``stale_from`` after as many exact ones: it
    grows from 0 to 1 over as many steps as the exact warm-up took, and is
    1 at once without a warm-up.

    >>> [fade_in(i, 4) for i in range(4, 10)]
    [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    >>> fade_in(3, 0)
    1.0
    """
    if stale_from <= 0:
        return 1.0
    return min(1.0, max(0.0, (iteration - stale_from) / stale_from))


class LocalCorrection:
    """The corrected stale steps of the replicas of ``replicas`` (a
    :class:`~dasktrain.parallel.replicas.Replicas`).

    Each step, :meth:`keep` takes every replica's own mean gradient (before
    the replicas' gradients are merged into the master's), and after the
    exchange :meth:`correct` writes each replica's corrected gradient into
    its parameters. Two persistent buffers per replica and parameter hold
    the kept gradients of this step and of the last one; :meth:`forget`
    (an epoch's end) drops the last.

    Examples
    --------
    >>> import numpy as np, chainer.links as L
    >>> from dasktrain.parallel.comm.base import Solo
    >>> from dasktrain.parallel.devices import resolve_devices
    >>> from dasktrain.parallel.replicas import Replicas
    >>> group = Replicas(L.Linear(1, 1, nobias=True),
    ...                  resolve_devices(['@numpy']), Solo())
    >>> local = LocalCorrection(group)
    >>> group.master.W.grad = np.array([[2.0]], np.float32)
    >>> local.keep([5], 10)   # 5 images of 10: weighted 1/2, so l = 4
    >>> local.correct(None)   # nothing arrived yet: l(0)
    >>> group.master.W.grad
    array([[4.]], dtype=float32)
    >>> group.master.W.grad = np.array([[1.0]], np.float32)
    >>> local.keep([5], 10)   # l(1) = 2
    >>> local.correct([np.array([[3.0]], np.float32)])  # G(0) = 3
    >>> group.master.W.grad   # l(1) + G(0) - l(0)
    array([[1.]], dtype=float32)
    """

    def __init__(self, replicas):
        self.replicas = replicas
        self._params = None   # each replica's parameters, found once
        self._buffers = None  # [replica][which][parameter]
        self._now = 0         # which buffer holds this step's
        self._last = False    # whether the other one holds the last step's
        self._behind = False  # the master's optimizer updated alone since

    def _lists(self):
        if self._params is None:
            self._params = [parameters(link) for link in self.replicas.links]
        return self._params

    def keep(self, sizes, total):
        """Keep each replica's mean gradient of this step: its gradient
        (weighted by its ``sizes[r]`` images of the job's ``total``) times
        ``total / sizes[r]``; zeros for a replica without images."""
        lists, devices = self._lists(), self.replicas.devices
        if self._buffers is None:
            self._buffers = []
            for params, device in zip(lists, devices):
                with chainer.using_device(device):
                    self._buffers.append([[device.xp.zeros_like(p.array)
                                           for p in params]
                                          for _ in range(2)])
        self._now = 1 - self._now if self._last else self._now
        for r, (link, device) in enumerate(zip(self.replicas.links,
                                               devices)):
            kept = self._buffers[r][self._now]
            scale = total / sizes[r] if sizes[r] else 0.0
            with chainer.using_device(device):
                for k, g in zip(kept, gradients(link, device,
                                                params=lists[r])):
                    device.xp.multiply(g, scale, out=k, casting='unsafe')

    def correct(self, summed, weight=1.0):
        """Write into every replica's gradients its kept gradient of this
        step, plus ``weight`` times ``summed`` (the job's mean gradients of
        the last step, in
        :func:`~dasktrain.parallel.exchange.buckets.parameters`' order on the
        master's device; None when none arrived) minus its
        kept gradient of the last step: l(t) + w (G(t-1) - l(t-1))."""
        lists, devices = self._lists(), self.replicas.devices
        master, moved = devices[0], {}
        for r, (params, device) in enumerate(zip(lists, devices)):
            now = self._buffers[r][self._now]
            if summed is None or not self._last:  # l(t): a fresh copy,
                with chainer.using_device(device):  # which hooks may scale
                    for p, k in zip(params, now):
                        p.grad = k.copy()
                continue
            if str(device) not in moved:  # once per device, not replica
                moved[str(device)] = transfer(summed, master, device)
            arrived = moved[str(device)]
            late = self._buffers[r][1 - self._now]
            with chainer.using_device(device):
                for p, k, g, old in zip(params, now, arrived, late):
                    # into the last step's buffer, free once read: l(t) +
                    # w (G(t-1) - l(t-1)), a new gradient, no allocation
                    device.xp.subtract(g, old, out=old, casting='unsafe')
                    if weight != 1.0:
                        old *= weight
                    old += k
                    p.grad = old
        self._last = True

    def master_moved(self):
        """The master's optimizer updated alone (an exact step): the other
        replicas' optimizers take its state before the next corrected
        step."""
        self._behind = True

    def update(self, optimizers, summed, weight=1.0):
        """One corrected step: :meth:`correct` (``summed``, ``weight``),
        then every replica's optimizer (``optimizers``, the master's first)
        updates it on its device. After exact steps the others first take
        the master's optimizer state, each its own copy; every step they
        take its hyperparameters (a schedule's learning rate too)."""
        master = optimizers[0]
        if self._behind:
            self._behind = False
            state = DictionarySerializer()  # host arrays, not copied
            master.serialize(state)
            for optimizer, device in zip(optimizers[1:],
                                         self.replicas.devices[1:]):
                with chainer.using_device(device):  # ndarray.set's stream
                    optimizer.serialize(NpzDeserializer(
                        {k: np.array(v) for k, v in state.target.items()}))
        self.correct(summed, weight)
        settings = master.hyperparam.get_dict()
        for optimizer, device in zip(optimizers, self.replicas.devices):
            for name, value in settings.items():
                setattr(optimizer.hyperparam, name, value)
            with chainer.using_device(device):
                optimizer.update()

    @property
    def active(self):
        """Whether a corrected step ran since the last :meth:`forget`: the
        replicas may differ."""
        return self._last

    def forget(self):
        """No last step's gradient to correct (an epoch's end: the wrapper
        averages the replicas)."""
        self._last = False
