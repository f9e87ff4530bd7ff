"""Arrays handed from one rank to another of the same machine through
shared memory: a point-to-point message's large host arrays are written
into segments of their own and only the segments' names travel, over
the connection the message takes anyway, so the bytes are copied once
on each side and never serialised, encrypted or sent through loopback.

* :meth:`Handover.stow` writes an array into a new file in ``/dev/shm``
  (mode 0600, created exclusively under a random name: no other user can
  read it, nor put one there under its name) and returns a
  :class:`Ticket` (name, shape, dtype) to send in the array's place;
* :func:`take`, on the receiving rank, reads the array out of the
  segment named by a ticket and removes the segment: it is freed when
  read. It refuses a segment that is not its own user's or not the
  ticket's size.

A segment whose receiver never takes it (a rank that died with messages
unread) is removed by its sender when its communicator closes
(:meth:`Handover.close`, at a rank's exit). Arrays under
:data:`INLINE_BYTES` travel inline: a segment costs more than their
bytes. Where a segment cannot be made (``/dev/shm`` full or missing),
the array travels inline too.

Which ranks share a machine (and one ``/dev/shm``) is the
communicator's: the ranks its shared-memory probe joined
(:attr:`~dasktrain.parallel.comm.dask.DaskComm.hosts`).
"""
import collections
import os
import secrets
from dataclasses import dataclass

import numpy as np

from dasktrain.parallel.comm.base import CollectiveError
from dasktrain.parallel.comm.shm import SHM_DIR, available

#: Bytes from which an array goes through shared memory: smaller ones
#: travel inline, where a segment (create, write, open, read, unlink)
#: costs more than sending their bytes.
INLINE_BYTES = 1 << 16
#: Names a sender keeps of segments it made, to remove those still
#: unread when it closes; past it, the ones already taken are forgotten.
KEEP = 256


@dataclass(frozen=True)
class Ticket:
    """What travels in a stowed array's place: its segment's name (in
    ``/dev/shm``), shape and dtype."""
    name: str
    shape: tuple
    dtype: str

    @property
    def nbytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * \
            np.dtype(self.dtype).itemsize


def worth_it(array, shared):
    """Whether ``array`` goes through shared memory: a host array of at
    least :data:`INLINE_BYTES` to a rank that shares this machine's
    ``/dev/shm`` (``shared``).

    Examples
    --------
    >>> worth_it(np.zeros(1 << 14), True), worth_it(np.zeros(8), True)
    (True, False)
    >>> worth_it(np.zeros(1 << 14), False)
    False
    """
    return bool(shared) and isinstance(array, np.ndarray) and \
        array.nbytes >= INLINE_BYTES


class Handover:
    """The segments one rank stows for others (see the module).

    Parameters
    ----------
    prefix : str, optional
        Names the segments, for finding them; default
        ``dasktrain-p2p-`` and a random part of this Handover's own.
    """

    def __init__(self, prefix=None):
        self.prefix = prefix or f'dasktrain-p2p-{secrets.token_hex(4)}'
        self.usable = available()
        self._made = collections.deque()  # names, oldest first

    def stow(self, array):
        """``array`` (a host array) written into a new segment: its
        :class:`Ticket`, or the array itself where no segment can be
        made."""
        if not self.usable:
            return array
        name = f'{self.prefix}-{secrets.token_hex(12)}'
        path = os.path.join(SHM_DIR, name)
        data = np.ascontiguousarray(array)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return array
        try:
            view, written = memoryview(data.reshape(-1).view(np.uint8)), 0
            while written < len(view):
                written += os.write(fd, view[written:])
        except OSError:  # /dev/shm full: inline, nothing left behind
            os.close(fd)
            os.unlink(path)
            return array
        os.close(fd)
        self._made.append(name)
        if len(self._made) > KEEP:
            self._forget_taken()
        return Ticket(name, tuple(data.shape), data.dtype.str)

    def _forget_taken(self):
        self._made = collections.deque(
            n for n in self._made
            if os.path.exists(os.path.join(SHM_DIR, n)))

    def close(self):
        """Remove the segments this rank stowed that nobody took."""
        while self._made:
            try:
                os.unlink(os.path.join(SHM_DIR, self._made.popleft()))
            except FileNotFoundError:
                pass


def take(ticket):
    """The array a :class:`Ticket` names, read out of its segment, which
    is then removed (freed when read)."""
    if '/' in ticket.name or ticket.name.startswith('.'):
        raise CollectiveError(f'a peer sent a segment name that is not '
                              f'one: {ticket.name!r}')
    path = os.path.join(SHM_DIR, ticket.name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise CollectiveError(f'the shared-memory segment of a message is '
                              f'gone ({e}): its sender closed first') \
            from None
    try:
        os.unlink(path)
        facts = os.fstat(fd)
        if facts.st_uid != os.getuid() or facts.st_size != ticket.nbytes:
            raise CollectiveError(
                f'the shared-memory segment {ticket.name} is not this '
                f"user's or not the message's size ({facts.st_size} bytes "
                f'for {ticket.nbytes})')
        array = np.empty(ticket.shape, np.dtype(ticket.dtype))
        view, read = memoryview(array.reshape(-1).view(np.uint8)), 0
        while read < len(view):
            got = os.readv(fd, [view[read:]])
            if got == 0:
                raise CollectiveError(f'the shared-memory segment '
                                      f'{ticket.name} ended early')
            read += got
        return array
    finally:
        os.close(fd)
