"""Data-parallel training of one Chainer model on several devices.

After the seed post's ``GPUDistributedGradient`` (Chainer 1.5), grown to
Chainer 7: the same ``with model as m: m(xs, ts)`` protocol, plus a
one-call :meth:`GPUDistributedGradient.step`, a mean (not summed) merged
gradient, and an iterative-parameter-mixture mode.

On GPUs every operation across replicas runs with the device of the array
it writes current, reads another GPU's arrays only after that GPU finished
its queued work, and moves a replica's arrays as one flat buffer
(:func:`dasktrain.parallel.devices.transfer`), as Chainer's
MultiprocessParallelUpdater gathers gradients; nothing is computed on a GPU
the user did not list.
"""
import copy
import time

import chainer
import numpy as np

from dasktrain.parallel.collective import Solo
from dasktrain.parallel.devices import (DeviceError,  # noqa: F401
                                        resolve_devices, synchronize,
                                        transfer)
from dasktrain.parallel.gradcomm import GradientExchange, gradients
from dasktrain.parallel.replicas import ReplicaArrays, ReplicaRandom, restore

MODES = ('dg', 'ipm')


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
        dg across processes: each step applies the previous step's summed
        gradient while this step's is summed on a communication thread
        (ChainerMN's double buffering): updates are one step stale; the
        first step of an epoch applies none and :meth:`end_epoch` applies
        the last, so every epoch makes as many updates as exact dg.
    bucket_mb : float, default 0
        dg across processes with one replica here: all-reduce the
        gradients in buckets of about this many MiB, each as soon as the
        backward pass has computed it, on a communication thread, while
        back-propagation goes on (:mod:`dasktrain.parallel.gradcomm`); over
        Dask's comms and shared memory (and NCCL between two ranks) the
        sums are the same bits. 0: one all-reduce after the backward pass.
    comm : dasktrain.parallel.collective.DaskComm or NcclComm, optional
        Make this one replica group of a job across processes: every group
        starts from rank 0's weights, dg sums the masters' gradients over
        ``comm`` every step, ipm averages over all groups' replicas; the
        results are those of one process holding all the replicas.
        Default: this process is the whole job.

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
                 mix_optimizer_state=False, comm=None, comm_dtype=None,
                 double_buffering=False, bucket_mb=0.0):
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
        if comm_dtype not in (None, 'float16', 'float32'):
            raise ValueError(f"comm_dtype must be None, 'float16' or "
                             f"'float32', got {comm_dtype!r}")
        self.devices = resolve_devices(devices)
        self.mode = mode
        if isinstance(bucket_mb, bool) or not isinstance(
                bucket_mb, (int, float)) or not bucket_mb >= 0:
            raise ValueError(f'bucket_mb must be a number >= 0, got '
                             f'{bucket_mb!r}')
        self.exchange = GradientExchange(
            self, None if comm_dtype in (None, 'float32') else
            np.dtype(comm_dtype), bool(double_buffering), float(bucket_mb))
        self.mix_every = mix_every
        self.mix_optimizer_state = mix_optimizer_state
        copies = [chain.copy(mode='copy') for _ in self.devices[1:]]
        self.replicas = [chain] + copies
        for replica, device in zip(self.replicas, self.devices):
            replica.to_device(device)
        self.comm = comm or Solo()
        self.arrays = ReplicaArrays(self)
        counts = self.comm.allgather(len(self.replicas))
        self.offset = sum(counts[:self.comm.rank])  # global replica index
        self.total_replicas = sum(counts)
        if self.comm.size > 1:
            self._start_from_rank0()
        self.random = ReplicaRandom(self.devices)
        self.optimizers = []
        self.iteration = 0
        self.comm_time = 0.0   # s merging gradients, syncing and mixing
        self.drift = None      # RMS distance of replicas from their mean
        self.drifts = []       # ... before each mix so far
        self._losses = []
        self._sizes = []
        self._total = 0
        self._metrics = [None] * len(self.replicas)  # on-device sums

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

    def _start_from_rank0(self):
        # Each process drew its own initial weights; summing gradients of
        # different models would go unnoticed. Rank 0's win everywhere.
        master = self.devices[0]
        mine = [chainer.backends.cuda.to_cpu(a)
                for (a,) in self.arrays.groups([self.master])]
        start = self.comm.bcast(mine if self.comm.rank == 0 else None)
        self.arrays.write(self.arrays.groups(self.replicas),
                        [master.send(a) for a in start])

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
        """Seed each replica's own random numbers (dropout) from (``seed``,
        ``epoch``, its global index): the same draws wherever it runs, and
        two replicas on one GPU no longer share CuPy's one generator per
        device."""
        self.random.seed(seed, epoch, self.offset)

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
                    continue
                with self.random.drawing(i):
                    self._losses.append(replica(*part))
        return self._losses[0]

    def backward(self, overlap=False):
        """Back-propagate every replica's loss. In dg mode each loss is
        weighted by its share of the batch, so the merged gradient is the
        gradient of the mean loss over the whole batch. With ``overlap``
        (:meth:`step` across processes), the master's gradient buckets
        start their all-reduce during its backward pass."""
        total = self._total
        for i, (device, loss, size) in enumerate(zip(
                self.devices, self._losses, self._sizes)):
            with chainer.using_device(device):
                if loss is not None and self.mode == 'dg' and size != total:
                    loss = loss * (size / total)
                if i == 0 and overlap:  # with or without a loss: in step
                    self.exchange.backward(loss)
                elif loss is not None:
                    loss.backward()

    def timed(self, work):
        """Run ``work()`` and add its time to :attr:`comm_time`. GPUs are
        synchronised before and after: CUDA calls return before the work
        is done, and the backward pass is not communication."""
        synchronize(self.devices)
        began = time.perf_counter()
        result = work()
        synchronize(self.devices)
        self.comm_time += time.perf_counter() - began
        return result

    def syncgrads(self):
        """Add every other replica's gradients into the master's (one
        buffer per replica across devices, as addgrads on one device)."""
        def merge():
            master, device = self.master, self.devices[0]
            targets = gradients(master, device)
            for replica, d, size in zip(self.replicas[1:], self.devices[1:],
                                        self._sizes[1:]):
                if size:
                    moved = transfer(gradients(replica, d), d, device)
                    with chainer.using_device(device):
                        for target, g in zip(targets, moved):
                            target += g
        if len(self.replicas) > 1:
            self.timed(merge)

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
        """Apply the gradient still travelling (double buffering): at every
        epoch end, so that checkpoints hold no step in flight."""
        self.exchange.flush()

    def sync_replicas(self, groups, means):
        """Write averaged statistics and copy the master's parameters."""
        def sync():
            self.arrays.write(groups, means)
            self.arrays.copy_master(persistents=False)
        self.timed(sync)

    def syncparams(self):
        """Copy the master's parameters to every replica; persistent values
        (BatchNorm statistics) are averaged over replicas first."""
        if self.total_replicas == 1:
            return

        groups = self.arrays.groups(self.replicas, params=False)
        self.sync_replicas(groups, self.timed(
            lambda: self.arrays.means(groups)))

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
            if self.comm.size > 1 or self.exchange.double_buffering:
                self.exchange.step()  # one message per step
            else:
                with chainer.using_device(self.devices[0]):
                    self.optimizer.update()
                self.syncparams()
        else:
            for optimizer, device, size in zip(self.optimizers, self.devices,
                                               self._sizes):
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
        self(xs, ts, total=total)
        self.backward(overlap=True)
        if self.mode == 'dg':
            self.syncgrads()
        self.update()
        self._accumulate()
        return self.observed() if observe else None

    def _accumulate(self):
        # Summed on each replica's device; read once per take_metrics().
        for i, (replica, device, size) in enumerate(zip(
                self.replicas, self.devices, self._sizes)):
            if size:
                with chainer.using_device(device):
                    xp = device.xp
                    values = xp.stack([replica.loss.array,
                                       replica.accuracy.array])
                    values = values.astype(np.float64) * size
                    sums = self._metrics[i]
                    self._metrics[i] = (values, size) if sums is None else \
                        (sums[0] + values, sums[1] + size)

    def take_metrics(self):
        """(loss sum, accuracy sum, images) over the steps since the last
        call, each loss and accuracy weighted by its images: one read per
        replica, whatever the number of steps."""
        loss = accuracy = images = 0.0
        for i, sums in enumerate(self._metrics):
            if sums is not None:
                values = chainer.backends.cuda.to_cpu(sums[0])
                loss += float(values[0])
                accuracy += float(values[1])
                images += sums[1]
        self._metrics = [None] * len(self.replicas)
        return loss, accuracy, images

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

    def mix(self):
        """Average parameters and persistents (and optimizer state if
        ``mix_optimizer_state``) over replicas and write the mean back to
        all of them. Sets :attr:`drift`, the replicas' RMS distance from
        their mean just before the mix."""
        def work():
            n_params = sum(1 for _, p in self.master.namedparams()
                           if p.array is not None)
            groups = self.arrays.groups(self.replicas,
                                  states=self.mix_optimizer_state)
            means, arrived = self.arrays.means(
                groups, keep=True, check=self.mix_optimizer_state)
            squared = self.arrays.squared_distance(
                [a[:n_params] for a in arrived], means[:n_params])
            self.arrays.write(groups, means)
            return squared
        squared = self.timed(work)
        self.drift = (squared / self.total_replicas) ** 0.5
        self.drifts.append(self.drift)

    def spread(self):
        """The replicas' RMS distance from their mean now, without mixing
        (0 right after a mix or a sync)."""
        groups = self.arrays.groups(self.replicas, persistents=False)
        means, arrived = self.arrays.means(groups, keep=True)
        squared = self.arrays.squared_distance(arrived, means)
        return (squared / self.total_replicas) ** 0.5

    def end_epoch(self):
        """Mix if ``mix_every == 'epoch'``; apply a gradient in flight;
        call at the end of each epoch."""
        self.flush()
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
        means = self.arrays.means(self.arrays.groups(self.replicas))
        with chainer.using_device(self.devices[0]):
            for (target,), mean in zip(self.arrays.groups([snapshot]), means):
                target[...] = mean.astype(target.dtype)
        return snapshot

    def evaluators(self):
        """(link, device) to evaluate with, one per distinct device: the
        replicas themselves in dg (equal after every sync), copies of
        :meth:`averaged` in ipm."""
        evaluated = self.averaged()
        found = {}
        for replica, device in zip(self.replicas, self.devices):
            if str(device) in found:
                continue
            if evaluated is not self.master:
                replica = evaluated
                if device != self.devices[0]:
                    with chainer.using_device(self.devices[0]):
                        replica = evaluated.copy(mode='copy')
                    synchronize(self.devices[:1])  # before another reads
                    with chainer.using_device(device):
                        replica.to_device(device)
                    synchronize([device])  # the copies read the master's
            found[str(device)] = (replica, device)
        return list(found.values())

    # -------------------------------------------------------- checkpoints

    def serialize(self, serializer):
        """This group's replicas and optimizers, numbered by their index in
        the whole job, and the iteration count."""
        for i, replica in enumerate(self.replicas):
            replica.serialize(serializer[f'replica{self.offset + i}'])
        for i, optimizer in enumerate(self.optimizers):
            optimizer.serialize(serializer[f'optimizer{self.offset + i}'])
        self.iteration = int(serializer('iteration', self.iteration))

    def restore(self, npz, path=''):
        """Load what :meth:`serialize` wrote, also from a job with another
        number of replicas (after a lost worker): dg takes replica 0 (all
        are equal); ipm takes each replica's own state when the numbers
        match, else starts every replica from the saved replicas' mean, a
        mix."""
        restore(self, npz, path)
