"""Point-to-point messages between the ranks of one machine over Unix
domain sockets: blocking calls in the caller's own thread.

A message over a communicator's Dask comms crosses threads twice on each
side (to its event loop and back) and goes through TLS on loopback: each
crossing is a wake-up, which a busy machine serves late. Between ranks
that share a machine, :class:`Nearby` sends it down a Unix domain socket
from the sending thread and the receiving thread reads it there: one
wake-up, no encryption (the kernel carries it, to no one else). Where
the machine's ranks have a CPU each, a receive first polls its socket
(:func:`~dasktrain.parallel.comm.base.spin_until`, for
:func:`~dasktrain.parallel.comm.base.spin_seconds`) and so meets a
message due soon without even that wake-up, as MPI's ranks do.

Only the ranks of the job reach the sockets: each rank listens in a
folder of its own (mode 0700, in ``/dev/shm``, which the ranks that share
memory share), its path and a one-time token of its own handed out over
the communicator's TLS comms; a rank accepts a connection only from a
process of its own user (``SO_PEERCRED``) that names a rank and that
rank's token, and removes the folder once its peers are connected.

A message is its length and its pickle (protocol 5); large arrays travel
beside it through shared memory
(:mod:`~dasktrain.parallel.comm.handover`). Every wait is bounded by the
communicator's timeout; a peer that is gone or silent raises
:class:`~dasktrain.parallel.comm.base.CollectiveError`.
"""
import collections
import io
import os
import pickle
import secrets
import select
import shutil
import socket
import struct
import tempfile
import threading

import numpy as np

from dasktrain.parallel.comm.base import (
    PEER_GONE,
    PEER_SILENT,
    CollectiveError,
    PeerLost,
    spin_seconds,
    spin_until,
)
from dasktrain.parallel.comm.handover import (
    INLINE_BYTES,
    Inbox,
    Outbox,
    Placed,
    take,
    worth_it,
)
from dasktrain.parallel.comm.shm import SHM_DIR
from dasktrain.parallel.comm.transports import peer_uid

#: A frame's header: its kind, then for a message its pickle's length,
#: for a credit the ring's size and how far it was read.
FRAME = struct.Struct('<BQQ')
#: A frame's kinds: a message's pickle; a credit; the ticket of a
#: message's pickle put in shared memory (a large one).
MESSAGE, CREDIT, PICKLE_HANDED = 0, 1, 2
#: A connection's first bytes: the dialling rank and its token for the
#: rank it dials.
HELLO = struct.Struct('<I16s')


def _read_exactly(sock, n, what, source=None):
    """``n`` bytes from ``sock`` (from rank ``source``, where known);
    PeerLost where the peer closed, CollectiveError where it stayed silent
    past the socket's timeout (``no answer from rank(s) [r]``, as over
    the Dask comms)."""
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            who = f'rank(s) [{source}]' if source is not None else what
            raise CollectiveError(
                f'no answer from {who} within {sock.gettimeout():g} s '
                f'(collective_timeout): {PEER_SILENT}') from None
        except OSError as e:
            raise PeerLost(f'{what} was lost ({e}): {PEER_GONE}') from None
        if k == 0:
            raise PeerLost(f'{what}: the peer closed its connection: '
                           f'{PEER_GONE}')
        got += k
    return data


def _readable(sock):
    """Whether ``sock`` has bytes to read (or was closed), now."""
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):  # closed here: the read says so
        return True


class Nearby:
    """Unix domain sockets from this rank to its ``peers`` of the same
    machine; made by :meth:`connect`, every rank of ``comm`` calling it.

    A message is a frame (:data:`FRAME`: its kind and length) and its
    pickle; a host array of at least
    :data:`~dasktrain.parallel.comm.handover.INLINE_BYTES` in it goes
    into shared memory (the peer's
    :class:`~dasktrain.parallel.comm.handover.Outbox` ring, else a segment
    of its own) and only its ticket into the pickle. The receiver takes
    the arrays out as the message arrives and answers with a credit frame
    (how far it read the ring), which the sender reads when it needs room.

    Attributes
    ----------
    peers : frozenset
        The ranks it reaches.
    prefix : str
        The names of its shared-memory segments begin so.
    """

    def __init__(self, rank, socks, timeout, spin=0.0):
        self.rank, self._socks, self.timeout = rank, socks, timeout
        #: Seconds a receive polls its socket before it sleeps in a read.
        self.spin = spin
        self.peers = frozenset(socks)
        self.prefix = f'dasktrain-p2p-{secrets.token_hex(4)}'
        self._out = {p: Outbox(f'{self.prefix}-{p}') for p in socks}
        self._in = {p: Inbox() for p in socks}
        self._pending = {p: collections.deque() for p in socks}
        # a send may read credits (never waiting for the lock); a receive
        # may send a credit: re-entrant for a send that reads a message
        self._sending = {p: threading.RLock() for p in socks}
        self._receiving = {p: threading.Lock() for p in socks}

    @classmethod
    def connect(cls, comm, peers):
        """Connect this rank of ``comm`` (a communicator for the set-up:
        two all-gathers) to ``peers``, the ranks of its machine that share
        its ``/dev/shm``: a collective, every rank of ``comm`` calls it
        with its own peers."""
        peers = sorted(peers)
        folder = tempfile.mkdtemp(prefix='dasktrain-p2p-', dir=SHM_DIR) \
            if peers else None
        listener, token, socks = None, secrets.token_bytes(16), {}
        try:
            if peers:
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                listener.bind(os.path.join(folder, 's'))
                listener.listen(len(peers))
                listener.settimeout(comm.timeout)
            where = comm.allgather(
                (listener.getsockname(), token) if peers else None)
            # Lower ranks dial the higher ones (queued by the listener,
            # so no rank waits for another to accept), then accept theirs.
            for peer in (p for p in peers if p > comm.rank):
                path, theirs = where[peer]
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(comm.timeout)
                sock.connect(path)
                sock.sendall(HELLO.pack(comm.rank, theirs))
                socks[peer] = sock
            for _ in (p for p in peers if p < comm.rank):
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    raise CollectiveError('a rank of this machine did not '
                                          'connect within the collective_'
                                          f'timeout: {PEER_SILENT}') from None
                sock.settimeout(comm.timeout)
                rank, theirs = HELLO.unpack(_read_exactly(
                    sock, HELLO.size, 'a peer\'s hello'))
                if peer_uid(sock) != os.getuid() or theirs != token or \
                        rank not in peers or rank in socks:
                    sock.close()
                    raise CollectiveError(
                        f'rank {comm.rank} was dialled by a process that '
                        'is not a rank of this job')
                socks[rank] = sock
            comm.allgather(None)  # every rank connected: folders can go
        except BaseException:
            for sock in socks.values():
                sock.close()
            raise
        finally:
            if listener is not None:
                listener.close()
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        return cls(comm.rank, socks, comm.timeout,
                   spin_seconds(len(peers) + 1,
                                len(os.sched_getaffinity(0))))

    def send(self, obj, dest):
        """Send ``obj`` to rank ``dest`` (one of :attr:`peers`); returns
        once it is in the socket and shared memory (the kernel holds it
        for the peer)."""
        with self._sending[dest]:
            buffer = io.BytesIO()
            pickler = pickle.Pickler(buffer, protocol=5)
            pickler.persistent_id = lambda o: self._hand_over(o, dest)
            pickler.dump(obj)
            payload = buffer.getbuffer()
            if len(payload) >= INLINE_BYTES:
                # a large pickle (objects, no large arrays) goes through
                # shared memory too: two ranks sending each other large
                # messages before receiving never both wait in a socket
                ticket = self._hand_over(np.frombuffer(payload, np.uint8),
                                         dest)
                if ticket is not None:
                    self._frame(dest, PICKLE_HANDED, pickle.dumps(
                        ticket, protocol=5))
                    return
            self._frame(dest, MESSAGE, payload)

    def _hand_over(self, obj, dest):
        """pickle's ``persistent_id``: a large host array's ticket, once
        the array is in shared memory; None for anything else."""
        if type(obj) is not np.ndarray or not worth_it(obj, True):
            return None
        out = self._out[dest]
        placed = out.place(obj)
        if placed is None:  # read the credits that came, then again
            self._read_credits(dest)
            placed = out.place(obj)
        if placed is None:
            placed = out.stow(obj)
            if placed is obj:  # no shared memory for it: inline
                return None
        return placed

    def _frame(self, dest, kind, payload=b'', a=0, b=0):
        sock = self._socks[dest]
        header = FRAME.pack(kind, a if kind == CREDIT else len(payload), b)
        try:
            if len(payload) < 1 << 16:  # one write, one wake-up
                sock.sendall(header + bytes(payload))
            else:  # not copied again to join them
                sock.sendall(header)
                sock.sendall(payload)
        except TimeoutError:
            raise CollectiveError(f'rank {dest} did not read within the '
                                  f'collective_timeout: {PEER_SILENT}') \
                from None
        except OSError as e:
            raise PeerLost(f'rank {dest} closed its connection ({e}): '
                           f'{PEER_GONE}') from None

    def _read_credits(self, dest):
        """Read what ``dest`` has sent so far without waiting for more:
        its credits, and its messages, kept for :meth:`recv` (skipped
        where a receive is under way on another thread)."""
        if not self._receiving[dest].acquire(blocking=False):
            return
        try:
            sock = self._socks[dest]
            while select.select([sock], [], [], 0)[0]:
                got = self._read_frame(dest)
                if got is not None:
                    self._pending[dest].append(got[0])
        finally:
            self._receiving[dest].release()

    def _read_frame(self, source):
        """The next frame from ``source``: a message, as ``(obj,)``, or
        None for a credit (applied)."""
        sock, what = self._socks[source], f'a message from rank {source}'
        kind, a, b = FRAME.unpack(_read_exactly(sock, FRAME.size, what,
                                                source))
        if kind == CREDIT:
            self._out[source].credit(a, b)
            return None
        inbox = self._in[source]

        def hand(placed):
            return inbox.take(placed) if isinstance(placed, Placed) else \
                take(placed)
        read = inbox.read
        data = _read_exactly(sock, a, what, source)
        if kind == PICKLE_HANDED:  # the pickle itself in shared memory
            data = hand(pickle.loads(data))
        unpickler = pickle.Unpickler(io.BytesIO(data))
        unpickler.persistent_load = hand
        obj = unpickler.load()
        if inbox.read != read:  # the ring was read further: say so
            with self._sending[source]:
                self._frame(source, CREDIT, a=inbox.ring, b=inbox.read)
        return (obj,)

    def recv(self, source):
        """The next object rank ``source`` sent here."""
        with self._receiving[source]:
            if self._pending[source]:
                return self._pending[source].popleft()
            sock = self._socks[source]
            while True:
                if self.spin:  # a message due soon is met awake
                    spin_until(lambda: _readable(sock), self.spin)
                got = self._read_frame(source)
                if got is not None:
                    return got[0]

    def gone(self, peer):
        """Whether rank ``peer`` closed its connection (it exited): its
        socket reads as ended. Reads nothing: what it sent stays."""
        sock = self._socks[peer]
        if not _readable(sock):
            return False
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b''
        except BlockingIOError:
            return False
        except (OSError, ValueError):  # reset, or closed here
            return True

    def close(self):
        for sock in self._socks.values():
            sock.close()
        for box in (*self._out.values(), *self._in.values()):
            box.close()


class Routes:
    """Point-to-point messages to every rank of a communicator: those of
    this machine over :class:`Nearby`'s sockets, the others over
    ``far`` (a communicator's ``send``/``recv``; None where every rank is
    near)."""

    def __init__(self, near, far=None):
        self.near, self.far = near, far

    def send(self, obj, dest):
        if dest in self.near.peers:
            self.near.send(obj, dest)
        else:
            self._far('send to', dest).send(obj, dest)

    def recv(self, source):
        if source in self.near.peers:
            return self.near.recv(source)
        return self._far('receive from', source).recv(source)

    def _far(self, what, rank):
        if self.far is None:
            raise CollectiveError(f'cannot {what} rank {rank}: not a rank '
                                  'of this communicator')
        return self.far

    def close(self):
        self.near.close()
        if self.far is not None:
            self.far.close()


class NearGroup:
    """The ranks of one machine as a communicator of small messages
    (``allgather``, ``bcast``, ``barrier``) over :class:`Nearby`'s sockets
    of their own, in the caller's thread: the barriers of a shared-memory
    sum without the event loop's wake-ups.

    Parameters
    ----------
    near : Nearby
        Connected to every other rank of the group (group numbering).
    rank, size : int
        This rank's place in the group, and its size.
    """

    def __init__(self, near, rank, size):
        self.near, self.rank, self.size = near, rank, size
        self.timeout = near.timeout

    def allgather(self, obj):
        others = [r for r in range(self.size) if r != self.rank]
        for peer in others:  # small: the sockets hold them all
            self.near.send(obj, peer)
        got = {peer: self.near.recv(peer) for peer in others}
        got[self.rank] = obj
        return [got[r] for r in range(self.size)]

    def bcast(self, obj):
        return self.allgather(obj if self.rank == 0 else None)[0]

    def barrier(self):
        self.allgather(None)

    def close(self):
        self.near.close()


class NearCollectives:
    """Every rank of a communicator, all on this machine, as collectives
    of objects over :class:`Nearby`'s sockets of their own, in the
    caller's thread: ``exchange``, ``allgather``, ``gather``, ``bcast``
    and ``barrier`` as :class:`~dasktrain.parallel.comm.dask.DaskComm`
    has them (root 0), without its event loop's wake-ups. Each message
    carries its collective's kind and count: ranks out of step fail
    with one line, as over the Dask comms."""

    def __init__(self, near, rank, size):
        self.near, self.rank, self.size = near, rank, size
        self._calls = 0

    def exchange(self, send=None, receive=(), kind='exchange'):
        """Send ``send[peer]`` to each peer named there, then read one
        object from each rank in ``receive``: {rank: object}."""
        self._calls += 1
        tag = (kind, self._calls)
        for peer, obj in (send or {}).items():
            self.near.send((tag, obj), peer)
        got = {}
        for peer in receive:
            theirs, obj = self.near.recv(peer)
            if theirs != tag:
                raise CollectiveError(
                    f'rank {peer} is out of step: it is in {_words(theirs)}'
                    f' while rank {self.rank} is in {_words(tag)}')
            got[peer] = obj
        return got

    def _others(self):
        return [r for r in range(self.size) if r != self.rank]

    def allgather(self, obj):
        got = self.exchange(dict.fromkeys(self._others(), obj),
                            self._others(), 'allgather')
        got[self.rank] = obj
        return [got[r] for r in range(self.size)]

    def gather(self, obj):
        if self.rank != 0:
            self.exchange({0: obj}, (), 'gather')
            return None
        got = self.exchange({}, self._others(), 'gather')
        got[0] = obj
        return [got[r] for r in range(self.size)]

    def bcast(self, obj):
        if self.rank == 0:
            self.exchange(dict.fromkeys(self._others(), obj), (), 'bcast')
            return obj
        return self.exchange({}, [0], 'bcast')[0]

    def barrier(self):
        self.allgather(None)

    def close(self):
        self.near.close()


def _words(tag):
    """A collective's tag in words: ``('bcast', 3)`` -> 'a bcast'."""
    kind = tag[0] if isinstance(tag, tuple) and tag else str(tag)
    return f'{"an" if kind[:1] in "aeiou" else "a"} {kind}'
