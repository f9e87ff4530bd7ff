"""The contract every communicator keeps, and the job of one process.

A *communicator* joins the ranks (processes) of one training job: it sums
arrays over them and hands Python objects between them. Every one
implements :class:`Communicator`: :class:`Solo` (the job is this process),
:class:`~dasktrain.parallel.comm.dask.DaskComm` (ranks talking over Dask's
comms, or through shared memory on one host) and
:class:`~dasktrain.parallel.comm.nccl.NcclComm` (NCCL between GPUs). A
caller uses only what :class:`Communicator` declares; what differs between
them (one process or several, sums on the GPU or through the host) is a
declared attribute, never a probe of the type.

Also here: :class:`CollectiveError` (a fault among the ranks, which is not
the user's mistake), :func:`poll` (a wait with a deadline) and
:func:`spin_until` (a short wait for a peer of this machine, by
polling). How the arrays of one collective travel is
:mod:`~dasktrain.parallel.comm.batches`'s.

This module knows no devices and no arrays: it imports neither NumPy nor
CuPy nor Chainer (``dasktrain launch`` imports it, and starts sooner
without NumPy).
"""
import abc
import contextlib
import os
import threading
import time

from dasktrain.errors import Error

# How a rank's error says that a peer went away or never answered: a
# launch tells a rank that failed for a peer (an echo) from the cause by
# these, in a traceback and in the one line `dasktrain train` prints alike.
PEER_GONE = 'its worker died or its training failed'
PEER_DOWN = 'its peer died or the network is down'
PEER_SILENT = 'a peer died or hangs'
ECHO_PHRASES = (PEER_GONE, PEER_DOWN, PEER_SILENT)
#: ``DASKTRAIN_SHARED_MEMORY=0`` (the user's): ranks of one host do not
#: sum through shared memory.
SHARED_MEMORY_ENV = 'DASKTRAIN_SHARED_MEMORY'


class CollectiveError(Error, RuntimeError):
    """A peer died, hung past the timeout, or fell out of step."""


class PeerLost(CollectiveError):
    """A peer's connection closed."""


class Communicator(abc.ABC):
    """What every communicator offers: the collectives of a job's ranks.

    Every rank must make the same calls in the same order. Arrays are
    NumPy or CuPy arrays, summed in place.

    An abstract base class rather than a :class:`typing.Protocol`: every
    communicator derives from it, so a class that lacks a collective fails
    when it is made, not in the middle of training; and they all inherit
    the one :meth:`iallreduce` and :meth:`barrier`.

    Parameters
    ----------
    rank : int
        This process's index in the job, 0 to ``size - 1``.
    size : int
        The job's number of ranks.
    timeout : float or None
        Seconds any one collective may wait for a peer (None: it waits
        for nothing, as in a job of one process).

    Attributes
    ----------
    solo : bool
        True where this process is the whole job, started on its own
        (not a task of a Dask worker): no peers to wait for.
    sums_on_device : bool
        True where GPU arrays are summed where they lie (NCCL), False where
        they are copied to the host, summed there and copied back.
    machine : str or None
        The machine this rank runs on, as the job tells its machines apart
        (:class:`~dasktrain.parallel.comm.dask.DaskComm`: the host it
        listens on); None for a job of one process, which has no other.
    """

    #: Every member a communicator has, for checking one (tests).
    MEMBERS = ('rank', 'size', 'timeout', 'solo', 'sums_on_device',
               'allreduce', 'allreduce_queued', 'finish_queued',
               'iallreduce', 'allgather', 'gather', 'bcast', 'barrier',
               'send', 'recv', 'close')
    solo: bool
    sums_on_device: bool
    machine = None

    def __init__(self, rank, size, timeout):
        self.rank, self.size, self.timeout = rank, size, timeout

    @abc.abstractmethod
    def allreduce(self, arrays, check=False, scale=None):
        """Sum ``arrays`` over the ranks, in place, and return them. With
        ``check``, ranks whose arrays differ in dtype or size raise
        :class:`CollectiveError` instead of summing the wrong elements.
        ``scale`` (a float, the same on every rank): the sums times it
        land in the arrays, as ``a *= scale`` after the sum would leave
        them (a mean, where the communicator can, in the same pass)."""

    def allreduce_queued(self, arrays):
        """:meth:`allreduce`, allowed to return before the sums are done
        where they run in order on a GPU stream (NCCL): the caller may
        queue the next ones at once, and reads none before
        :meth:`finish_queued`. Elsewhere the sums are done on return."""
        return self.allreduce(arrays)

    def finish_queued(self):
        """Return once every sum :meth:`allreduce_queued` queued is done
        (within the timeout)."""
        return None  # nothing queued: every sum was done on return

    def iallreduce(self, arrays, check=False, around=None):
        """Start :meth:`allreduce` of ``arrays`` on a thread of its own and
        return at once; the handle's ``wait()`` returns the summed arrays.
        ``around``: a callable returning a context manager that the thread
        enters around the all-reduce (on GPUs, a side stream that waits for
        the kernels that wrote the arrays, and is synchronised on leaving:
        a new thread's CuPy stream is the default one, which NCCL would
        share with the next step's kernels).

        The arrays are bound now: the caller may rebind its names or reuse
        its list right after the call, and the sum is still of these
        arrays. The caller must not read or write them before ``wait()``,
        nor start another collective in between (every rank makes the same
        calls in the same order).

        Examples
        --------
        >>> import numpy as np
        >>> comm = Solo()
        >>> a = np.ones(3)
        >>> pending = comm.iallreduce([a])
        >>> a = None  # rebinding the name changes nothing
        >>> pending.wait()
        [array([1., 1., 1.])]
        """
        return Pending(self.allreduce, list(arrays), check, around)

    @abc.abstractmethod
    def allgather(self, obj):
        """Every rank's ``obj``, in rank order, on every rank."""

    @abc.abstractmethod
    def gather(self, obj):
        """Every rank's ``obj`` in rank order on rank 0; None elsewhere."""

    @abc.abstractmethod
    def bcast(self, obj):
        """Rank 0's ``obj`` on every rank."""

    def barrier(self):
        """Return once every rank has called it."""
        self.allgather(None)

    def send(self, obj, dest):
        """Send ``obj`` to rank ``dest`` alone (point to point); that
        rank takes it with :meth:`recv`. Only the two ranks take part."""
        raise CollectiveError(f'rank {dest} is not a peer of this job of '
                              f'{self.size} rank(s)')

    def recv(self, source):
        """The next ``obj`` that rank ``source`` sent here with
        :meth:`send`."""
        raise CollectiveError(f'rank {source} is not a peer of this job of '
                              f'{self.size} rank(s)')

    @abc.abstractmethod
    def close(self):
        """Free what the communicator holds (connections, NCCL's)."""


class Pending:
    """An all-reduce running on a thread of its own, from
    :meth:`Communicator.iallreduce`. The thread never outlives the step
    that waits for it."""

    def __init__(self, allreduce, arrays, check, around=None):
        self._result, self._error = None, None

        def run():
            try:
                with around() if around else contextlib.nullcontext():
                    self._result = allreduce(arrays, check=check)
            except BaseException as e:  # re-raised in the caller's thread
                self._error = e
        self._thread = threading.Thread(target=run, daemon=True,
                                        name='dasktrain-allreduce')
        self._thread.start()

    def wait(self):
        """The summed arrays once the all-reduce is done; raises what it
        raised. May be called again: the same answer."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class Solo(Communicator):
    """The communicator of a job that runs in one process.

    Examples
    --------
    >>> comm = Solo()
    >>> comm.rank, comm.size, comm.allgather('me')
    (0, 1, ['me'])
    """
    solo = True
    sums_on_device = True  # nothing leaves the device

    def __init__(self):
        super().__init__(0, 1, None)

    def allreduce(self, arrays, check=False, scale=None):
        # imported here: this module stays without NumPy (see above)
        from dasktrain.parallel.comm.batches import scaled
        return scaled(arrays, scale)

    def allgather(self, obj):
        return [obj]

    def gather(self, obj):
        return [obj]

    def bcast(self, obj):
        return obj

    def close(self):
        pass


#: Seconds a wait only yields between queries, then sleeps
#: :func:`pause`'s. Measured on an H200 (docs/gpus.md): sleeping 100 us
#: between queries added ~100 us to every NCCL call; yielding, then
#: sleeping a small part of the time waited, ended within a few us of a
#: blocking synchronise.
YIELD_FOR = 1e-3


def pause(waited):
    """Seconds to sleep between two queries of a wait that began
    ``waited`` seconds ago: none (a yield) for the first
    :data:`YIELD_FOR`, then a fiftieth of the time waited, at most 1 ms,
    so a wait ends at most ~2 % (or 1 ms) after what it waits for, and a
    long one wakes 1000 times a second, not 10,000.

    Examples
    --------
    >>> pause(0.0), pause(0.005), pause(0.002), pause(10.0)
    (0.0, 0.0001, 4e-05, 0.001)
    """
    if waited < YIELD_FOR:
        return 0.0
    return min(1e-3, round(waited / 50, 6))


def poll(check, deadline, what, abort):
    """Call ``check()`` until it returns True; it raises the real error of
    a failed operation. After ``deadline`` (``time.monotonic()``),
    ``abort()`` and raise :class:`CollectiveError`: no rank waits forever
    on a peer or a GPU. Between queries it sleeps :func:`pause`'s seconds
    (``time.sleep(0)`` yields the GIL to the training thread).

    Examples
    --------
    >>> poll(lambda: True, time.monotonic() + 1, 'nothing', lambda: None)
    """
    began = time.monotonic()
    while not check():
        now = time.monotonic()
        if now > deadline:
            abort()
            raise CollectiveError(f'{what} did not finish within the '
                                  f'collective_timeout: {PEER_SILENT}')
        time.sleep(pause(now - began))


#: Seconds a rank polls for a peer of its machine (a word of the board,
#: a socket) before it sleeps, where every rank of the machine has a CPU
#: of its own: a peer that arrives within it is met without a wake-up.
#: Measured on a 2-CPU VM, ChainerMN's MNIST example on 2 ranks: 99 % of
#: its waits (the ranks' skew at a batch normalisation's statistics and
#: a gradient sum) ended within 5 ms; a wake-up took only 0.05 ms, yet
#: polling for 0.2 ms, a third of those waits slept and the run was 3 %
#: slower (the sleeper's CPU idles or goes to another task, its caches
#: cool). Open MPI polls without end; a wait longer than this (a peer
#: saving a snapshot) sleeps, so it holds a CPU for 10 ms at most.
SPIN_S = 10e-3


def spin_seconds(ranks_here, cpus):
    """How long a rank polls before it sleeps: :data:`SPIN_S` where the
    ``ranks_here`` of this machine have a CPU each among ``cpus``, else 0
    (a polling rank would hold a CPU that the rank it waits for needs).

    Examples
    --------
    >>> spin_seconds(2, 2), spin_seconds(4, 2), spin_seconds(1, 8)
    (0.01, 0.0, 0.01)
    """
    return SPIN_S if ranks_here <= cpus else 0.0


def spin_until(ready, seconds):
    """Look at ``ready()`` until it returns True (then return True) or
    ``seconds`` have passed (False: the caller sleeps on what it waits
    for). Between two looks the caller's thread yields (``sched_yield``):
    the GIL to the process's other threads (a loader's, the comm's), the
    CPU to whatever else is ready; about 1 us where nothing is.

    Examples
    --------
    >>> spin_until(lambda: True, 0.0), spin_until(lambda: False, 0.001)
    (True, False)
    """
    if ready():
        return True
    clock, pass_on = time.perf_counter, os.sched_yield
    end = clock() + seconds
    while clock() < end:
        pass_on()
        if ready():
            return True
    return False
