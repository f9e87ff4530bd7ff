"""One step's forward and backward passes over a model's replicas, in the
seed post's protocol (``with model as m: m(xs, ts)``): each replica on its
part of the batch, each loss weighted by its share, the replicas'
gradients added into the master's.

:class:`Passes` remembers the parts' sizes and the losses of the step in
progress, which the update and the metrics read. It owns the passes and
the merge inside this process; what crosses processes is
:mod:`~dasktrain.parallel.exchange.gradients`'s (which the master's backward
pass may feed bucket by bucket), the update
:mod:`~dasktrain.parallel.gradient`'s.
"""
import chainer

from dasktrain.parallel.devices import transfer
from dasktrain.parallel.exchange.buckets import gradients


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

    def __init__(self, group, mode, exchange, clock):
        self.group, self.mode = group, mode
        self.exchange, self.clock = exchange, clock
        self.sizes, self.total, self.losses = [], 0, []

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
        self.losses = self.group.forward(parts)
        return self.losses[0]

    def backward(self, overlap=False):
        """Back-propagate every replica's loss; in dg weighted by its share
        of the job's batch (the merged gradient is then that of the mean
        loss). With ``overlap`` the master's buckets leave as they are
        ready (:meth:`~dasktrain.parallel.exchange.gradients.GradientExchange.
        backward`, which also takes part without a loss)."""
        for i, (device, loss, size) in enumerate(zip(
                self.group.devices, self.losses, self.sizes)):
            with chainer.using_device(device):
                if loss is not None and self.mode == 'dg' and \
                        size != self.total:
                    loss = loss * (size / self.total)
                if i == 0 and overlap and self.mode == 'dg':
                    self.exchange.backward(loss)
                elif loss is not None:
                    loss.backward()

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
