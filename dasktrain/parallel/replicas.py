"""A model's replicas on this process's devices, given a communicator.

:class:`Replicas` copies a model onto devices (the first copy, the
*master*, is the model itself), numbers the copies in the whole job, starts
them from rank 0's weights, runs each on its part of a batch with its own
random stream (:class:`ReplicaRandom`) and restores them from a checkpoint.
Across replicas it lists each value (parameter, persistent such as
BatchNorm's statistics, optimizer state) as its array in every replica, in
one fixed order (a *group*), averages groups over all of a job's replicas
(in float64, here then over processes in rank order: one rounding, a mean
that is the same bits however the replicas are spread) and writes values
back into every replica.

On GPUs each of these runs with the device of the array it writes current,
reads a GPU's arrays only after that GPU has finished its queued work, and
moves one replica's arrays as one flat buffer
(:func:`dasktrain.parallel.devices.transfer`): nothing lands on a GPU the
user did not list. It knows no optimizer (an optimizer's state is only
handed in as arrays) and no update.
"""
import copy

import chainer
import numpy as np
from chainer.serializers import NpzDeserializer

from dasktrain.parallel import precision
from dasktrain.parallel.devices import (
    copy_into,
    input_dtype,
    synchronize,
    transfer,
)
from dasktrain.parallel.randomness import ReplicaRandom


def _persistents(link):
    """(owner link, name) of every persistent value, in a fixed order."""
    for _, sub in sorted(link.namedlinks()):
        for name in sorted(sub._persistent):
            yield sub, name


def _bare_copy(link):
    """A copy of ``link`` without its parameters' update rules (Chainer's
    copy keeps them, float32 masters and all): its values are its
    arrays."""
    copied = link.copy(mode='copy')
    for param in copied.params():
        param.update_rule = None
    return copied


def load(target, npz, name, path=''):
    """Load entry ``name`` of a checkpoint's ``npz`` (under ``path``) into
    ``target``, a link or an optimizer."""
    target.serialize(NpzDeserializer(npz, path=f'{path}{name}/'))


def saved_replicas(npz, path=''):
    """How many replicas a checkpoint's ``npz`` holds (under ``path``)."""
    return len({key[len(path):].split('/')[0] for key in npz.files
                if key.startswith(f'{path}replica')})


class Replicas:
    """Copies of ``chain`` (the master, moved to the first device) on
    ``devices`` (Chainer devices, which may repeat): one replica group of
    the job of ``comm``'s ranks, each rank making one.

    ``links`` are the replicas, the master first; ``offset`` is the
    master's index among the job's ``total`` replicas; ``random`` their
    random streams.
    """

    def __init__(self, chain, devices, comm):
        self.devices, self.comm = list(devices), comm
        copies = [chain.copy(mode='copy') for _ in self.devices[1:]]
        self.links = [chain] + copies
        for link, device in zip(self.links, self.devices):
            link.to_device(device)
        counts = comm.allgather(len(self.links))
        self.offset = sum(counts[:comm.rank])  # global replica index
        self.total = sum(counts)
        if comm.size > 1:
            self.start_from_rank0()
        self.random = ReplicaRandom(self.devices)
        self._metrics = [None] * len(self.links)  # on-device sums
        # What the replicas report (chainer.report), as 'r{i}/key': a
        # Classifier's loss and accuracy, or a model's own metrics.
        self.reporter = chainer.Reporter()
        for i, link in enumerate(self.links):
            self.reporter.add_observer(f'r{i}', link)
            self.reporter.add_observers(f'r{i}', link.namedlinks(True))
        self.reported, self._losses = {}, []

    def __len__(self):
        return len(self.links)

    @property
    def master(self):
        """The first replica, on the first device."""
        return self.links[0]

    def start_from_rank0(self):
        """Every replica := rank 0's master. Each process drew its own
        initial weights; summing gradients of different models would go
        unnoticed."""
        mine = [chainer.backends.cuda.to_cpu(a)
                for (a,) in self.groups([self.master])]
        start = self.comm.bcast(mine if self.comm.rank == 0 else None)
        self.write(self.groups(self.links),
                   [self.devices[0].send(a) for a in start])

    def initialize(self, parts):
        """Lazily initialised links (``L.Linear(None, n)``, the Chainer
        idiom) take their shapes from the first batch, each replica and
        rank drawing its own weights: initialise every replica on one
        example of a non-empty part (test mode, no gradients), then the
        master's weights everywhere and rank 0's on every rank (as at
        construction). Nothing to do once every parameter has an array."""
        if all(p.array is not None for p in self.master.params()):
            return
        sample = next((p for p in parts if len(p[0])), None)
        with chainer.using_config('train', False), \
                chainer.no_backprop_mode(), self.reporter.scope({}):
            for link, device in zip(self.links, self.devices):
                if sample is not None:
                    with chainer.using_device(device):
                        # a part may already be on another GPU: send it,
                        # never through np.asarray (CuPy refuses that)
                        link(*[device.send(a[:1]) for a in sample])
        self.copy_master()
        if self.comm.size > 1:
            self.start_from_rank0()

    def split(self, x):
        """``x`` in near-equal parts, the larger first, each sent to its
        replica's device; floating inputs in the model's dtype. ``x`` may
        already be on a device (a CuPy array: split there, never through
        NumPy, which CuPy refuses)."""
        xp = chainer.backend.get_array_module(x)
        x = xp.asarray(x)
        if x.dtype.kind == 'f':
            x = x.astype(input_dtype(self.links[0]), copy=False)
        parts = xp.array_split(x, len(self))
        return [d.send(a) for d, a in zip(self.devices, parts)]

    def forward(self, parts):
        """Each replica's loss on its part (a tuple of arguments; None if
        empty), with its device current, drawing from its own stream;
        what they report goes to :attr:`reported`. The last step's losses
        (and through them its whole graph) are let go first, as Chainer's
        Classifier does: else two graphs' activations would peak
        together."""
        losses, self.reported, self._losses = [], {}, None
        with self.reporter.scope(self.reported):
            for i, (replica, device, part) in enumerate(zip(
                    self.links, self.devices, parts)):
                with chainer.using_device(device):
                    if not len(part[0]):
                        losses.append(None)
                        continue
                    with self.random.drawing(i):
                        losses.append(replica(*part))
        self._losses = losses
        return losses

    def _last(self, i):
        """Replica ``i``'s last loss and accuracy arrays (NaN for a model
        of its own loss that reports no accuracy)."""
        accuracy = self.reported.get(f'r{i}/accuracy')
        loss = self._losses[i].array
        if accuracy is None:
            with chainer.using_device(self.devices[i]):  # loss's own GPU
                return loss, loss * np.nan
        return loss, getattr(accuracy, 'array', accuracy)

    def accumulate(self, sizes):
        """Add each replica's last loss and accuracy, times its part's
        ``sizes``, to sums on its device."""
        for i, (device, size) in enumerate(zip(self.devices, sizes)):
            if size:
                with chainer.using_device(device):
                    values = device.xp.stack([
                        device.xp.asarray(a, np.float64)
                        for a in self._last(i)])
                    values = values * size
                    sums = self._metrics[i]
                    self._metrics[i] = (values, size) if sums is None else \
                        (sums[0] + values, sums[1] + size)

    def take_metrics(self):
        """(loss sum, accuracy sum, images) since the last call."""
        loss = accuracy = images = 0.0
        for sums in self._metrics:
            if sums is not None:
                values = chainer.backends.cuda.to_cpu(sums[0])
                loss += float(values[0])
                accuracy += float(values[1])
                images += sums[1]
        self._metrics = [None] * len(self.links)
        return loss, accuracy, images

    def observed(self, sizes):
        """The replicas' last loss and accuracy, weighted by ``sizes``."""
        total = sum(sizes) or 1
        loss = accuracy = 0.0
        for i, size in enumerate(sizes):
            if size:
                last = [float(a) for a in self._last(i)]
                loss += last[0] * size / total
                accuracy += last[1] * size / total
        return loss, accuracy

    def groups(self, replicas, params=True, persistents=True, states=False):
        """For each averaged value, its array in every replica, in one fixed
        order (parameters first: a float16 parameter's float32 master where
        its update rule keeps one, :func:`~dasktrain.parallel.precision.
        value`). Python scalars, such as BatchNorm's batch count, and
        uninitialised parameters are left out."""
        # Skipped when only persistents are wanted: dg syncs them every step.
        named = [sorted(r.namedparams()) for r in replicas] \
            if params or states else []
        groups = []
        if params:
            groups += [[precision.value(p) for _, p in ps]
                       for ps in zip(*named)]
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

    def local_sums(self, groups, keep=False, wide=True):
        """Each group's sum over this process's replicas, on the master's
        device (new arrays), in float64 (``wide``) or its own dtype; with
        ``keep``, also every replica's arrays as they arrived there."""
        master, arrived, sums = self.devices[0], [], [] if not groups else None
        for i, device in enumerate(self.devices if groups else ()):
            moved = transfer([g[i] for g in groups], device, master)
            with chainer.using_device(master):
                if sums is None:  # copies (astype's): summed in place
                    sums = [a.astype(np.float64 if wide else a.dtype)
                            for a in moved]
                else:
                    for acc, a in zip(sums, moved):
                        acc += a
            if keep:
                arrived.append(moved)
        return sums, arrived

    def reduce(self, sums, check=False, also=()):
        """Local sums to means over all the job's replicas: summed across
        processes in rank order (with ``also``, more arrays on the
        master's device summed in place in the same all-reduce: one
        message, not two), then divided."""
        with chainer.using_device(self.devices[0]):
            # Optimizer state may differ between ranks: ``check`` compares.
            self.comm.allreduce(list(also) + sums, check=check)
        return self._divide(sums)

    def ireduce(self, sums, also=(), around=None):
        """:meth:`reduce` of these ``sums`` and ``also`` (bound now), on a
        communication thread (inside ``around()``, as in the communicator's
        ``iallreduce``): returns at once a handle whose ``wait()`` returns
        the means (the same arrays, divided once)."""
        return _Reduction(self.comm.iallreduce(list(also) + sums,
                                               around=around),
                          lambda: self._divide(sums))

    def _divide(self, sums):
        with chainer.using_device(self.devices[0]):
            for acc in sums:
                acc /= self.total
        return sums

    def means(self, groups, keep=False, check=False, also=()):
        """Each group's arithmetic mean over all the job's replicas, on the
        master's device: summed in float64 (here, then across processes in
        rank order) and rounded once by the caller. With ``keep``, also
        every replica's arrays as they arrived on the master's device;
        ``also`` as in :meth:`reduce`."""
        if not groups and not also:  # e.g. no BatchNorm: no round trip
            return ([], []) if keep else []
        sums, arrived = self.local_sums(groups, keep)
        sums = self.reduce(sums, check, also)
        return (sums, arrived) if keep else sums

    def squared_distance(self, arrived, means):
        """Sum over all replicas of their squared L2 distance from
        ``means``, summed on the master's device and read once."""
        master = self.devices[0]
        with chainer.using_device(master):
            local = master.xp.zeros((), np.float64)
            for k, mean in enumerate(means):
                for arrays in arrived:
                    d = (arrays[k] - mean).ravel()
                    local += d @ d  # BLAS dot: no squared temporary
            local = chainer.backends.cuda.to_cpu(local).reshape(1)
        return float(self.comm.allreduce([local])[0][0])

    def broadcast(self, groups, values):
        """Write ``values`` (on the master's device) into every replica's
        array of each group, cast to its dtype, each on its own device; a
        float32 master written, its parameter gets its rounding."""
        master = self.devices[0]
        for i, device in enumerate(self.devices):
            targets = [g[i] for g in groups]
            sources = [v for g, v in zip(groups, values)]
            if i == 0 and all(t is s for t, s in zip(targets, sources)):
                continue  # the master's own arrays
            copy_into(targets, transfer(sources, master, device), device)
            written = {id(t) for t in targets}
            rounded = [(p, kept) for p, kept in precision.masters(
                self.links[i]) if id(kept.array) in written]
            if rounded:
                copy_into([p.array for p, _ in rounded],
                          [kept.array for _, kept in rounded], device)

    def copy_master(self, persistents=True):
        """The master's parameters (and persistent arrays) into every other
        replica; persistent Python values (BatchNorm's N) always."""
        groups = self.groups(self.links, persistents=persistents)
        self.broadcast(groups, [g[0] for g in groups])
        for replica in self.links[1:]:
            for (dst, name), (src, _) in zip(_persistents(replica),
                                             _persistents(self.master)):
                value = getattr(src, name)
                if not hasattr(value, 'dtype'):
                    setattr(dst, name, copy.deepcopy(value))

    def write(self, groups, means):
        """Every replica's arrays of ``groups`` := ``means`` (float64 on
        the master's device), rounded once to each array's dtype."""
        with chainer.using_device(self.devices[0]):
            rounded = [m.astype(g[0].dtype, copy=False)
                       for g, m in zip(groups, means)]
        self.broadcast(groups, rounded)

    def mix(self, states=False):
        """Every replica := the mean of the job's replicas (parameters,
        persistents and with ``states`` optimizer state); returns the sum
        of their parameters' squared distances from it before."""
        n_params = sum(1 for _, p in self.master.namedparams()
                       if p.array is not None)
        groups = self.groups(self.links, states=states)
        means, arrived = self.means(groups, keep=True, check=states)
        squared = self.squared_distance(
            [a[:n_params] for a in arrived], means[:n_params])
        self.write(groups, means)
        return squared

    def spread(self):
        """The sum of the replicas' squared distances from their mean
        parameters, changing nothing."""
        groups = self.groups(self.links, persistents=False)
        means, arrived = self.means(groups, keep=True)
        return self.squared_distance(arrived, means)

    def mean_copy(self):
        """A copy of the master holding the replicas' mean parameters and
        persistents, leaving the replicas untouched."""
        snapshot = _bare_copy(self.master)
        means = self.means(self.groups(self.links))
        with chainer.using_device(self.devices[0]):
            for (target,), mean in zip(self.groups([snapshot]), means):
                target[...] = mean.astype(target.dtype)
        return snapshot

    def per_device(self, link=None):
        """(link, device) once per distinct device: the replica there, or
        with ``link`` (on the master's device), a copy of it moved there."""
        found = {}
        for replica, device in zip(self.links, self.devices):
            if str(device) in found:
                continue
            if link is not None:
                replica = link
                if device != self.devices[0]:
                    with chainer.using_device(self.devices[0]):
                        replica = link.copy(mode='copy')
                    synchronize(self.devices[:1])  # before another reads
                    with chainer.using_device(device):
                        replica.to_device(device)
                    synchronize([device])  # the copies read the master's
            found[str(device)] = (replica, device)
        return list(found.values())

    def _sized_as_master(self, like=None):
        """Lazily initialised links not run yet: every replica's arrays
        made in the shapes of ``like`` (default: the master), which a
        checkpoint sized."""
        like = like or self.master
        for link, device in zip(self.links, self.devices):
            for mine, theirs in zip(link.params(), like.params()):
                if mine.array is None and theirs.array is not None:
                    with chainer.using_device(device):
                        mine.initialize(theirs.shape)

    def restore(self, npz, path='', each=True):
        """Load the replicas from a checkpoint's ``replica{i}`` (under
        ``path``), also one of another number of them. Without ``each``
        (all equal: dg), replica 0 into every one; with it, each its own
        where the numbers match, else all the saved ones' mean, a mix."""
        if not each:
            load(self.master, npz, 'replica0', path)
            self._sized_as_master()
            self.copy_master()
            return
        saved = saved_replicas(npz, path)
        if saved == self.total:
            for i, replica in enumerate(self.links):
                load(replica, npz, f'replica{self.offset + i}', path)
            return
        scratch = _bare_copy(self.master)
        master = self.devices[0]
        sums = None
        for i in range(saved):
            load(scratch, npz, f'replica{i}', path)
            with chainer.using_device(master):
                arrays = [g[0].astype(np.float64)
                          for g in self.groups([scratch])]
                sums = arrays if sums is None else \
                    [a + b for a, b in zip(sums, arrays)]
        with chainer.using_device(master):
            means = [total / saved for total in sums]
        self._sized_as_master(scratch)
        self.write(self.groups(self.links), means)


class _Reduction:
    """:meth:`Replicas.ireduce`'s handle: the means, finished once."""

    def __init__(self, pending, finish):
        self._pending, self._finish, self._means = pending, finish, None

    def wait(self):
        if self._means is None:
            self._pending.wait()
            self._means = self._finish()
        return self._means
