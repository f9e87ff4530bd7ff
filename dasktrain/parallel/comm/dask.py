"""Collectives among the processes of one training job, without MPI.

Ranks find each other through Dask (each publishes its listening address
in a ``distributed.Variable``) and connect peer to peer over Dask's own
comm layer (TCP or TLS), or, launched on one machine, meet through rank 0
over Unix sockets (:mod:`~dasktrain.parallel.comm.transports`): nothing
funnels through the client or the scheduler. Those connections carry
the small messages (objects, barriers, the set-up); arrays take the
fastest path there is:

* every rank on one host: shared memory
  (:mod:`~dasktrain.parallel.comm.shm`);
* one rank per host: *links* (:mod:`~dasktrain.parallel.comm.links`),
  sockets of their own outside Dask's event loop, several streams on
  several threads, sealed with AES-GCM where the comms use TLS; a
  reduce-scatter then an all-gather, each rank summing its slice in rank
  order, so every rank gets the same bits, and for two ranks those of one
  process adding the two;
* several hosts with several ranks each: *hierarchical*, as ChainerMN's
  ``hierarchical`` communicator: the ranks of a host sum through shared
  memory, the first rank of each host (its leader) all-reduces the host's
  sum with the other leaders over links, in place in the shared result,
  and every rank of the host reads it from there. Only one rank per host
  crosses the network.

A host is a listening address (its IP): ranks that listen on one address
and see one ``/dev/shm`` share memory. :class:`~dasktrain.parallel.comm.
nccl.NcclComm` does the array part with NCCL through CuPy on GPUs, its
unique id handed out over a :class:`DaskComm`.

Every wait has a deadline: a rank that died closes its connections, and a
rank that hangs stops answering; both raise
:class:`~dasktrain.parallel.comm.base.CollectiveError` on the others
instead of blocking forever.

:meth:`DaskComm.split` gives the ranks of one colour a communicator of
their own (MPI's ``Comm_Split``; connecting is
:mod:`~dasktrain.parallel.comm.mesh`'s); :meth:`DaskComm.exchange` is a
collective step of any shape (a broadcast or gather from any root, an
all-to-all), one message per pair that has something to say.

GPU arrays are copied to the host and back (each with its own device
current) through pinned buffers kept while the sums use them
(:mod:`~dasktrain.parallel.comm.staging`); NCCL is
:mod:`~dasktrain.parallel.comm.nccl`'s.
"""
import asyncio
import os

import numpy as np

from dasktrain.parallel.comm import board, mesh
from dasktrain.parallel.comm.base import (
    PEER_GONE,
    SHARED_MEMORY_ENV,
    CollectiveError,
    Communicator,
    PeerLost,
)
from dasktrain.parallel.comm.batches import batches, scaled, signature
from dasktrain.parallel.comm.links import STREAMS, plain_asked
from dasktrain.parallel.comm.links import connect as link
from dasktrain.parallel.comm.nearby import Nearby, NearGroup
from dasktrain.parallel.comm.shm import SharedMemoryReducer
from dasktrain.parallel.comm.staging import (
    PinnedBuffer,
    Staging,
    from_host,
    to_host,
)


class DaskComm(Communicator):
    """All-reduce, all-gather, gather and broadcast among ``size`` ranks.

    Create one per rank with :meth:`rendezvous` (inside Dask tasks); the
    same calls must then be made in the same order on every rank.

    Parameters
    ----------
    rank, size : int
    comms : dict
        Rank -> open ``distributed.comm.Comm`` to every other rank.
    loop : asyncio loop
        The loop (on its own thread) the comms belong to.
    timeout : float
        Seconds any one collective may wait for a peer.
    """

    solo = False
    sums_on_device = False

    def __init__(self, rank, size, comms, loop, thread, listener, timeout):
        super().__init__(rank, size, timeout)
        self._comms, self._loop, self._thread = comms, loop, thread
        self._listener = listener
        self._calls = 0
        self._pairs = {}  # (source, dest) -> point-to-point messages
        self._groups = {}  # group name -> its collectives' count
        self._shm = None  # a SharedMemoryReducer over this host's ranks
        self._links = None  # Links to the other hosts' leaders
        self.hosts = [list(range(size))]  # ranks by host, for routes
        # pinned host buffers for GPU sums, by batch, kept while used
        self._staging = Staging(PinnedBuffer, PinnedBuffer.free)
        #: what its connections are (:mod:`~dasktrain.parallel.comm.
        #: transports`): split()'s too
        self.transport = None
        #: (plain, streams) of its links (:meth:`routes`): split()'s too
        self.link_options = (False, STREAMS)

    # -------------------------------------------------------- set-up

    @classmethod
    def rendezvous(cls, name, rank, size, timeout=300.0, client=None,
                   listen_host=None, security=None, shared_memory=None,
                   plain=None, streams=STREAMS):
        """Meet the other ranks of job attempt ``name`` and connect to all.

        Each rank listens on its worker's host, publishes the address as
        Dask Variable ``{name}/rank{r}``; a rank dials every lower rank.
        Raises CollectiveError after ``timeout`` seconds without them all.
        Then the routes of the arrays (see the module): with
        ``shared_memory`` (default: unless ``DASKTRAIN_SHARED_MEMORY=0``
        in the environment) the ranks of one host sum through it; the
        hosts' leaders open ``streams`` links each way to each other,
        sealed where the comms use TLS unless every rank asks for
        ``plain`` ones (default: ``DASKTRAIN_LINKS=tcp`` in its
        environment).
        """
        from distributed import Variable, get_client, get_worker
        from distributed.comm.addressing import get_address_host, parse_address

        from dasktrain.parallel.comm.transports import DaskTransport
        if client is None:
            client = get_client()
        if listen_host is None or security is None:
            worker = get_worker()
            scheme = parse_address(worker.address)[0]
            listen_host = listen_host or \
                f'{scheme}://{get_address_host(worker.address)}'
            security = security or worker.security

        def publish(address):
            Variable(f'{name}/rank{rank}', client=client).set(address)

        def lookup(peer, limit):
            try:
                return Variable(f'{name}/rank{peer}', client=client) \
                    .get(timeout=limit)
            except TimeoutError:
                raise CollectiveError(
                    f'rank {peer} of {size} did not start within '
                    f'{timeout:g} s (collective_timeout)') from None
        return mesh.connect(cls, rank, size, timeout,
                            DaskTransport(listen_host, security), publish,
                            lookup, shared_memory, plain, streams)

    @classmethod
    def meet(cls, rank, size, tell, find, transport, timeout=300.0,
             shared_memory=None, plain=None, streams=STREAMS):
        """Meet the other ranks without a scheduler: rank 0 listens
        through ``transport`` (a Unix socket, or Dask's comms on a port
        the kernel chooses) and calls ``tell(address)``; the others get
        it from ``find(seconds left)``, dial rank 0 first and learn from
        it where each listens (``mesh.connect``'s ``through_rank0``);
        then as :meth:`rendezvous`. What a launch on one machine uses
        (:func:`~dasktrain.parallel.comm.rendezvous.join`): no scheduler
        to start, import or dial, no Dask or TLS imported over Unix
        sockets, no port named before it is bound."""
        return mesh.connect(cls, rank, size, timeout, transport,
                            tell if rank == 0 else None,
                            lambda peer, limit: find(limit),
                            shared_memory, plain, streams,
                            through_rank0=True)

    def split(self, color, key, shared_memory=None):
        """A communicator of the ranks that give the same ``color``,
        ranked by ``key`` (ties by this communicator's rank), as MPI's
        ``Comm_Split``: every rank calls it, each gets its group's (see
        :func:`~dasktrain.parallel.comm.mesh.split`).

        Examples
        --------
        >>> rows = comm.split(comm.rank // 2, comm.rank)  # doctest: +SKIP
        """
        return mesh.split(self, color, key, shared_memory)


    def routes(self, host, shared_memory=None, plain=None, streams=STREAMS,
               tls=True):
        """Decide how arrays travel (see the module), once connected:
        group the ranks by their ``host``, join each host's through shared
        memory (``shared_memory``; default: unless
        ``DASKTRAIN_SHARED_MEMORY=0``), link the hosts' leaders with
        ``streams`` streams each way, sealed where ``tls`` unless every
        rank asks for ``plain`` links (default: ``DASKTRAIN_LINKS=tcp``).
        A collective: every rank calls it."""
        if shared_memory is None:
            shared_memory = os.environ.get(SHARED_MEMORY_ENV, '1') != '0'
        if plain is None:
            plain = plain_asked()
        self.link_options = (plain, streams)
        # A rank's machine is the host it listens on, not its hostname:
        # hosts cloned from one image (VMs, containers) share a hostname,
        # and their /etc/machine-id too, but never an address their peers
        # reach them at. It is also how `dasktrain launch` groups a
        # machine's ranks when it shows them their GPUs (its ranks listen
        # on their Dask worker's address host), so a rank's place among
        # them (placement.machine_place) indexes the list it was given.
        self.machine = host
        if self.size == 1:
            return
        hosts = host_groups(self.allgather(host))
        mine = next(g for g in hosts if self.rank in g)
        if shared_memory and len(mine) > 1:
            group = self.group(mine, f'host{mine[0]}')
            self._shm = SharedMemoryReducer.connect(group)
            if self._shm is not None:  # its barriers over Unix sockets
                near = Nearby.connect(group, set(range(len(mine))) -
                                      {group.rank})
                self._shm.comm = NearGroup(near, group.rank, group.size)
                if board.supported():  # and its barriers through memory
                    self._shm.board = board.Board.connect(group, near.gone)
        # A host whose ranks cannot share memory is as many hosts.
        joined = self.allgather(self._shm is not None or len(mine) == 1)
        self.hosts = [g for g in hosts if all(joined[r] for r in g)] + \
            [[r] for g in hosts if not all(joined[r] for r in g) for r in g]
        self.hosts.sort()
        leaders = [g[0] for g in self.hosts]
        sealed = tls and not all(self.allgather(bool(plain)))
        if len(leaders) > 1 and self.rank in leaders:
            self._links = link(self.group(leaders, 'leaders'), host,
                               streams, sealed, self.timeout)

    @property
    def shared_memory(self):
        """Whether all-reduces go through shared memory alone (every rank
        on this machine) rather than also over the network."""
        return self._shm is not None and len(self.hosts) == 1

    @property
    def route(self):
        """How this job's arrays travel: ``'shared memory'`` (one host),
        ``'links'`` (one rank per host), ``'hierarchical'`` (both), or
        ``'none'`` (one rank)."""
        if self.size == 1:
            return 'none'
        if len(self.hosts) == 1:
            return 'shared memory'
        if all(len(g) == 1 for g in self.hosts):
            return 'links'
        return 'hierarchical'

    @property
    def sealed(self):
        """Whether this rank's links seal what they carry (None: it has
        none)."""
        return None if self._links is None else self._links.sealed

    def group(self, members, name):
        """The ranks ``members`` (ascending, this rank among them) as a
        communicator of their own for small messages, numbered from 0:
        collectives among them alone, which the other ranks never see."""
        return _Group(self, members, name)

    def close(self):
        """Drop the connections at once: peers still waiting fail fast."""
        self._staging.clear()
        if self._links is not None:
            self._links.close()
        if self._shm is not None:
            self._shm.close()
            if self._shm.board is not None:
                self._shm.board.close()
            if isinstance(self._shm.comm, NearGroup):
                self._shm.comm.close()
        async def shut():
            for comm in self._comms.values():
                comm.abort()
            self._listener.stop()
        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(shut(), self._loop).result(5)
            except Exception:
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is None:
            # Every rank leaves once all have come (a barrier): no rank
            # closes while a peer still reads a message it sent, which a
            # closed connection drops. A peer may be gone before the
            # barrier's last message is read: harmless.
            try:
                self.barrier()
            except CollectiveError:  # PeerLost, or one that never came
                pass
        self.close()

    # -------------------------------------------------------- transport

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _exchange(self, tag, send=None, receive=()):
        """Send ``send[peer]`` to each of its peers while reading one
        message from each peer in ``receive``; returns {peer: message}."""
        wrap, lost = self.transport.wrap, self.transport.lost
        send = send or {}

        async def write(peer):
            await self._comms[peer].write(
                {'tag': tag, 'data': wrap(send[peer])})

        async def read(peer):
            msg = await self._comms[peer].read()
            if msg.get('tag') != tag:
                ours = collective_name(tag)
                theirs = collective_name(msg.get('tag'))
                if theirs == ours:  # the same kind, another call of it
                    theirs = 'an earlier or later ' + ours.split(' ', 1)[1]
                raise CollectiveError(
                    f'rank {peer} is out of step: it is in {theirs} while '
                    f'rank {self.rank} is in {ours}')
            return msg['data']

        reads = {asyncio.ensure_future(read(p)): p for p in receive}
        tasks = {**reads, **{asyncio.ensure_future(write(p)): p
                             for p in send}}
        if not tasks:  # a job of one rank
            return {}
        done, pending = await asyncio.wait(
            tasks, timeout=self.timeout, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        # Every finished task's error read before raising one: an unread
        # one is printed as 'Task exception was never retrieved' with its
        # traceback when the loop drops it (seen on a Ctrl-C).
        errors = [(task, task.exception()) for task in done]
        for task, error in errors:
            if isinstance(error, lost):
                raise PeerLost(
                    f'rank {tasks[task]} closed its connection during '
                    f'{collective_name(tag)}: '
                    f'{PEER_GONE}') from None
            if error is not None:
                raise error
        if pending:
            raise CollectiveError(
                f'no answer from rank(s) {sorted({tasks[t] for t in pending})}'
                f' within {self.timeout:g} s during {collective_name(tag)} '
                '(collective_timeout): a worker hangs or is unreachable')
        return {peer: task.result() for task, peer in reads.items()}

    def _stager(self, k):
        """The pinned host buffers of an all-reduce's ``k``-th batch: one
        per batch position, dtype, size and GPU, reused by later sums
        while they keep asking for it and freed once they stop
        (:class:`~dasktrain.parallel.comm.staging.Staging`'s rule). A
        reused buffer is handed out once the copy back out of it is done
        (its event; in order anyway on the GPU's one stream of sums)."""
        def staging(dtype, size, device):
            pinned = self._staging.take(
                (k, np.dtype(dtype).str, int(size), int(device)))
            pinned.ready()
            return pinned.array
        return staging

    def _staged(self):
        """After the round's copies back to the GPUs were queued: each
        buffer it used marks their end."""
        for pinned in self._staging.used():
            pinned.copied()

    def _tag(self, kind):
        self._calls += 1
        return f'{kind}#{self._calls}'

    # -------------------------------------------------------- collectives

    def allreduce(self, arrays, check=False, scale=None):
        """Sum ``arrays`` (NumPy or CuPy) over ranks, in place, and return
        them. Each dtype is summed in its own precision, in rank order
        (between hosts' sums, in the order of the hosts' leaders). Ranks
        whose arrays differ in dtype or size raise CollectiveError
        whatever ``check`` says (the comparison rides with the data).
        ``scale``: the sums times it (through shared memory in the same
        pass, over links on the host buffer before it goes back)."""
        if self.size == 1:
            return scaled(arrays, scale)
        if self._shm is not None:
            return self._allreduce_shared(arrays, scale)
        # One flat host buffer per batch; a flat host array (a gradient
        # bucket's buffer) is summed where it lies.
        self._staging.next_round()
        packed = [(members, *to_host(members, self._stager(k)))
                  for k, (_, members) in enumerate(batches(arrays))]
        self._links.allreduce([flat for _, flat, _ in packed],
                              signature(arrays))
        for members, flat, made in packed:
            from_host(members, scaled([flat], scale)[0], made)
        self._staged()
        return arrays

    def _allreduce_shared(self, arrays, scale):
        self._staging.next_round()
        if len(arrays) == 1 and len(self.hosts) == 1 and \
                self._shm.allreduce_one(arrays[0], scale):
            return arrays  # small: on the board, in a few calls
        groups, back = {}, []
        for k, (key, members) in enumerate(batches(arrays)):
            if all(isinstance(a, np.ndarray) for a in members):
                # packed straight into shared memory
                groups.setdefault(key, []).extend(members)
                continue
            # one transfer per GPU bucket
            flat, made = to_host(members, self._stager(k))
            groups.setdefault(key, []).append(flat)
            back.append((members, flat, made))
        between = None
        if len(self.hosts) > 1:  # hierarchical: the leader crosses
            mine = signature(arrays)
            between = (lambda flats: self._links.allreduce(flats, mine)) \
                if self._links is not None else (lambda flats: None)
        self._shm.allreduce(groups, signature(arrays), between, scale)
        for members, flat, made in back:
            from_host(members, flat, made)
        self._staged()
        return arrays

    def allgather(self, obj):
        """Every rank's ``obj``, in rank order, on every rank."""
        others = self._others()
        got = self._run(self._exchange(self._tag('allgather'),
                                       {p: obj for p in others}, others))
        got[self.rank] = obj
        return [got[p] for p in range(self.size)]

    def gather(self, obj):
        """Every rank's ``obj`` in rank order on rank 0; None elsewhere."""
        tag = self._tag('gather')
        if self.rank != 0:
            self._run(self._exchange(tag, {0: obj}))
            return None
        got = self._run(self._exchange(tag, receive=self._others()))
        got[0] = obj
        return [got[p] for p in range(self.size)]

    def bcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        tag = self._tag('bcast')
        if self.rank == 0:
            self._run(self._exchange(tag, {p: obj for p in self._others()}))
            return obj
        return self._run(self._exchange(tag, receive=[0]))[0]

    def bcast_arrays(self, arrays):
        """Rank 0's host ``arrays`` into every rank's ``arrays`` (NumPy,
        the same dtypes and sizes on every rank, in the same order), in
        place: through shared memory where every rank is on this machine
        (the segments a sum of the same arrays uses), else as one
        message."""
        if self.size > 1 and self.shared_memory:
            groups = {}
            for key, members in batches(arrays):
                groups.setdefault(key, []).extend(members)
            self._shm.bcast(groups, signature(arrays))
        elif self.size > 1:
            got = self.bcast(list(arrays) if self.rank == 0 else None)
            for a, theirs in zip(arrays, got if self.rank else ()):
                a[...] = theirs
        return arrays

    def exchange(self, send=None, receive=()):
        """One collective step of any shape: send ``send[peer]`` to each
        peer named in it while reading one object from each rank in
        ``receive``; returns {rank: object read}. Every rank calls it at
        the same point (it counts as a collective), and what each sends
        must be what the others read: a broadcast from rank r is r
        sending to all and the others reading from r; an all-to-all is
        every rank sending to and reading from all.

        Examples
        --------
        >>> comm.exchange({1: 'x'} if comm.rank == 0 else {},
        ...               [0] if comm.rank == 1 else [])  # doctest: +SKIP
        {}
        """
        for peer in [*(send or {}), *receive]:
            self._check_peer(peer)
        return self._run(self._exchange(self._tag('exchange'), send,
                                        receive))

    def send(self, obj, dest):
        """Send ``obj`` to rank ``dest`` alone; it takes it with
        :meth:`recv`. The other ranks take no part: point-to-point
        messages are counted per pair, apart from the collectives."""
        self._check_peer(dest)
        self._run(self._exchange(self._pair_tag(self.rank, dest),
                                 {dest: obj}))

    def recv(self, source):
        """The next object rank ``source`` sent here with :meth:`send`."""
        self._check_peer(source)
        return self._run(self._exchange(self._pair_tag(source, self.rank),
                                        receive=[source]))[source]

    def _pair_tag(self, source, dest):
        key = (source, dest)
        self._pairs[key] = self._pairs.get(key, 0) + 1
        return f'send{source}>{dest}#{self._pairs[key]}'

    def _check_peer(self, peer):
        if peer not in self._comms:
            raise CollectiveError(f'rank {peer} is not a peer of rank '
                                  f'{self.rank} in this job of {self.size}')

    def _others(self):
        return [p for p in range(self.size) if p != self.rank]



def collective_name(tag):
    """How a message names the collective of the message tag ``tag``: its
    kind, without the tag's count (which runs over every collective, the
    library's own among them, so it means nothing to a user).

    Examples
    --------
    >>> collective_name('bcast#5'), collective_name('allgather#2')
    ('a bcast', 'an allgather')
    >>> collective_name('send0>1#3'), collective_name('hosts/alltoall#1')
    ('a send from rank 0 to rank 1', 'an alltoall among hosts')
    """
    text = str(tag).rsplit('#', 1)[0]
    group, _, kind = text.rpartition('/')
    if kind.startswith('send') and '>' in kind:
        source, dest = kind[4:].split('>', 1)
        name = f'a send from rank {source} to rank {dest}'
    else:
        name = f'{"an" if kind[:1] in "aeiou" else "a"} {kind}'
    return name + (f' among {group}' if group else '')


def host_groups(hosts):
    """The ranks of each host, from every rank's listening host (in rank
    order): lists of ranks, ascending, ordered by their first rank.

    Examples
    --------
    >>> host_groups(['10.0.0.1', '10.0.0.2', '10.0.0.1', '10.0.0.2'])
    [[0, 2], [1, 3]]
    """
    found = {}
    for rank, host in enumerate(hosts):
        found.setdefault(host, []).append(rank)
    return sorted(found.values())


class _Group:
    """Some ranks of a :class:`DaskComm` as a communicator of their own
    for small messages (``rank`` and ``size`` among them): the shared
    memory barriers of one host, the set-up of the leaders' links. Its
    messages are tagged with its name and its own count, so the other
    ranks' collectives never mix with them."""

    def __init__(self, comm, members, name):
        self.comm, self.members, self.name = comm, list(members), name
        self.rank, self.size = self.members.index(comm.rank), len(members)
        self.timeout = comm.timeout

    def _tag(self, kind):
        calls = self.comm._groups.get(self.name, 0) + 1
        self.comm._groups[self.name] = calls
        return f'{self.name}/{kind}#{calls}'

    def alltoall(self, objs):
        """``objs[r]`` to the group's rank r; {r: what r sent here}."""
        others = [r for r in range(self.size) if r != self.rank]
        got = self.comm._run(self.comm._exchange(
            self._tag('alltoall'),
            {self.members[r]: objs[r] for r in others},
            [self.members[r] for r in others]))
        return {self.members.index(p): obj for p, obj in got.items()}

    def allgather(self, obj):
        got = self.alltoall({r: obj for r in range(self.size)})
        got[self.rank] = obj
        return [got[r] for r in range(self.size)]

    def bcast(self, obj):
        return self.allgather(obj if self.rank == 0 else None)[0]

    def barrier(self):
        self.allgather(None)
