"""Barriers and small all-reduces among the ranks of one machine through
shared memory: no message, no pickle, a wake-up only where a rank sleeps.

A barrier over sockets costs each rank a pickled message to every peer
and a system call to read each of theirs: about 0.1 ms between two ranks
that both wait, 0.3 ms where the caller's caches went cold in between (a
training step's batch normalisation statistics, twice a step), where
Open MPI's ranks meet in 0.01 ms by polling shared memory. Here each
rank of a machine has a slot of one shared segment (:class:`Board`): a
sequence word alone on its cache line, then two halves, each a header
(a fingerprint and a count) and up to :data:`PAYLOAD_BYTES` of payload.

Operation k (every rank counts its operations alike), half p = k mod 2:

1. write this operation's header and payload into half p of my slot;
2. store k in my sequence word, then ``FUTEX_WAKE`` on it;
3. for each peer, wait until its word reaches k: poll it for up to
   :func:`~dasktrain.parallel.comm.base.spin_seconds` (ranks that have a
   CPU each: :func:`~dasktrain.parallel.comm.base.spin_until`), then sleep in
   ``FUTEX_WAIT`` on it (which returns at once where the word moved
   meanwhile: no wake-up is missed), in turns of :data:`CHECK_S`, in each
   asking whether the peer's socket was closed (it exited: PeerLost) and
   whether the collective's timeout passed (CollectiveError);
4. read each peer's half p.

Two halves suffice: a rank writes operation k + 2 into half p only once
it has finished k + 1, which needs every peer to have published k + 1,
hence to have finished reading k. Step 1's bytes must be visible before
step 2's word, and step 4 must read them after it: x86's stores and loads
keep program order (TSO); elsewhere (ARM, POWER) they need fences that
Python cannot issue, so the board is used on x86 only
(:func:`supported`) and other machines meet over the sockets.

The segment is a file in ``/dev/shm`` (mode 0600, its name random),
unlinked once every rank of the machine has mapped it: nothing is left
behind, even by SIGKILL. Owns the board; the sums that use it are
:mod:`~dasktrain.parallel.comm.shm`'s.
"""
import ctypes
import mmap
import os
import platform
import secrets
import time

import numpy as np

from dasktrain.parallel.comm.base import (
    PEER_GONE,
    PEER_SILENT,
    CollectiveError,
    PeerLost,
    spin_seconds,
    spin_until,
)
from dasktrain.parallel.comm.shm import POPULATE, SHM_DIR, SMALL_BYTES

#: Payload bytes a half holds: the largest sum that travels as copies.
PAYLOAD_BYTES = SMALL_BYTES
#: Bytes before a slot's halves: its sequence word, on a line of its own.
HEADER = 64
#: A half: fingerprint and count (uint32 each), its payload at +HEADER.
HALF = HEADER + PAYLOAD_BYTES
#: A rank's slot, a whole number of pages (no two ranks share a page).
SLOT = -(-(HEADER + 2 * HALF) // mmap.PAGESIZE) * mmap.PAGESIZE
#: Seconds of each sleep between the checks for a peer that exited.
CHECK_S = 0.2
#: The futex system call's number, by machine (those with TSO only).
SYS_FUTEX = {'x86_64': 202, 'amd64': 202}
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # shared between processes: not PRIVATE
_WORD = 1 << 32
_AHEAD = 1 << 31  # a word (k + d) mod 2**32, d < 2**31, has reached k


def _machine(machine=None):
    return (platform.machine() if machine is None else machine).lower()


def supported(machine=None):
    """Whether ranks on this machine (``platform.machine()`` unless given)
    can meet on a board: Linux on x86, whose stores are seen in the order
    they were made; elsewhere False (the sockets).

    Examples
    --------
    >>> supported('x86_64'), supported('aarch64'), supported('ppc64le')
    (True, False, False)
    """
    return _machine(machine) in SYS_FUTEX and os.path.isdir(SHM_DIR)


def reached(word, k):
    """Whether a peer whose sequence word reads ``word`` has published
    operation ``k`` (it may be one ahead), counting modulo 2**32.

    Examples
    --------
    >>> reached(5, 5), reached(6, 5), reached(4, 5)
    (True, True, False)
    >>> reached(0, 2**32 - 1), reached(2**32 - 1, 0)
    (True, False)
    """
    return (word - k) % _WORD < _AHEAD


class _Futex:
    """``FUTEX_WAIT`` and ``FUTEX_WAKE`` on a word of shared memory, by
    the C library's ``syscall`` (ctypes releases the GIL meanwhile)."""

    class _Timespec(ctypes.Structure):
        _fields_ = [('tv_sec', ctypes.c_long), ('tv_nsec', ctypes.c_long)]

    def __init__(self):
        self.number = ctypes.c_long(SYS_FUTEX[_machine()])
        self._call = ctypes.CDLL(None, use_errno=True).syscall
        self._call.restype = ctypes.c_long

    def wait(self, address, seen, seconds):
        """Sleep while the word at ``address`` is ``seen``, at most
        ``seconds`` (returns at once where it is not)."""
        whole = int(seconds)
        timeout = self._Timespec(whole, int((seconds - whole) * 1e9))
        self._call(self.number, ctypes.c_void_p(address),
                   ctypes.c_int(FUTEX_WAIT), ctypes.c_uint(seen),
                   ctypes.byref(timeout), ctypes.c_void_p(0),
                   ctypes.c_int(0))

    def wake(self, address):
        """Wake every process sleeping on the word at ``address``."""
        self._call(self.number, ctypes.c_void_p(address),
                   ctypes.c_int(FUTEX_WAKE), ctypes.c_int(0x7FFFFFFF),
                   ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_int(0))


def _map(path, nbytes, create):
    """The shared file at ``path`` (made, mode 0600, with ``create``)
    mapped here, or None where it cannot be."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create
                                        else 0), 0o600)
    except OSError:
        return None
    try:
        if create:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | POPULATE)
    except OSError:
        if create:
            os.unlink(path)
        return None
    finally:
        os.close(fd)


class Board:
    """The ranks of one machine meeting in shared memory; made by
    :meth:`connect`, every rank of the machine calling it.

    Parameters
    ----------
    segment : mmap.mmap
        The board, :data:`SLOT` bytes per rank, mapped here.
    rank, size : int
        This rank's place among the machine's ranks, and their number.
    timeout : float
        Seconds a rank waits for a peer (the collective timeout).
    gone : callable or None
        ``gone(peer)``: whether that peer's connection closed (it exited).
    spin : float
        Seconds a rank polls a peer's word before it sleeps.
    """

    def __init__(self, segment, rank, size, timeout, gone=None, spin=0.0):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.spin, self._gone = spin, gone
        self._map = segment
        self._bytes = np.frombuffer(segment, np.uint8)
        self._words = self._bytes.view(np.uint32)
        self._anchor = ctypes.c_char.from_buffer(segment)
        self._base = ctypes.addressof(self._anchor)
        self._futex = _Futex()
        self._k = 0

    @classmethod
    def connect(cls, comm, gone=None):
        """A board for ``comm``'s ranks (all of one machine: a collective,
        every rank calls it), or None where a rank could not map it; rank
        0 makes it, every rank maps it, rank 0 unlinks its name."""
        path, segment, nbytes = None, None, SLOT * comm.size
        if comm.rank == 0:  # made before its name is given out
            path = os.path.join(SHM_DIR,
                                f'dasktrain-board-{secrets.token_hex(8)}')
            segment = _map(path, nbytes, create=True)
        try:
            path = comm.bcast(path if segment is not None else None)
            if comm.rank != 0 and path is not None:
                segment = _map(path, nbytes, create=False)
            mapped = comm.allgather(segment is not None)
        finally:  # the name goes, whatever happened; the mappings stay
            if comm.rank == 0 and segment is not None:
                os.unlink(path)
        if not all(mapped):
            if segment is not None:
                segment.close()
            return None
        cpus = len(os.sched_getaffinity(0))
        return cls(segment, comm.rank, comm.size, comm.timeout, gone,
                   spin_seconds(comm.size, cpus))

    def _half(self, rank, k):
        return rank * SLOT + HEADER + (k & 1) * HALF

    def exchange(self, fingerprint=0, count=0, write=None):
        """One operation: this rank's ``fingerprint`` and ``count``
        (uint32 each) and, where ``write`` is given, its payload
        (``write(buffer)`` fills the first bytes of a uint8 array of
        :data:`PAYLOAD_BYTES`) to every rank; returns every rank's
        ``(fingerprint, count, payload)`` in rank order, once all have
        published. A peer's payload stays as it is until this rank's
        next operation."""
        self._k = k = (self._k + 1) % _WORD
        mine = self._half(self.rank, k)
        self._words[mine // 4:mine // 4 + 2] = (fingerprint, count)
        if write is not None:
            write(self._bytes[mine + HEADER:mine + HALF])
        word = self.rank * SLOT // 4
        self._words[word] = k  # after the half: x86 keeps the order
        self._futex.wake(self._base + self.rank * SLOT)
        got = []
        for peer in range(self.size):
            if peer != self.rank:
                self._wait(peer, k)
            at = self._half(peer, k)
            got.append((int(self._words[at // 4]),
                        int(self._words[at // 4 + 1]),
                        self._bytes[at + HEADER:at + HALF]))
        return got

    def _wait(self, peer, k):
        """Return once ``peer`` has published operation ``k``."""
        words, word = self._words, peer * SLOT // 4
        if reached(int(words[word]), k):
            return
        if spin_until(lambda: reached(int(words[word]), k), self.spin):
            return
        deadline = time.monotonic() + self.timeout
        address = self._base + peer * SLOT
        while True:
            seen = int(words[word])
            if reached(seen, k):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveError(
                    f'no answer from rank(s) [{peer}] within '
                    f'{self.timeout:g} s (collective_timeout): '
                    f'{PEER_SILENT}')
            self._futex.wait(address, seen, min(left, CHECK_S))
            if not reached(int(words[word]), k) and \
                    self._gone is not None and self._gone(peer):
                raise PeerLost(f'rank {peer} of this machine closed its '
                               f'connection: {PEER_GONE}')

    def close(self):
        del self._anchor, self._words, self._bytes  # views of the map
        try:
            self._map.close()
        except BufferError:  # a caller still holds a payload: GC frees it
            pass
