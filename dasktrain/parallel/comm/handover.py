"""Arrays handed from one rank to another of the same machine through
shared memory: a message's large host arrays are written into shared
memory and only where they lie travels, over the connection the message
takes anyway (:mod:`~dasktrain.parallel.comm.nearby`'s sockets), so the
bytes are copied once on each side and never pickled or sent through
the kernel's socket buffers.

* :class:`Outbox` (the sender's, one per receiving rank) keeps a *ring*: a
  segment of its own in ``/dev/shm`` (mode 0600, created exclusively
  under a random name: no other user can read it, nor put one there
  under its name), reused message after message. :meth:`Outbox.place`
  writes an array at the ring's next free place and returns a
  :class:`Placed` ticket (the ring's name the first time, the place,
  shape and dtype) to send in the array's place;
* :class:`Inbox` (the receiver's, one per sending rank) maps a ring at its
  first ticket, removing its name at once (the mapping stays), and reads
  each array out as its message arrives: in the order they were sent, so
  the space frees in order. It tells the sender how far it has read (a
  *credit*, over the same connection: what the receiver read before it
  sent the credit, the sender sees done when it reads it); the sender
  reuses space only up to its last credit.
* Where a ring has no room (the receiver has not read far enough, or the
  array is larger than a ring), the array goes into a segment of its own
  (:meth:`Outbox.stow`, a :class:`Ticket`), which :func:`take` reads and
  removes: freed when read.

Segments a receiver never took or mapped (a rank that died with messages
unread) are removed by their sender when it closes (at a rank's exit).
Arrays under :data:`INLINE_BYTES` travel inline in the message.
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
#: A ring's bytes at first; it grows to hold 4 of the largest array sent.
RING_BYTES = 1 << 22
#: The largest ring (bytes); larger arrays go into segments of their own.
RING_MAX = 1 << 28
ALIGN = 64  # bytes: every array in a ring starts on a cache line


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


@dataclass(frozen=True)
class Placed:
    """What travels in place of an array put in a ring: the ring's name
    where this is its first message (else None), its size (which names
    it), the array's offset, shape and dtype, and where the ring's
    writing stood after it (the credit that reading it earns)."""
    name: str
    ring: int
    offset: int
    shape: tuple
    dtype: str
    end: int

    @property
    def nbytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * \
            np.dtype(self.dtype).itemsize


def room(written, read, size, nbytes):
    """Where an array of ``nbytes`` goes in a ring of ``size`` bytes whose
    writer has written ``written`` bytes in all and whose reader has read
    ``read``: ``(offset, new written)``, skipping to the ring's start
    where the array would wrap; None where the unread part leaves no room.

    Examples
    --------
    >>> room(0, 0, 256, 100)        # the start
    (0, 128)
    >>> room(192, 128, 256, 100)    # no room at the end: wrap to 0
    (0, 384)
    >>> room(192, 64, 256, 100) is None  # the start is still unread
    True
    """
    need = -(-nbytes // ALIGN) * ALIGN
    if need > size:
        return None
    at = written % size
    skip = size - at if at + need > size else 0
    if written + skip + need - read > size:
        return None
    return (at + skip) % size, written + skip + need


def _segment(path, nbytes):
    """A new segment of ``nbytes`` at ``path`` (0600, created exclusively),
    mapped; None where it cannot be made."""
    import mmap
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        # its pages taken now: a /dev/shm too small says so here (ENOSPC),
        # not with a SIGBUS at a later write into the mapping
        os.posix_fallocate(fd, 0, nbytes)
        return mmap.mmap(fd, nbytes)
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)


class Outbox:
    """The ring and segments one rank writes for one other (see the
    module).

    Parameters
    ----------
    prefix : str, optional
        Names its segments, for finding them; default ``dasktrain-p2p-``
        and a random part of its own.
    """

    def __init__(self, prefix=None):
        self.prefix = prefix or f'dasktrain-p2p-{secrets.token_hex(4)}'
        self.usable = available()
        self._made = collections.deque()  # names, oldest first
        self._ring = None  # (name, mmap, bytes view, size, announced)
        self._written = self._read = 0

    def credit(self, ring, read):
        """The receiver has read the ring of ``ring`` bytes up to ``read``
        (bytes written in all, as the tickets' ``end``); a credit of an
        older ring says nothing of this one."""
        if self._ring is not None and ring == self._ring[3]:
            self._read = max(self._read, read)

    def place(self, array):
        """``array`` written into the ring: a :class:`Placed` ticket, or
        None where the ring has no room for it now."""
        if not self.usable:
            return None
        data = np.ascontiguousarray(array)
        if self._ring is None or data.nbytes * 4 > self._ring[3]:
            if not self._grow(data.nbytes):
                return None
        name, _, view, size, announced = self._ring
        spot = room(self._written, self._read, size, data.nbytes)
        if spot is None:
            return None
        offset, self._written = spot
        view[offset:offset + data.nbytes] = \
            data.reshape(-1).view(np.uint8)
        self._ring = (name, self._ring[1], view, size, True)
        return Placed(None if announced else name, size, offset,
                      tuple(data.shape), data.dtype.str, self._written)

    def _grow(self, nbytes):
        """A new ring for arrays of ``nbytes`` (the receiver reads the old
        one to its end first: messages arrive in order)."""
        size = max(RING_BYTES, 4 * -(-nbytes // ALIGN) * ALIGN)
        if size > RING_MAX:
            return False
        name = f'{self.prefix}-ring-{secrets.token_hex(12)}'
        mapped = _segment(os.path.join(SHM_DIR, name), size)
        if mapped is None:
            return False
        self._made.append(name)  # removed by the receiver, else at close
        self._drop_ring()  # the receiver's mapping keeps the old one
        self._ring = (name, mapped, np.frombuffer(mapped, np.uint8), size,
                      False)
        self._written = self._read = 0
        return True

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

    def _drop_ring(self):
        if self._ring is not None:
            mapped = self._ring[1]
            self._ring = None  # its view with it
            try:
                mapped.close()
            except BufferError:  # a view still held: freed with it
                pass

    def close(self):
        """Unmap the ring; remove the segments this rank made that nobody
        took or mapped."""
        self._drop_ring()
        while self._made:
            try:
                os.unlink(os.path.join(SHM_DIR, self._made.popleft()))
            except FileNotFoundError:
                pass


def take(ticket):
    """The array a :class:`Ticket` names, read out of its segment, which
    is then removed (freed when read)."""
    _check_name(ticket.name)
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


def _check_name(name):
    if '/' in name or name.startswith('.'):
        raise CollectiveError(f'a peer sent a segment name that is not '
                              f'one: {name!r}')


class Inbox:
    """The rings one rank reads from one other (see the module): arrays
    out of them as their messages arrive, in order."""

    def __init__(self):
        self._rings = {}  # ring size -> (mmap, bytes view)
        self.ring = 0  # the ring read last (its size, which names it)
        self.read = 0  # where its reading stands: the next credit

    def take(self, placed):
        """The array a :class:`Placed` ticket names, copied out of its
        ring; :attr:`read` then says how far the ring is read."""
        if placed.name is not None:  # a new ring: the old one is read
            self._open(placed.name, placed.ring)
        found = self._rings.get(placed.ring)
        if found is None or placed.offset < 0 or \
                placed.offset + placed.nbytes > placed.ring:
            raise CollectiveError('a peer named a place in shared memory '
                                  'that is not one of its rings')
        view = found[1][placed.offset:placed.offset + placed.nbytes]
        array = view.view(np.dtype(placed.dtype)).reshape(placed.shape) \
            .copy()
        self.ring, self.read = placed.ring, placed.end
        return array

    def _open(self, name, size):
        import mmap
        _check_name(name)
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise CollectiveError(f'the shared-memory ring of a message is '
                                  f'gone ({e}): its sender closed first') \
                from None
        try:
            os.unlink(path)  # the mapping stays; the name goes
            facts = os.fstat(fd)
            if facts.st_uid != os.getuid() or facts.st_size != size:
                raise CollectiveError(
                    f'the shared-memory ring {name} is not this user\'s '
                    f'or not its size ({facts.st_size} bytes for {size})')
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.close()  # one ring at a time: the old one is read to its end
        self._rings[size] = (mapped, np.frombuffer(mapped, np.uint8))
        self.read = 0

    def close(self):
        mapped = [m for m, _ in self._rings.values()]
        self._rings.clear()  # the views with them
        for m in mapped:
            try:
                m.close()
            except BufferError:  # an array still views it: freed with it
                pass
