"""Data-parallel training of one Chainer model on several devices.

After the seed post's ``GPUDistributedGradient`` (Chainer 1.5), grown to
Chainer 7: the same ``with model as m: m(xs, ts)`` protocol, plus a
one-call :meth:`GPUDistributedGradient.step`, a mean (not summed) merged
gradient, and an iterative-parameter-mixture mode.
"""
import copy
import time

import chainer
import numpy as np

from dasktrain.collective import Solo
from dasktrain.devices import DeviceError, resolve_devices  # noqa: F401

MODES = ('dg', 'ipm')


def _persistents(link):
    """(owner link, name) of every persistent value, in a fixed order."""
    for _, sub in sorted(link.namedlinks()):
        for name in sorted(sub._persistent):
            yield sub, name


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
    comm : dasktrain.collective.DaskComm or NcclComm, optional
        Make this one replica group of a job across processes: dg sums the
        masters' gradients over ``comm`` every step, ipm averages over all
        groups' replicas; the results are those of one process holding all
        the replicas. Default: this process is the whole job.

    Examples
    --------
    >>> model = GPUDistributedGradient(L.Classifier(net), [0, 1, 2, 3])  # doctest: +SKIP
    >>> model.setup(chainer.optimizers.Adam())  # doctest: +SKIP
    >>> loss, accuracy = model.step(x, t)  # doctest: +SKIP

    The seed's protocol works too, in dg mode::

        with model as m:
            m(xs, ts)          # one array per replica, already on its device
        optimizer.update()
        model.syncparams()
    """

    def __init__(self, chain, devices, mode='dg', mix_every=None,
                 mix_optimizer_state=False, comm=None):
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
        self.devices = resolve_devices(devices)
        self.mode = mode
        self.mix_every = mix_every
        self.mix_optimizer_state = mix_optimizer_state
        copies = [chain.copy(mode='copy') for _ in self.devices[1:]]
        self.replicas = [chain] + copies
        for replica, device in zip(self.replicas, self.devices):
            replica.to_device(device)
        self.comm = comm or Solo()
        counts = self.comm.allgather(len(self.replicas))
        self.offset = sum(counts[:self.comm.rank])  # global replica index
        self.total_replicas = sum(counts)
        self._states = [None] * len(self.replicas)  # per-replica np RNG
        self.optimizers = []
        self.iteration = 0
        self.comm_time = 0.0   # s merging gradients, syncing and mixing
        self.drift = None      # RMS distance of replicas from their mean
        self.drifts = []       # ... before each mix so far
        self._losses = []
        self._sizes = []
        self._total = 0

    def __len__(self):
        return len(self.replicas)

    @property
    def master(self):
        """The first replica: the one the dg optimizer updates."""
        return self.replicas[0]

    @property
    def optimizer(self):
        return self.optimizers[0] if self.optimizers else None

    # ------------------------------------------------------------- set-up

    def setup(self, optimizer):
        """Attach ``optimizer`` (not yet set up): dg to the master, ipm to
        every replica (copies with the same hyperparameters)."""
        if getattr(optimizer, 'target', None) is not None:
            raise ValueError('optimizer is already set up on a link; pass a '
                             'fresh one to GPUDistributedGradient.setup')
        template = copy.deepcopy(optimizer)
        optimizer.setup(self.master)
        self.optimizers = [optimizer]
        if self.mode == 'ipm':
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
        """Seed each replica's random numbers (dropout) from (``seed``,
        ``epoch``, its global index): the same draws wherever it runs."""
        for i, device in enumerate(self.devices):
            state = np.random.SeedSequence(
                [seed, epoch, self.offset + i]).generate_state(1)[0]
            if device.xp is np:
                self._states[i] = np.random.RandomState(
                    int(state)).get_state()
            else:
                with chainer.using_device(device):
                    device.xp.random.seed(int(state))

    # ------------------------------------------------- the seed's protocol

    def cleargrads(self):
        for replica in self.replicas:
            replica.cleargrads()

    zerograds = cleargrads  # the seed's name

    def __call__(self, *args, total=None):
        """Forward every replica on its part: ``m(xs, ts)`` with one array
        per replica in each argument. Returns the master's loss. ``total``:
        images in the whole job's step (default: these parts')."""
        parts = list(zip(*args))
        if len(parts) != len(self):
            raise ValueError(f'expected one part per replica ({len(self)}), '
                             f'got {len(parts)}')
        self._sizes = [len(part[0]) for part in parts]
        self._total = sum(self._sizes) if total is None else total
        self._losses = []
        for i, (replica, device, part, size) in enumerate(zip(
                self.replicas, self.devices, parts, self._sizes)):
            with chainer.using_device(device):
                if not size:
                    self._losses.append(None)
                elif self._states[i] is None:
                    self._losses.append(replica(*part))
                else:  # this replica's own stream of dropout masks
                    outer = np.random.get_state()
                    np.random.set_state(self._states[i])
                    try:
                        self._losses.append(replica(*part))
                    finally:
                        self._states[i] = np.random.get_state()
                        np.random.set_state(outer)
        return self._losses[0]

    def backward(self):
        """Back-propagate every replica's loss. In dg mode each loss is
        weighted by its share of the batch, so the merged gradient is the
        gradient of the mean loss over the whole batch."""
        total = self._total
        for device, loss, size in zip(self.devices, self._losses,
                                      self._sizes):
            if loss is None:
                continue
            with chainer.using_device(device):
                if self.mode == 'dg' and size != total:
                    loss = loss * (size / total)
                loss.backward()

    def syncgrads(self):
        """Add every other replica's gradients into the master's."""
        began = time.perf_counter()
        for replica, size in zip(self.replicas[1:], self._sizes[1:]):
            if size:
                self.master.addgrads(replica)
        self.comm_time += time.perf_counter() - began

    def __enter__(self):
        self.cleargrads()
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is None:
            self.backward()
            if self.mode == 'dg':
                self.syncgrads()
        return False  # exceptions propagate

    def _allreduce_grads(self):
        """Sum the masters' gradients over the job's processes."""
        began = time.perf_counter()
        params = [p for _, p in sorted(self.master.namedparams())]
        for p in params:
            if p.grad is None:  # a group whose parts were empty this step
                p.grad = p.xp.zeros_like(p.array)
        self.comm.allreduce([p.grad for p in params])
        self.comm_time += time.perf_counter() - began

    def syncparams(self):
        """Copy the master's parameters to every replica; persistent values
        (BatchNorm statistics) are averaged over replicas first."""
        if self.total_replicas == 1:
            return
        began = time.perf_counter()
        self._average_persistents()
        for replica in self.replicas[1:]:
            replica.copyparams(self.master, copy_persistent=True)
        self.comm_time += time.perf_counter() - began

    # -------------------------------------------------------- one call

    def split(self, x, t):
        """Split a batch into near-equal parts, each sent to its device
        (the larger first, as the sharded loader hands them out)."""
        xs = np.array_split(np.asarray(x), len(self))
        ts = np.array_split(np.asarray(t), len(self))
        return ([d.send(a) for d, a in zip(self.devices, xs)],
                [d.send(a) for d, a in zip(self.devices, ts)])

    def update(self):
        """Apply one iteration's gradients: dg updates the master and syncs
        the replicas; ipm updates each replica and mixes when due."""
        if not self.optimizers:
            raise RuntimeError('call setup(optimizer) before update()')
        if self.mode == 'dg':
            if self.comm.size > 1:
                self._allreduce_grads()
            self.optimizer.update()
            self.syncparams()
        else:
            for optimizer, size in zip(self.optimizers, self._sizes):
                if size:
                    optimizer.update()
        self.iteration += 1
        if self.mode == 'ipm' and isinstance(self.mix_every, (int,
                                                              np.integer)) \
                and self.iteration % self.mix_every == 0:
            self.mix()

    def step(self, x, t, total=None):
        """One training iteration on the batch ``(x, t)``; ``total`` is the
        whole job's batch when this is one group of several (default:
        ``len(x)``).

        Returns
        -------
        (float, float)
            Loss and accuracy, averaged over this group's part of the batch.
        """
        if len(x) != len(t):
            raise ValueError(f'x and t must have the same length, got '
                             f'{len(x)} and {len(t)}')
        xs, ts = self.split(x, t)
        with self as m:
            m(xs, ts, total=total)
        self.update()
        return self.observed()

    def observed(self):
        """Batch-weighted mean of the replicas' last ``loss`` and
        ``accuracy`` (as ``L.Classifier`` records them)."""
        total = sum(self._sizes) or 1
        loss = accuracy = 0.0
        for replica, size in zip(self.replicas, self._sizes):
            if size:
                loss += float(replica.loss.array) * size / total
                accuracy += float(replica.accuracy.array) * size / total
        return loss, accuracy

    # -------------------------------------------------------- mixing

    def _groups(self, replicas, params=True, persistents=True, states=False):
        """For each averaged value, its array in every replica, in one fixed
        order (parameters first). Python scalars, such as BatchNorm's batch
        count, and uninitialised parameters are left out."""
        # Skipped when only persistents are wanted: dg syncs them every step.
        named = [sorted(r.namedparams()) for r in replicas] \
            if params or states else []
        groups = []
        if params:
            groups += [[p.array for _, p in ps] for ps in zip(*named)]
        if persistents:
            groups += [[getattr(link, name) for link, name in owners]
                       for owners in zip(*(_persistents(r) for r in replicas))]
        if states:
            for ps in zip(*named):
                rules = [p.update_rule for _, p in ps]
                if all(rule is not None and rule.state for rule in rules):
                    groups += [[rule.state[key] for rule in rules]
                               for key in sorted(rules[0].state)]
        return [g for g in groups if hasattr(g[0], 'dtype')]

    def _means(self, groups):
        """Each group's arithmetic mean over all the job's replicas, on the
        master's device: summed in float64 (here, then across processes in
        rank order) and rounded once by the caller."""
        if not groups:  # e.g. no BatchNorm: spare the round trip
            return []
        device = self.devices[0]
        sums = []
        for arrays in groups:
            acc = device.send(arrays[0]).astype(np.float64)
            for a in arrays[1:]:
                acc += device.send(a)
            sums.append(acc)
        self.comm.allreduce(sums)
        for acc in sums:
            acc /= self.total_replicas
        return sums

    def _squared_distance(self, groups, means):
        """Sum over all replicas of their squared L2 distance from
        ``means``."""
        device = self.devices[0]
        local = 0.0
        for arrays, mean in zip(groups, means):
            for a in arrays:
                d = (device.send(a) - mean).ravel()
                local += float(d @ d)  # BLAS dot: no squared temporary
        return float(self.comm.allreduce([np.array([local])])[0][0])

    def _write(self, arrays, mean):
        for a, device in zip(arrays, self.devices):
            a[...] = device.send(mean.astype(a.dtype, copy=False))

    def _average_persistents(self):
        groups = self._groups(self.replicas, params=False)
        for arrays, mean in zip(groups, self._means(groups)):
            self._write(arrays, mean)

    def mix(self):
        """Average parameters and persistents (and optimizer state if
        ``mix_optimizer_state``) over replicas and write the mean back to
        all of them. Sets :attr:`drift`, the replicas' RMS distance from
        their mean just before the mix."""
        began = time.perf_counter()
        n_params = sum(1 for _, p in self.master.namedparams()
                       if p.array is not None)
        groups = self._groups(self.replicas, states=self.mix_optimizer_state)
        means = self._means(groups)
        squared = self._squared_distance(groups[:n_params], means[:n_params])
        for arrays, mean in zip(groups, means):
            self._write(arrays, mean)
        self.drift = (squared / self.total_replicas) ** 0.5
        self.drifts.append(self.drift)
        self.comm_time += time.perf_counter() - began

    def spread(self):
        """The replicas' RMS distance from their mean now, without mixing
        (0 right after a mix or a sync)."""
        groups = self._groups(self.replicas, persistents=False)
        squared = self._squared_distance(groups, self._means(groups))
        return (squared / self.total_replicas) ** 0.5

    def end_epoch(self):
        """Mix if ``mix_every == 'epoch'``; call at the end of each epoch."""
        if self.mode == 'ipm' and self.mix_every == 'epoch':
            self.mix()

    def finalize(self):
        """The final mix of ipm (a no-op in dg, where replicas agree)."""
        if self.mode == 'ipm' and self.total_replicas > 1:
            self.mix()

    def averaged(self):
        """A copy of the master holding the replicas' mean parameters and
        persistents, leaving the replicas untouched: what evaluation uses
        mid-training in ipm mode. In dg mode, the master itself."""
        if self.mode == 'dg' or self.total_replicas == 1:
            return self.master
        snapshot = self.master.copy(mode='copy')
        groups = self._groups(self.replicas)
        for (target,), mean in zip(self._groups([snapshot]),
                                   self._means(groups)):
            target[...] = mean.astype(target.dtype)
        return snapshot

    # -------------------------------------------------------- checkpoints

    def serialize(self, serializer):
        """This group's replicas and optimizers, numbered by their index in
        the whole job, and the iteration count."""
        for i, replica in enumerate(self.replicas):
            replica.serialize(serializer[f'replica{self.offset + i}'])
        for i, optimizer in enumerate(self.optimizers):
            optimizer.serialize(serializer[f'optimizer{self.offset + i}'])
        self.iteration = int(serializer('iteration', self.iteration))
