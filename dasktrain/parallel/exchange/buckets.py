"""What travels in dg's exchange, and who carries it: the master's
parameters and gradients in a fixed order, gradient buckets, and the
communication thread of one step.

Pure bookkeeping for :mod:`~dasktrain.parallel.exchange.gradients`: it sums
nothing, times nothing and touches no communicator.
"""
import queue
import threading

import chainer


def parameters(link):
    """``link``'s parameters in a fixed order (by name), each once: a link
    registered under two names shares its parameters, and summing one
    array twice over the ranks would be wrong."""
    found = {}
    for _, p in sorted(link.namedparams()):
        found.setdefault(id(p), p)
    return list(found.values())


def gradients(link, device, indices=None, params=None):
    """``link``'s gradients in :func:`parameters`' order (only the
    positions ``indices`` if given); a missing one becomes zeros (a
    parameter this step did not reach). ``params``: :func:`parameters`
    of ``link`` already found (a link's parameters never change)."""
    params = parameters(link) if params is None else params
    grads = []
    with chainer.using_device(device):
        for i in range(len(params)) if indices is None else indices:
            p = params[i]
            if p.grad is None:
                p.grad = device.xp.zeros_like(p.array)
            grads.append(p.grad)
    return grads


def plan_buckets(order, sizes, limit):
    """Buckets of parameter indices: ``order`` (the indices as their
    gradients became ready) cut into runs of at least ``limit`` bytes
    (``sizes[i]`` each), the last run holding the rest; indices missing from
    ``order`` (no gradient reached them) join the last bucket."""
    buckets, current, total = [], [], 0
    for i in order:
        current.append(i)
        total += sizes[i]
        if total >= limit:
            buckets.append(current)
            current, total = [], 0
    missing = sorted(set(range(len(sizes))) - set(order))
    current += missing
    if current or not buckets:
        buckets.append(current)
    return buckets


class Courier:
    """The communication thread of one step: runs the buckets handed to it,
    in order, until told to stop; its first error is kept for the
    training thread and the rest of the queue skipped."""

    def __init__(self, work):
        self.work, self.error = work, None
        self.queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name='dasktrain-buckets')
        self.thread.start()

    def _run(self):
        while True:
            item = self.queue.get()
            if item is None:
                return
            if self.error is None:
                try:
                    self.work(*item)
                except BaseException as e:  # re-raised in the caller
                    self.error = e

    def put(self, *item):
        self.queue.put(item)

    def close(self, timeout=None, quiet=False):
        """Stop after what was handed over; wait; raise the thread's error
        (unless ``quiet``: the caller is raising its own)."""
        self.queue.put(None)
        self.thread.join(timeout)
        if self.error is not None and not quiet:
            raise self.error
