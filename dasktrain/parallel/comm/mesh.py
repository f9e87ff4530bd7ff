"""Connecting the ranks of a communicator: a full mesh of connections,
one between every two ranks, and the groups that
:meth:`~dasktrain.parallel.comm.dask.DaskComm.split` makes of it.

:func:`connect` is how every
:class:`~dasktrain.parallel.comm.dask.DaskComm` comes to be: each rank
listens, says where (``publish``: a Dask Variable at the rendezvous, an
all-gather over the parent communicator in a split), dials every lower
rank and waits for the higher ones to dial it. :func:`split` is MPI's
``Comm_Split``: the ranks of one colour get a communicator of their own,
with connections of its own, so that its messages never meet the
parent's (MPI's communicator contexts). :func:`group` is the pure
decision of who is in a group and in which order.

Owns connecting ranks; what travels over the connections is
:mod:`~dasktrain.parallel.comm.dask`'s.
"""
import asyncio
import threading
import time

from dasktrain.parallel.comm.base import CollectiveError, Solo


def group(colors, color):
    """The ranks (of the communicator being split) in the group of
    ``color``, in their new order: by key, ties by old rank, as MPI's
    ``Comm_Split``. ``colors``: every rank's ``(color, key)``.

    Examples
    --------
    >>> colors = [(0, 5), (1, 0), (0, 2), (1, 0)]
    >>> group(colors, 0), group(colors, 1)
    ([2, 0], [1, 3])
    """
    return [rank for _, rank in sorted(
        (key, rank) for rank, (c, key) in enumerate(colors) if c == color)]


def connect(cls, rank, size, timeout, transport, publish, lookup,
            shared_memory=None, plain=None, streams=None,
            through_rank0=False):
    """A ``cls`` (a DaskComm) joining ``size`` ranks as ``rank``: listen
    through ``transport`` (:mod:`~dasktrain.parallel.comm.transports`:
    Dask's comms on a port the kernel chooses, or a Unix socket),
    ``publish(address)``, dial every lower rank at ``lookup(peer, seconds
    left)`` and wait for the higher ones, all within ``timeout`` seconds
    (else :class:`CollectiveError`). It runs its connections on an event
    loop thread of its own. Then the routes of its arrays
    (``shared_memory``, ``plain``, ``streams``:
    :meth:`~dasktrain.parallel.comm.dask.DaskComm.routes`; None: its
    defaults): shared memory among the ranks of a host, links between
    hosts.

    ``through_rank0``: no place for every rank to publish at (no
    scheduler): rank 0 alone publishes where it listens, the others find
    it with ``lookup(0, ...)``; every other rank dials it first, saying
    where it listens itself, and once all have, rank 0 answers each with
    every rank's address, which the later dials use."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True,
                              name=f'dasktrain-comm-{rank}')
    thread.start()
    comms, arrived = {}, asyncio.Event()
    heard = {}  # rank -> where it listens (through rank 0: rank 0's map)

    async def accept(comm):
        hello = await comm.read()
        comms[hello['rank']] = comm
        heard[hello['rank']] = hello.get('address')
        if len(comms) == size - 1:
            if through_rank0 and rank == 0:
                for peer in sorted(comms):
                    await comms[peer].write({'addresses': heard})
            arrived.set()

    def run(coro, limit):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(limit)

    deadline = time.monotonic() + timeout
    try:
        listener = run(transport.listen(accept), timeout)
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        raise
    self = cls(rank, size, comms, loop, thread, listener, timeout)
    self.transport = transport
    try:
        if not through_rank0 or rank == 0:
            publish(listener.contact_address)
        for peer in range(rank):
            address = heard[peer] if through_rank0 and peer else \
                lookup(peer, max(0.1, deadline - time.monotonic()))

            async def dial(address=address, peer=peer):
                comm = await transport.dial(address)
                await comm.write({'rank': rank,
                                  'address': listener.contact_address})
                if through_rank0 and peer == 0:  # every rank's address
                    heard.update((await comm.read())['addresses'])
                comms[peer] = comm
                if len(comms) == size - 1:
                    arrived.set()
            run(dial(), max(0.1, deadline - time.monotonic()))
        if size > 1:
            try:
                run(asyncio.wait_for(arrived.wait(), max(
                    0.1, deadline - time.monotonic())), None)
            except asyncio.TimeoutError:
                missing = sorted(set(range(size)) - set(comms) - {rank})
                raise CollectiveError(
                    f'ranks {missing} did not connect within {timeout:g}'
                    ' s (collective_timeout)') from None
        options = {} if streams is None else {'streams': streams}
        self.routes(transport.host(listener.contact_address),
                    shared_memory, plain, tls=transport.private, **options)
    except BaseException:
        self.close()
        raise
    return self


def split(comm, color, key, shared_memory=None):
    """The communicator of ``comm``'s ranks that give ``color``, ranked
    by ``key`` (ties by rank in ``comm``); every rank of ``comm`` calls it
    (two all-gathers over ``comm``: the colours, then the new listeners'
    addresses). The group listens through ``comm``'s transport, sums
    through shared memory where ``comm`` does (unless ``shared_memory``
    says otherwise) and links as ``comm`` does; a group of one is a
    :class:`~dasktrain.parallel.comm.base.Solo`."""
    members = group(comm.allgather((color, key)), color)
    if len(members) == 1:
        comm.allgather(None)  # the addresses' round, which the others make
        return Solo()
    if shared_memory is None:
        shared_memory = comm.route in ('shared memory', 'hierarchical')
    addresses = {}

    def publish(address):
        addresses.update(enumerate(comm.allgather(address)))

    def lookup(peer, limit):
        return addresses[members[peer]]
    plain, streams = comm.link_options
    return connect(type(comm), members.index(comm.rank), len(members),
                   comm.timeout, comm.transport, publish, lookup,
                   shared_memory, plain, streams)
