"""Data-parallel training of one Chainer model on several devices.

After the seed post's ``GPUDistributedGradient`` (Chainer 1.5), grown to
Chainer 7: the same ``with model as m: m(xs, ts)`` protocol, plus a
one-call :meth:`GPUDistributedGradient.step`, a mean (not summed) merged
gradient, and an iterative-parameter-mixture mode.

It owns the update, dg and ipm, and mixing; the replicas on their devices
are :mod:`~dasktrain.parallel.replicas`', the sums between processes
:mod:`~dasktrain.parallel.exchange.gradients`'s, double buffering's late steps
:mod:`~dasktrain.parallel.stale.recipes`'s. It starts no process and writes no
file (checkpoints go through ``serialize`` and ``restore``).
"""
import copy

import chainer
import numpy as np
from chainer.serializers import NpzDeserializer

from dasktrain.parallel import precision
from dasktrain.parallel.comm.base import Solo
from dasktrain.parallel.devices import Clock, resolve_devices
from dasktrain.parallel.exchange.gradients import (
    GradientExchange,
    check_exchange,
)
from dasktrain.parallel.passes import Passes, check_type_check
from dasktrain.parallel.replicas import Replicas, load, saved_replicas
from dasktrain.parallel.stale.recipes import StaleSteps, check_recipe

MODES = ('dg', 'ipm')


def check_mode(mode, mix_every):
    """Validate GPUDistributedGradient's ``mode`` and ``mix_every``."""
    if mode not in MODES:
        raise ValueError(f"mode must be 'dg' or 'ipm', got {mode!r}")
    if mix_every is not None and mode != 'ipm':
        raise ValueError(f"mix_every applies to mode='ipm' only, got "
                         f'mix_every={mix_every!r} with mode={mode!r}')
    if not (mix_every is None or mix_every == 'epoch' or
            (isinstance(mix_every, (int, np.integer)) and
             not isinstance(mix_every, bool) and mix_every >= 1)):
        raise ValueError(f"mix_every must be an int >= 1, 'epoch' or "
                         f'None, got {mix_every!r}')


class GPUDistributedGradient:
    """Train one model as replicas on several devices, on shares of a batch.

    In 'dg' (distributed gradient) mode every replica back-propagates its
    share of the minibatch, the master applies the mean gradient and the
    others copy its parameters; in 'ipm' (iterative parameter mixture) mode
    every replica updates itself on its share and the replicas' parameters
    are averaged every ``mix_every`` iterations.

    Parameters
    ----------
    chain : chainer.Link
        The model, e.g. ``L.Classifier(net)``; it becomes the master (the
        first replica) and is moved to the first device.
    devices : sequence of int or str, or int
        GPU ids or Chainer device specifiers (``0``, ``'@cupy:1'``,
        ``'@numpy'``); a device may repeat. An int ``n`` alone means GPUs
        0..n-1, as in the seed post.
    mode : {'dg', 'ipm'}, default 'dg'
    mix_every : int, 'epoch' or None, default None
        ipm only: iterations between mixes, at each :meth:`end_epoch`, or
        None for one-shot mixing (only :meth:`finalize` mixes).
    mix_optimizer_state : bool, default False
        ipm only: average optimizer state (e.g. Adam's moments) too.
    comm_dtype : {None, 'float16'}, default None
        dg across processes: the gradients travel and are summed in this
        dtype (half the bytes; ChainerMN's ``allreduce_grad_dtype``), then
        cast back. None: as they are (float32).
    double_buffering : bool, default False
        dg: each step's all-reduce travels while the next step computes
        (:mod:`~dasktrain.parallel.exchange.gradients`): the job's summed
        gradient of a step arrives one step late.
    warmup : int or 'epoch', default 'epoch'
        double buffering: exact steps first ('epoch': until the first
        :meth:`end_epoch`).
    stale : {'corrected', 'predicted', 'plain'}, default 'corrected'
        double buffering: what a step does with the late sum
        (:mod:`~dasktrain.parallel.stale.recipes`): each replica its own
        gradient now and the late mean in its place, replicas averaged at every
        :meth:`end_epoch`; the late mean computed one update ahead; or
        the late mean as it is (ChainerMN's).
    bucket_mb : float, default 0
        dg across processes with one replica here: all-reduce buckets of
        about this many MiB of gradients while back-propagation goes on
        (:mod:`~dasktrain.parallel.exchange.gradients`). 0: after the backward
        pass.
    comm : dasktrain.parallel.comm.base.Communicator, optional
        Make this one replica group of a job across processes: every group
        starts from rank 0's weights, dg sums the masters' gradients over
        ``comm`` every step, ipm averages over all groups' replicas; the
        results are those of one process holding all the replicas.
        Default: this process is the whole job.
    type_check : {'once', 'always'}, default 'once'
        Chainer's type checks (``chainer.config.type_check``): on for a
        step whose input signature (each replica's shapes and dtypes) is
        new, off for one already checked (:mod:`~dasktrain.parallel.
        passes`); 'always' leaves them as Chainer's configuration says.

    Notes
    -----
    Mixed precision is the optimizer's, as in Chainer: under
    ``chainer.config.dtype = chainer.mixed16`` set up an optimizer with
    ``loss_scaling()`` (and ``use_fp32_update()``), and every replica's
    backward pass scales its loss by the optimizer's current scale, each
    update divides it back (dg: the summed gradient, at the master's
    scale, the same on every rank), and checkpoints keep the scale and
    the float32 master weights (:mod:`~dasktrain.parallel.precision`).

    Examples
    --------
    >>> model = GPUDistributedGradient(L.Classifier(net), [0, 1, 2, 3])
    ... # doctest: +SKIP
    >>> model.setup(chainer.optimizers.Adam())  # doctest: +SKIP
    >>> loss, accuracy = model.step(x, t)  # doctest: +SKIP

    The seed's protocol works too, in dg mode::

        with model as m:
            m(xs, ts)          # one array per replica, already on its device
        optimizer.update()
        model.syncparams()
    """

    def __init__(self, chain, devices, mode='dg', mix_every=None,
                 mix_optimizer_state=False, comm=None, comm_dtype=None,
                 double_buffering=False, bucket_mb=0.0, warmup='epoch',
                 stale='corrected', type_check='once'):
        check_mode(mode, mix_every)
        check_type_check(type_check)
        comm_dtype, bucket_mb = check_exchange(comm_dtype, bucket_mb,
                                               warmup)
        stale = check_recipe(stale)
        devices = resolve_devices(devices)
        self.mode = mode
        self.mix_every = mix_every
        self.mix_optimizer_state = mix_optimizer_state
        self.comm = comm or Solo()
        self.group = Replicas(chain, devices, self.comm)  # rank 0's weights
        self.devices = self.group.devices
        self.replicas = self.group.links
        self.offset = self.group.offset  # global replica index
        self.total_replicas = self.group.total
        self.clock = Clock(self.devices)  # merging, syncing and mixing
        self.exchange = GradientExchange(self.group, self.clock, comm_dtype,
                                         bool(double_buffering), bucket_mb,
                                         warmup)
        self.stale = StaleSteps(self.group, self.exchange, stale if
                                double_buffering and mode == 'dg' else None)
        self.optimizers = []
        self.iteration = 0
        self.drift = None      # RMS distance of replicas from their mean
        self.drifts = []       # ... before each mix so far
        self.passes = Passes(self.group, mode, self.exchange, self.clock,
                             type_check)

    def __len__(self):
        return len(self.replicas)

    @property
    def master(self):
        """The first replica: the one the dg optimizer updates."""
        return self.replicas[0]

    @property
    def optimizer(self):
        return self.optimizers[0] if self.optimizers else None

    @property
    def comm_time(self):
        """Seconds spent merging gradients, syncing and mixing so far."""
        return self.clock.total

    @comm_time.setter
    def comm_time(self, seconds):
        self.clock.total = seconds

    def setup(self, optimizer):
        """Attach ``optimizer`` (fresh, or set up on the model this wraps,
        hooks and all): dg to the master, ipm to every replica (copies
        with the same hyperparameters and hooks)."""
        target = getattr(optimizer, 'target', None)
        if target is not None and target is not self.master:
            raise ValueError('optimizer is already set up on another link; '
                             'pass a fresh one to GPUDistributedGradient.'
                             'setup')
        optimizer.target = None  # the template: no model in the copy
        try:
            template = copy.deepcopy(optimizer)
        finally:
            optimizer.target = target
        if precision.loss_scale(optimizer) is not None and \
                self.exchange.double_buffering:
            raise ValueError('an optimizer with loss scaling scales each '
                             "step's gradient by that step's factor, and "
                             'double_buffering applies it a step late; '
                             'leave one of them out')
        if target is None:
            optimizer.setup(self.master)
        self.optimizers = [optimizer]
        if self.mode == 'ipm' or self.stale.own_optimizers:
            for replica in self.replicas[1:]:
                other = copy.deepcopy(template)
                other.setup(replica)
                self.optimizers.append(other)
        return self

    def add_hook(self, hook, name=None):
        """Add an optimizer hook (e.g. WeightDecay) to every optimizer."""
        for i, optimizer in enumerate(self.optimizers):
            optimizer.add_hook(hook if i == 0 else copy.deepcopy(hook), name)

    def seed(self, seed, epoch):
        """Seed each replica's own random numbers (dropout) from (``seed``,
        ``epoch``, its global index): the same draws wherever it runs, even
        two replicas on one GPU (CuPy has one generator per device)."""
        self.group.random.seed(seed, epoch, self.offset)

    # ------------------------------------------------- the seed's protocol

    def cleargrads(self):
        for replica in self.replicas:
            replica.cleargrads()

    zerograds = cleargrads  # the seed's name

    def __call__(self, *args, total=None):
        """Forward every replica on its part: ``m(xs, ts)`` with one array
        per replica in each argument. Returns the master's loss. ``total``:
        images in the whole job's step (default: these parts')."""
        return self.passes.forward(args, total)

    def backward(self, overlap=False):
        """Back-propagate every replica's loss (in dg weighted by its share
        of the batch); with ``overlap`` the master's buckets start their
        all-reduce during its backward pass (:mod:`~dasktrain.parallel.
        passes`). Each loss is scaled by its optimizer's loss scale, if
        any (dg: the master's, for every replica)."""
        self.passes.backward(overlap, self.loss_scales())

    def loss_scales(self):
        """Each replica's loss scale this step (None: none): in dg the
        master optimizer's for all (their gradients are summed into the
        master's, which it divides), in ipm each replica's own."""
        if self.mode == 'dg' or len(self.optimizers) < len(self.replicas):
            return [precision.loss_scale(self.optimizer)] * len(self)
        return [precision.loss_scale(o) for o in self.optimizers]

    def syncgrads(self):
        """Add every other replica's gradients into the master's."""
        self.passes.merge()

    def __enter__(self):
        self.cleargrads()
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is None:
            self.backward()
            if self.mode == 'dg':
                self.syncgrads()
        return False  # exceptions propagate

    def flush(self):
        """Double buffering, at an epoch's end: apply the gradient in
        flight, or after corrected steps average the replicas (weights,
        statistics, optimizer state) over the job instead: their mean has
        taken it already."""
        summed = self.exchange.flush(self.iteration)

        def average():
            squared = self.clock.timed(lambda: self.group.mix(states=True))
            self.drift = (squared / self.total_replicas) ** 0.5
        self.stale.end_epoch(lambda: self._apply(summed), average)

    def _apply(self, summed):
        """dg's update after an exchange (``summed``: None, none yet)."""
        if summed is not None:
            self.stale.before_master_update()
            with chainer.using_device(self.devices[0]):
                self.optimizer.update()
            self.sync_replicas(summed.groups, summed.means)

    def sync_replicas(self, groups, means):
        """Write averaged statistics and copy the master's parameters."""
        def sync():
            self.group.write(groups, means)
            self.group.copy_master(persistents=False)
        if len(self.replicas) == 1:  # nothing to copy: no device-wide
            return sync()            # waits for a timer's sake
        self.clock.timed(sync)

    def syncparams(self):
        """Copy the master's parameters to every replica; persistent values
        (BatchNorm statistics) are averaged over replicas first."""
        if self.total_replicas == 1:
            return
        groups = self.group.groups(self.replicas, params=False)
        self.sync_replicas(groups, self.clock.timed(
            lambda: self.group.means(groups)))

    # -------------------------------------------------------- one call

    def split(self, x, t):
        """Split a batch into near-equal parts, each sent to its device
        (the larger first, as the sharded loader hands them out)."""
        return self.group.split(x), self.group.split(t)

    def update(self):
        """Apply one iteration's gradients: dg updates the master and syncs
        the replicas; ipm updates each replica and mixes when due."""
        if not self.optimizers:
            raise RuntimeError('call setup(optimizer) before update()')
        if self.mode == 'dg':
            if self.stale.corrected(self.iteration):
                self.stale.update(self.iteration, self.optimizers,
                                  self.exchange.step(self.iteration))
            elif self.comm.size > 1 or self.exchange.double_buffering:
                self._apply(self.exchange.step(self.iteration))
            else:
                with chainer.using_device(self.devices[0]):
                    self.optimizer.update()
                self.syncparams()
        else:
            for optimizer, device, size in zip(self.optimizers, self.devices,
                                               self.passes.sizes):
                if size:
                    with chainer.using_device(device):
                        optimizer.update()
        self.iteration += 1
        if self.mode == 'ipm' and isinstance(self.mix_every, (int,
                                                              np.integer)) \
                and self.iteration % self.mix_every == 0:
            self.mix()

    def step(self, x, t, total=None, observe=True):
        """One training iteration on the batch ``(x, t)``; ``total`` is the
        whole job's batch when this is one group of several (default:
        ``len(x)``).

        Returns
        -------
        (float, float) or None
            Loss and accuracy, averaged over this group's part of the batch;
            None with ``observe=False``, which spares the wait for the GPUs
            (read the sums with :meth:`take_metrics` now and then).
        """
        if len(x) != len(t):
            raise ValueError(f'x and t must have the same length, got '
                             f'{len(x)} and {len(t)}')
        xs, ts = self.split(x, t)
        self.cleargrads()  # the seed's protocol, unrolled
        with self.stale.shifted(self.iteration):
            self(xs, ts, total=total)
            self.backward(overlap=True)
        if self.mode == 'dg':
            self.stale.keep(self.iteration, self.passes.sizes,
                            self.passes.total)
            self.syncgrads()
        self.update()
        self.group.accumulate(self.passes.sizes)
        return self.observed() if observe else None

    def take_metrics(self):
        """(loss sum, accuracy sum, images) over the steps since the last
        call, each loss and accuracy weighted by its images: one read per
        replica, whatever the number of steps."""
        return self.group.take_metrics()

    def observed(self):
        """Batch-weighted mean of the replicas' last loss and accuracy."""
        return self.group.observed(self.passes.sizes)

    # -------------------------------------------------------- mixing

    def mix(self):
        """Every replica := the replicas' mean (with optimizer state if
        ``mix_optimizer_state``); :attr:`drift`: their RMS distance before."""
        squared = self.clock.timed(
            lambda: self.group.mix(self.mix_optimizer_state))
        self.drift = (squared / self.total_replicas) ** 0.5
        self.drifts.append(self.drift)

    def spread(self):
        """The replicas' RMS distance from their mean now (no mixing)."""
        return (self.group.spread() / self.total_replicas) ** 0.5

    def end_epoch(self):
        """Call at each epoch's end: apply a gradient in flight; mix."""
        self.flush()
        if self.mode == 'ipm' and self.mix_every == 'epoch':
            self.mix()

    def finalize(self):
        """The final mix of ipm (a no-op in dg, where replicas agree)."""
        if self.mode == 'ipm' and self.total_replicas > 1:
            self.mix()

    def averaged(self):
        """ipm: a copy of the master holding the replicas' mean (what
        evaluation uses mid-training); dg: the master itself."""
        if self.mode == 'dg' or self.total_replicas == 1:
            return self.master
        return self.group.mean_copy()

    def evaluators(self):
        """(link, device) to evaluate with, one per distinct device: the
        replicas themselves in dg (equal after every sync), copies of
        :meth:`averaged` in ipm."""
        evaluated = self.averaged()
        return self.group.per_device(
            None if evaluated is self.master else evaluated)

    def serialize(self, serializer):
        """Replicas and optimizers (by their index in the job), iteration."""
        for i, replica in enumerate(self.replicas):
            replica.serialize(serializer[f'replica{self.offset + i}'])
        for i, optimizer in enumerate(self.optimizers):
            optimizer.serialize(serializer[f'optimizer{self.offset + i}'])
            if precision.scaled(optimizer):
                precision.serialize(
                    optimizer, serializer[f'precision{self.offset + i}'])
        self.iteration = int(serializer('iteration', self.iteration))
        self.exchange.stale_from = int(serializer(
            'stale_from', self.exchange.stale_from))

    def restore(self, npz, path=''):
        """Load what :meth:`serialize` wrote, also from a job with another
        number of replicas (after a lost worker): dg takes replica 0 (all
        are equal); ipm takes each replica's own state when the numbers
        match, else starts every replica from the saved replicas' mean, a
        mix."""
        self.iteration = int(npz[f'{path}iteration'])
        for replica in self.replicas:  # the checkpoint's, or none
            precision.forget(replica)
        if f'{path}stale_from' in npz:
            self.exchange.stale_from = int(npz[f'{path}stale_from'])
        self.group.restore(npz, path, each=self.mode == 'ipm')
        saved = saved_replicas(npz, path)
        for i, optimizer in enumerate(self.optimizers):
            index = self.offset + i if self.mode == 'ipm' else 0
            index = index if index < saved else 0
            load(optimizer, npz, f'optimizer{index}', path)
            # each replica's own masters only where it is the one saved
            # (else, as after a mix, made again from its parameters)
            mine = self.mode == 'dg' or saved == self.total_replicas
            precision.serialize(optimizer, NpzDeserializer(
                npz, path=f'{path}precision{index if mine else -1}/',
                strict=False))
