"""The bulk path between hosts: all-reduce of flat buffers over sockets of
their own, outside Dask's event loop.

Dask's comms carry every small message of a job (the rendezvous,
barriers, objects); arrays that cross the network go over *links*: for
every pair of ranks, ``streams`` TCP connections each way, each driven by a
thread of its own with blocking calls (which release the GIL: several
streams encrypt and copy on several cores at once), sending straight from
the flat buffers and receiving straight into them.

:meth:`Links.allreduce` sums a flat buffer over a group of ranks with a
reduce-scatter then an all-gather, both over the full mesh: rank ``r``
owns the r-th slice (``np.array_split``'s), receives every peer's copy of
it, adds them in rank order (the same bits on every rank; for two ranks
those of one process adding the two) and sends the sum back. Each rank
sends and receives ``2 (N - 1) / N`` of the buffer, as a ring does, with
no ring's N - 1 hops of latency. Slices travel in records of
:data:`~dasktrain.parallel.comm.streams.RECORD` bytes (1 MiB), spread
over the streams (:mod:`~dasktrain.parallel.comm.streams`), and stream:
a record of the sum leaves as soon as every peer's copy of it has
arrived, while the later ones are still on the wire.

Links are **sealed** (the default where the job's Dask comms use TLS):
every record is encrypted and authenticated with AES-GCM under a key of
its own connection, drawn at random by the receiving rank and handed to
the sender over the job's TLS comms; the nonce is the record's number on
that connection, so a record cannot be replayed, reordered, dropped or
forged without the next one failing. This is TLS's record layer with
records of 1 MiB instead of 16 KiB, and no handshake of its
own: Python's ``ssl`` returns one 16 KiB record per call, which cost
about as much again as the encryption itself (measured: docs/benchmarks.md).
**Plain** links (``DASKTRAIN_LINKS=tcp`` on every rank, or a cluster
without TLS) send the arrays as they are, for a network that is trusted.
Either way a connection is accepted only with the one-time token of its
slot, handed out over the comms as the keys are.

Every wait is bounded by the collective timeout; any failure closes every
link, so peers fail at once instead of waiting for it.
"""
import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading
import time

import numpy as np

from dasktrain.parallel.comm import streams as one_way
from dasktrain.parallel.comm.base import (
    PEER_DOWN,
    PEER_SILENT,
    CollectiveError,
)
from dasktrain.parallel.comm.streams import KEY, LinkLost, Stream

#: Streams each way between two ranks, unless told.
STREAMS = 2
TOKEN = 16
#: A connection's first bytes: the sender's rank, the stream, the token.
HELLO = struct.Struct('<II16s')
#: Every call's first record on every stream: the call's number, its
#: bytes and arrays, and a digest of its dtypes and sizes.
HEADER = struct.Struct('<QQI8s')
ENV = 'DASKTRAIN_LINKS'  # 'tcp': plain links, for a trusted network


def bounds(count, size):
    """[lo, hi) of each rank's slice of ``count`` elements, as
    ``np.array_split`` cuts them.

    Examples
    --------
    >>> bounds(7, 3)
    [(0, 3), (3, 5), (5, 7)]
    """
    edges = [0]
    base, extra = divmod(count, size)
    for r in range(size):
        edges.append(edges[-1] + base + (1 if r < extra else 0))
    return list(zip(edges[:-1], edges[1:]))


def records(lo, hi, itemsize, record=None):
    """The records of elements [lo, hi): (start, stop) pairs of at most
    ``record`` bytes each (default :data:`~dasktrain.parallel.comm.
    streams.RECORD`; at least one element).

    Examples
    --------
    >>> records(0, 10, 4, record=16)
    [(0, 4), (4, 8), (8, 10)]
    """
    step = max(1, (record or one_way.RECORD) // itemsize)
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


def traffic(nbytes, size):
    """Bytes each rank sends (and receives) to all-reduce a buffer of
    ``nbytes`` among ``size`` ranks: ``2 (size - 1) / size`` of it,
    the least any all-reduce moves.

    Examples
    --------
    >>> traffic(1200, 4)
    1800.0
    """
    return 2 * (size - 1) / size * nbytes


def digest(signature):
    """Eight bytes naming what a call sums (its dtypes and sizes)."""
    return hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()


def plain_asked(environ=None):
    """Whether this rank asks for plain links (``DASKTRAIN_LINKS=tcp``)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV, '').strip().lower()
    if value not in ('', 'tcp', 'sealed'):
        raise CollectiveError(f"{ENV} is 'tcp' or 'sealed', got {value!r}")
    return value == 'tcp'


class _Call:
    """The bookkeeping of one all-reduce: which records arrived, which
    are summed, how many jobs are left, the first error."""

    def __init__(self, jobs):
        self.cond = threading.Condition()
        self.arrived, self.summed = {}, set()
        self.left, self.error = jobs, None
        self.heads = 0  # headers sent
        self.heard = 0  # headers read (matching or not)

    def head(self):
        self.heads += 1

    def hear(self, error=None):
        """A peer's header was read; ``error``: it said the ranks are out
        of step (the call's error from now on)."""
        if error is not None:
            self.error = _first(self.error, error)
        self.heard += 1

    def arrive(self, key):
        self.arrived[key] = self.arrived.get(key, 0) + 1

    def done(self):
        self.left -= 1

    def wait(self, ready, deadline, what):
        with self.cond:
            while not ready():
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveError(
                        f'{what} did not arrive within the collective_'
                        f'timeout: {PEER_SILENT}')
                self.cond.wait(min(left, 1.0))

    def mark(self, update):
        with self.cond:
            update()
            self.cond.notify_all()


class Links:
    """The links of this rank to its ``peers`` (ranks of the same job on
    other hosts), made by :func:`connect`: ``outgoing[peer]`` and
    ``incoming[peer]``, ``streams`` each.

    Parameters
    ----------
    rank : int
    outgoing, incoming : dict
        Peer rank -> list of connected sockets.
    keys : dict or None
        ``{'out': {peer: [key]}, 'in': {peer: [key]}}``: sealed links;
        None: plain.
    timeout : float
        Seconds any record may keep its receiver waiting.
    """

    def __init__(self, rank, outgoing, incoming, keys, timeout):
        self.rank, self.timeout = rank, timeout
        self.sealed = keys is not None
        self._error = None
        self._lock = threading.Lock()
        self._calls = 0
        self._scratch = {}  # (dtype, count) -> per-peer receive buffers
        self._out, self._in = {}, {}
        for peer, socks in outgoing.items():
            self._out[peer] = [
                Stream(s, keys and keys['out'][peer][i],
                        f'dasktrain-link-{rank}>{peer}.{i}', self._failed_send)
                for i, s in enumerate(socks)]
        for peer, socks in incoming.items():
            self._in[peer] = [
                Stream(s, keys and keys['in'][peer][i],
                        f'dasktrain-link-{peer}>{rank}.{i}', self._fail)
                for i, s in enumerate(socks)]
        for stream in self._streams():
            stream.sock.settimeout(timeout)
        self._call = None

    @property
    def peers(self):
        return sorted(self._out)

    @property
    def streams(self):
        return len(next(iter(self._out.values()), []))

    def sent(self):
        """Payload bytes sent so far over every link."""
        return sum(s.bytes for streams in self._out.values()
                   for s in streams)

    def _streams(self):
        for streams in list(self._out.values()) + list(self._in.values()):
            yield from streams

    def _failed_send(self, error):
        """An outgoing stream's job failed. A peer that found the ranks out
        of step closes its links once it has sent its headers, which can
        break this rank's sending before its receivers have read them:
        they read them first (2 s at most), so that this rank too says
        what is out of step rather than that a link was lost."""
        call = self._call
        if call is not None:
            with contextlib.suppress(CollectiveError):
                call.wait(lambda: call.heard == len(self._in) * self.streams,
                          time.monotonic() + 2.0, 'the headers')
        self._fail(error)

    def _fail(self, error):
        """A stream's job failed: the call raises it, every link closes
        (peers waiting on this rank fail at once). Ranks out of step is
        the error told, before any lost link it caused."""
        if isinstance(error, TimeoutError):
            error = CollectiveError('a link waited past the collective_'
                                    f'timeout: {PEER_SILENT}')
        elif isinstance(error, OSError) and not isinstance(
                error, CollectiveError):
            error = LinkLost(f'a link failed ({error}): {PEER_DOWN}')
        with self._lock:
            self._error = _first(self._error, error)
        call = self._call
        if call is not None:
            call.mark(lambda: setattr(call, 'error',
                                      _first(call.error, error)))
        self.close()

    def close(self):
        """Close every link at once; threads end, peers fail fast."""
        for stream in self._streams():
            stream.close()

    def _buffers(self, n, dtype, count):
        """The receive buffers of the ``n``-th flat of a call, one per
        peer, of ``count`` elements (this rank's slice): made once per
        position, dtype and size, reused by every later call."""
        key = (n, np.dtype(dtype).str, count)
        found = self._scratch.get(key)
        if found is None:
            if len(self._scratch) >= 64:  # sizes that keep changing
                self._scratch.clear()
            found = self._scratch[key] = {
                p: np.empty(count, dtype) for p in self._out}
        return found

    def allreduce(self, flats, signature):
        """Sum the 1-D contiguous host arrays ``flats`` in place over every
        rank of the links, as the module says. ``signature`` (what the
        call sums, the same on every rank in step) is checked against
        every peer's: CollectiveError when they differ."""
        if self._error is not None:
            raise CollectiveError(f'the links are closed after an earlier '
                                  f'failure: {self._error}')
        group = sorted(self._out) + [self.rank]
        group.sort()
        me, peers = group.index(self.rank), self.peers
        if not peers:
            return flats
        self._calls += 1
        header = HEADER.pack(self._calls, sum(f.nbytes for f in flats),
                             len(signature), digest(signature))
        plan = []  # per flat: the flat, every rank's slice, my records
        for n, f in enumerate(flats):
            parts = bounds(f.size, len(group))
            lo, hi = parts[me]
            plan.append((f, parts, records(lo, hi, f.itemsize),
                         self._buffers(n, f.dtype, hi - lo)))
        deadline = time.monotonic() + self.timeout
        call = self._call = _Call(2 * len(peers) * self.streams)
        for peer in peers:
            k = group.index(peer)
            for i in range(self.streams):
                self._out[peer][i].queue(self._sender(
                    call, header, plan, peer, k, i, deadline))
                self._in[peer][i].queue(self._receiver(
                    call, header, plan, peer, k, i, me))
        try:
            self._reduce(call, plan, group, me, deadline)
            call.wait(lambda: call.left == 0, deadline, 'the all-reduce')
        except BaseException as e:
            self._fail(e)  # the peers must not wait for this rank
            raise
        finally:
            self._call = None
        return flats

    def _sender(self, call, header, plan, peer, k, i, deadline):
        """The job of outgoing stream ``i`` to ``peer`` (group index
        ``k``): the header, the stream's records of that rank's slices
        (the reduce-scatter), then its records of the sums of this rank's
        slices, each as soon as it is summed (the all-gather)."""
        stream, streams = self._out[peer][i], self.streams

        def job():
            stream.send(header)
            call.mark(call.head)
            for n, (f, parts, mine, _) in enumerate(plan):
                for a, b in records(*parts[k], f.itemsize)[i::streams]:
                    stream.send(f[a:b])
                for a, b in mine[i::streams]:
                    call.wait(lambda key=(n, a): key in call.summed,
                              deadline, "a peer's records")
                    stream.send(f[a:b])
            call.mark(call.done)
        return job

    def _receiver(self, call, header, plan, peer, k, i, me):
        """The job of incoming stream ``i`` from ``peer`` (group index
        ``k``): check its header, take its records of this rank's slices
        into the receive buffers, then the sums of its slices straight
        into the flat buffers."""
        stream, streams = self._in[peer][i], self.streams

        def job():
            theirs = bytearray(HEADER.size)
            stream.recv_into(theirs)
            if bytes(theirs) != header:
                # Every peer reads this rank's header before the links
                # close: each says what is out of step, not that a link
                # was lost.
                with contextlib.suppress(CollectiveError):
                    call.wait(lambda: call.heads == len(self._out) * streams,
                              time.monotonic() + 2.0, 'the headers')
                error = _out_of_step(peer, self.rank, HEADER.unpack(theirs),
                                     HEADER.unpack(header))
                call.mark(lambda: call.hear(error))  # the error first
                raise error
            call.mark(call.hear)
            for n, (f, parts, mine, scratch) in enumerate(plan):
                into, lo = scratch[peer], parts[me][0]
                for a, b in mine[i::streams]:
                    stream.recv_into(into[a - lo:b - lo])
                    call.mark(lambda key=(n, a): call.arrive(key))
                for a, b in records(*parts[k], f.itemsize)[i::streams]:
                    stream.recv_into(f[a:b])
            call.mark(call.done)
        return job

    def _reduce(self, call, plan, group, me, deadline):
        """On the calling thread: each record of this rank's slices, once
        every peer's copy arrived, summed in rank order into the flat
        buffer; the senders pick it up from there."""
        need = len(group) - 1
        with np.errstate(over='ignore', invalid='ignore'):  # inf, quietly
            for n, (f, parts, mine, scratch) in enumerate(plan):
                lo = parts[me][0]
                for a, b in mine:
                    call.wait(lambda key=(n, a): call.arrived.get(key, 0)
                              == need, deadline, "a peer's records")
                    got = [f[a:b] if p == self.rank else
                           scratch[p][a - lo:b - lo] for p in group]
                    if me == 0:  # my own values come first: summed there
                        for part in got[1:]:
                            np.add(got[0], part, out=got[0])
                    else:  # into the first peer's, then here
                        acc = got[0]
                        for part in got[1:]:
                            np.add(acc, part, out=acc)
                        f[a:b] = acc
                    call.mark(lambda key=(n, a): call.summed.add(key))


class OutOfStep(CollectiveError):
    """The ranks called an all-reduce of different arrays."""


def _first(before, error):
    """The error a call raises: the first one, unless ``error`` says the
    ranks are out of step, which caused the others."""
    if before is None or (isinstance(error, OutOfStep)
                          and not isinstance(before, OutOfStep)):
        return error
    return before


def _out_of_step(peer, rank, theirs, mine):
    return OutOfStep(
        f'rank {peer} sums {theirs[2]} arrays ({theirs[1]} bytes) where '
        f'rank {rank} sums {mine[2]} ({mine[1]} bytes), or of other dtypes '
        'or sizes: the ranks are out of step (different models or '
        'optimizer state)')


def connect(comm, host, streams=STREAMS, sealed=True, timeout=300.0):
    """This rank's :class:`Links` to every other rank of ``comm``.

    Parameters
    ----------
    comm
        The ranks to link (a communicator over them, or a group of one:
        its ``rank``, ``size`` and ``alltoall`` carry the addresses,
        tokens and keys, over TLS where the job's comms have it).
    host : str
        The address this rank listens on (its worker's).
    streams : int, default :data:`STREAMS`
        Connections each way between two ranks.
    sealed : bool, default True
        Seal every record (AES-GCM); False: plain, for a trusted network.
    timeout : float
        Seconds to wait for every peer's connections, and then the
        collective timeout of every record.

    Every rank of ``comm`` must call it at once. The listening socket
    lives only until every peer has connected.
    """
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    rank, size = comm.rank, comm.size
    peers = [p for p in range(size) if p != rank]
    deadline = time.monotonic() + timeout
    server = socket.create_server((host, 0), backlog=max(8, size * streams))
    try:
        server.settimeout(0.2)
        port = server.getsockname()[1]
        slots = {(p, i): (secrets.token_bytes(TOKEN),
                          AESGCM.generate_key(KEY * 8) if sealed else None)
                 for p in peers for i in range(streams)}
        told = comm.alltoall({p: {
            'address': (host, port),
            'slots': [slots[p, i] for i in range(streams)]} for p in peers})
        incoming, accepted = {p: [None] * streams for p in peers}, []
        done = threading.Event()
        failure = []
        thread = threading.Thread(
            target=_accept, args=(server, slots, incoming, accepted, done,
                                  failure, deadline),
            daemon=True, name=f'dasktrain-links-accept-{rank}')
        thread.start()
        outgoing = {p: [] for p in peers}
        try:
            for p in peers:
                address, theirs = told[p]['address'], told[p]['slots']
                for i in range(streams):
                    sock = socket.create_connection(
                        address, timeout=max(0.1, deadline - time.monotonic()))
                    _tune(sock)
                    outgoing[p].append(sock)
                    sock.sendall(HELLO.pack(rank, i, theirs[i][0]))
        except OSError as e:
            raise CollectiveError(f'rank {rank} cannot open a link to a '
                                  f'peer ({e})') from None
        finally:
            done.wait(max(0.0, deadline - time.monotonic()))
            done.set()  # the acceptor stops either way
            thread.join()
        if failure or any(s is None for socks in incoming.values()
                          for s in socks):
            for socks in list(outgoing.values()) + [accepted]:
                for s in socks:
                    s.close()
            missing = sorted({p for p, socks in incoming.items()
                              if any(s is None for s in socks)})
            raise CollectiveError(f'rank(s) {missing} did not open their '
                                  'links within the collective_timeout')
    finally:
        server.close()
    keys = None if not sealed else {
        'in': {p: [slots[p, i][1] for i in range(streams)] for p in peers},
        'out': {p: [told[p]['slots'][i][1] for i in range(streams)]
                for p in peers}}
    return Links(rank, outgoing, incoming, keys, timeout)


def _tune(sock):
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _accept(server, slots, incoming, accepted, done, failure, deadline):
    """Accept connections until every slot has its own: a connection
    that does not open with a slot's token is closed unread further."""
    need = len(slots)
    while not done.is_set() and need:
        if time.monotonic() > deadline:
            return
        try:
            sock, _ = server.accept()
        except TimeoutError:
            continue
        except OSError as e:
            failure.append(e)
            done.set()
            return
        try:
            sock.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
            hello = bytearray(HELLO.size)
            view = memoryview(hello)
            while view:
                got = sock.recv_into(view)
                if not got:
                    raise OSError('closed')
                view = view[got:]
            peer, stream, token = HELLO.unpack(hello)
            slot = slots.get((peer, stream))
            if slot is None or incoming[peer][stream] is not None or \
                    not hmac.compare_digest(token, slot[0]):
                raise OSError('not a slot of this job')
        except OSError:
            sock.close()
            continue
        _tune(sock)
        incoming[peer][stream] = sock
        accepted.append(sock)
        need -= 1
    done.set()
