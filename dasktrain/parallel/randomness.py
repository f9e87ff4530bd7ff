"""Each replica's own random stream (dropout masks): the same draws
wherever a replica runs, alone on a GPU, beside others in one process,
or in a process of its own.

Owns the streams only; the replicas are :mod:`~dasktrain.parallel.replicas`'.
"""
import contextlib

import chainer
import numpy as np


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

