"""One step's forward and backward passes over a model's replicas, in the
seed post's protocol (``with model as m: m(xs, ts)``): each replica on its
part of the batch, each loss weighted by its share, the replicas'
gradients added into the master's.

:class:`Passes` remembers the parts' sizes and the losses of the step in
progress, which the update and the metrics read. It owns the passes and
the merge inside this process, and when Chainer's type checks run: a
step whose input signature (each replica's shapes and dtypes,
:func:`signature`) passed them before runs without them, forward and
backward (Chainer checks every function's input types on every call:
169 checks of a ResNet-20 step, 0.75 ms of host time on a CPU); a new
signature is checked. What
crosses processes is
:mod:`~dasktrain.parallel.exchange.gradients`'s (which the master's backward
pass may feed bucket by bucket), the update
:mod:`~dasktrain.parallel.gradient`'s.
"""
import contextlib

import chainer

from dasktrain.parallel import precision
from dasktrain.parallel.devices import transfer
from dasktrain.parallel.exchange.buckets import gradients

TYPE_CHECKS = ('once', 'always')
# Input signatures remembered as checked: a run has a handful (its batch,
# the last one of an epoch); past this many, a new one is checked on
# every step it comes back, as Chainer checks by default.
MAX_SIGNATURES = 1024


def check_type_check(type_check):
    """Validate GPUDistributedGradient's ``type_check``."""
    if type_check not in TYPE_CHECKS:
        raise ValueError(f"type_check must be 'once' or 'always', got "
                         f'{type_check!r}')
    return type_check


def signature(parts):
    """A step's input signature: each replica's part as the shape and
    dtype of each argument (a hashable value passed as itself), and
    whether Chainer trains; None where an argument has neither (the step
    is then always checked).

    >>> import numpy as np
    >>> signature([(np.zeros((2, 3), np.float32), np.zeros(2, np.int32))])
    ((((2, 3), '<f4'), ((2,), '<i4')), True)
    >>> signature([(np.zeros(2), [1, 2])]) is None
    True
    """
    described = []
    for part in parts:
        args = []
        for arg in part:
            if hasattr(arg, 'shape') and hasattr(arg, 'dtype'):
                args.append((tuple(arg.shape), arg.dtype.str))
            elif arg is None or isinstance(arg, (bool, int, float, str)):
                args.append((type(arg).__name__, arg))
            else:
                return None
        described.append(tuple(args))
    return (*described, bool(chainer.config.train))


class Passes:
    """The passes of the replicas ``group`` (a
    :class:`~dasktrain.parallel.replicas.Replicas`) in ``mode`` ('dg' or
    'ipm'); ``exchange`` takes the master's backward pass when it overlaps,
    ``clock`` times the merge.

    Attributes
    ----------
    sizes : list of int
        Each replica's images in this step.
    total : int
        The whole job's images in this step.
    """

    def __init__(self, group, mode, exchange, clock, type_check='once'):
        self.group, self.mode = group, mode
        self.exchange, self.clock = exchange, clock
        self.sizes, self.total, self.losses = [], 0, []
        self.type_check = check_type_check(type_check)
        self.checked = set()   # input signatures whose passes passed
        self.key = None         # this step's signature
        self.unchecked = False  # this step runs without type checks

    def _checks(self):
        """Within: Chainer's type checks as this step's signature asks
        (off for one already checked, else as Chainer's configuration
        says: on, unless ``CHAINER_TYPE_CHECK=0``)."""
        if self.unchecked:
            return chainer.using_config('type_check', False)
        return contextlib.nullcontext()

    def forward(self, args, total=None):
        """Every replica on its part (``args``: one array per replica in
        each argument); ``total``: the job's images in this step (default:
        these parts'). Returns the master's loss."""
        parts = list(zip(*args))
        if len(parts) != len(self.group):
            raise ValueError(f'expected one part per replica '
                             f'({len(self.group)}), got {len(parts)}')
        self.sizes = [len(part[0]) for part in parts]
        self.total = sum(self.sizes) if total is None else total
        self.group.initialize(parts)  # lazily initialised links, once
        self.losses = None  # the last step's graphs, let go first
        self.key = signature(parts) if self.type_check == 'once' else None
        self.unchecked = self.key is not None and self.key in self.checked
        with self._checks():
            self.losses = self.group.forward(parts)
        return self.losses[0]

    def backward(self, overlap=False, scales=None):
        """Back-propagate every replica's loss; in dg weighted by its share
        of the job's batch (the merged gradient is then that of the mean
        loss). With ``overlap`` the master's buckets leave as they are
        ready (:meth:`~dasktrain.parallel.exchange.gradients.GradientExchange.
        backward`, which also takes part without a loss). ``scales``: each
        replica's loss scale (:mod:`~dasktrain.parallel.precision`; None:
        none), its parameters marked with it, reached or not."""
        scales = scales or [None] * len(self.group)
        with self._checks():
            for i, (link, device, loss, size, scale) in enumerate(zip(
                    self.group.links, self.group.devices, self.losses,
                    self.sizes, scales)):
                with chainer.using_device(device):
                    if loss is not None and self.mode == 'dg' and \
                            size != self.total:
                        loss = loss * (size / self.total)
                    if i == 0 and overlap and self.mode == 'dg':
                        self.exchange.backward(loss, scale)
                    elif loss is not None:
                        loss.backward(loss_scale=scale)
                if scale is not None:
                    precision.stamp(link, scale)
        if self.key is not None and not self.unchecked and \
                len(self.checked) < MAX_SIGNATURES:
            self.checked.add(self.key)  # both passes' types passed

    def merge(self):
        """Add every other replica's gradients into the master's (timed)."""
        links, devices = self.group.links, self.group.devices

        def merge():
            targets = gradients(links[0], devices[0])
            for link, device, size in zip(links[1:], devices[1:],
                                          self.sizes[1:]):
                if size:
                    moved = transfer(gradients(link, device), device,
                                     devices[0])
                    with chainer.using_device(devices[0]):
                        for target, g in zip(targets, moved):
                            target += g
        if len(links) > 1:
            self.clock.timed(merge)
