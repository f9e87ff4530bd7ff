"""The arrays of a model's replicas, across devices and processes.

:class:`ReplicaArrays` does what every cross-replica operation of
:class:`~dasktrain.parallel.GPUDistributedGradient` needs: list each value
(parameter, persistent such as BatchNorm's statistics, optimizer state) as
its array in every replica, in one fixed order (a *group*); average groups
over all of a job's replicas, summed in float64 here and then across
processes in rank order; measure the replicas' squared distance from their
mean; write values back into every replica.

On GPUs each of these runs with the device of the array it writes current
(CuPy launches a kernel on the current device; one reading another GPU's
memory needs peer access), reads a GPU's arrays only after that GPU has
finished its queued work, and moves one replica's arrays as one flat buffer
(:func:`dasktrain.parallel.devices.transfer`): nothing lands on a GPU the user did
not list, and a step costs one transfer per replica, not one per array.

:class:`ReplicaRandom` gives each replica its own random stream, and
:func:`restore` loads a checkpoint into the replicas, also one written with
another number of them.
"""
import contextlib
import copy

import chainer
import numpy as np
from chainer.serializers import NpzDeserializer

from dasktrain.parallel.devices import copy_into, transfer


def _persistents(link):
    """(owner link, name) of every persistent value, in a fixed order."""
    for _, sub in sorted(link.namedlinks()):
        for name in sorted(sub._persistent):
            yield sub, name


class ReplicaArrays:
    """The arrays of ``model``'s replicas (a GPUDistributedGradient: its
    ``replicas``, ``devices``, ``master``, ``comm`` and ``total_replicas``
    are read at each call)."""

    def __init__(self, model):
        self.model = model

    def groups(self, replicas, params=True, persistents=True, states=False):
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

    def local_sums(self, groups, keep=False):
        """Each group's float64 sum over this process's replicas, on the
        master's device (new arrays); with ``keep``, also every replica's
        arrays as they arrived there."""
        master = self.model.devices[0]
        arrived, sums = [], [] if not groups else None
        for i, device in enumerate(self.model.devices if groups else ()):
            moved = transfer([g[i] for g in groups], device, master)
            with chainer.using_device(master):
                if sums is None:
                    sums = [a.astype(np.float64) for a in moved]
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
        with chainer.using_device(self.model.devices[0]):
            # Optimizer state may differ between ranks: ``check`` compares.
            self.model.comm.allreduce(list(also) + sums, check=check)
            for acc in sums:
                acc /= self.model.total_replicas
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
        master = self.model.devices[0]
        with chainer.using_device(master):
            local = master.xp.zeros((), np.float64)
            for k, mean in enumerate(means):
                for arrays in arrived:
                    d = (arrays[k] - mean).ravel()
                    local += d @ d  # BLAS dot: no squared temporary
            local = chainer.backends.cuda.to_cpu(local).reshape(1)
        return float(self.model.comm.allreduce([local])[0][0])

    def broadcast(self, groups, values):
        """Write ``values`` (on the master's device) into every replica's
        array of each group, cast to its dtype, each on its own device."""
        master = self.model.devices[0]
        for i, device in enumerate(self.model.devices):
            targets = [g[i] for g in groups]
            sources = [v for g, v in zip(groups, values)]
            if i == 0 and all(t is s for t, s in zip(targets, sources)):
                continue  # the master's own arrays
            copy_into(targets, transfer(sources, master, device), device)

    def copy_master(self, persistents=True):
        """The master's parameters (and persistent arrays) into every other
        replica; persistent Python values (BatchNorm's N) always."""
        groups = self.groups(self.model.replicas, persistents=persistents)
        self.broadcast(groups, [g[0] for g in groups])
        for replica in self.model.replicas[1:]:
            for (dst, name), (src, _) in zip(_persistents(replica),
                                             _persistents(self.model.master)):
                value = getattr(src, name)
                if not hasattr(value, 'dtype'):
                    setattr(dst, name, copy.deepcopy(value))

    def write(self, groups, means):
        """Every replica's arrays of ``groups`` := ``means`` (float64 on
        the master's device), rounded once to each array's dtype."""
        with chainer.using_device(self.model.devices[0]):
            rounded = [m.astype(g[0].dtype, copy=False)
                       for g, m in zip(groups, means)]
        self.broadcast(groups, rounded)


class ReplicaRandom:
    """One random stream per replica, for what a replica draws (dropout).

    NumPy's and CuPy's generators are global (CuPy's, one per device): two
    replicas in one process, or on one GPU, would otherwise share one and
    draw differently than the same replicas spread over processes. Inside
    :meth:`drawing` the replica's own state is swapped in.
    """

    def __init__(self, devices):
        self.devices = devices
        self.states = [None] * len(devices)

    def seed(self, seed, epoch, offset):
        """States from (``seed``, ``epoch``, global replica index)."""
        for i, device in enumerate(self.devices):
            state = int(np.random.SeedSequence(
                [seed, epoch, offset + i]).generate_state(1)[0])
            if device.xp is np:
                self.states[i] = np.random.RandomState(state).get_state()
            else:
                with chainer.using_device(device):
                    self.states[i] = device.xp.random.RandomState(state)

    @contextlib.contextmanager
    def drawing(self, i):
        """Replica ``i`` draws from its own stream inside the block (with
        its device current)."""
        mine, device = self.states[i], self.devices[i]
        if mine is None:
            yield
        elif device.xp is np:
            outer = np.random.get_state()
            np.random.set_state(mine)
            try:
                yield
            finally:
                self.states[i] = np.random.get_state()
                np.random.set_state(outer)
        else:  # CuPy keeps one RandomState per device: swap ours in
            random = device.xp.random
            outer = random.get_random_state()
            random.set_random_state(mine)
            try:
                yield
            finally:
                random.set_random_state(outer)


def restore(model, npz, path=''):
    """Load what ``model.serialize`` wrote into ``model`` (a
    GPUDistributedGradient), also from a job with another number of
    replicas (after a lost worker): dg takes replica 0 (all are equal); ipm
    takes each replica's own state when the numbers match, else starts
    every replica from the saved replicas' mean, a mix."""
    def load(target, name):
        target.serialize(NpzDeserializer(npz, path=f'{path}{name}/'))
    saved = len({key[len(path):].split('/')[0] for key in npz.files
                 if key.startswith(f'{path}replica')})
    model.iteration = int(npz[f'{path}iteration'])
    if model.mode == 'dg':
        load(model.master, 'replica0')
        load(model.optimizer, 'optimizer0')
        model.arrays.copy_master()
        return
    if saved == model.total_replicas:
        for i, (replica, optimizer) in enumerate(zip(model.replicas,
                                                     model.optimizers)):
            load(replica, f'replica{model.offset + i}')
            load(optimizer, f'optimizer{model.offset + i}')
        return
    scratch = model.master.copy(mode='copy')
    master = model.devices[0]
    sums = None
    for i in range(saved):
        load(scratch, f'replica{i}')
        with chainer.using_device(master):
            arrays = [g[0].astype(np.float64)
                      for g in model.arrays.groups([scratch])]
            sums = arrays if sums is None else \
                [a + b for a, b in zip(sums, arrays)]
    with chainer.using_device(master):
        means = [total / saved for total in sums]
    model.arrays.write(model.arrays.groups(model.replicas), means)
    for i, optimizer in enumerate(model.optimizers):
        index = model.offset + i
        load(optimizer, f'optimizer{index if index < saved else 0}')
