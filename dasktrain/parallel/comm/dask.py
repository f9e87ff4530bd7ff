"""Collectives among the processes of one training job, without MPI.

Ranks find each other through Dask (each publishes its listening address
in a ``distributed.Variable``) and then talk directly, peer to peer, over
Dask's own comm layer (TCP or TLS, with Dask's zero-copy serialisation of
NumPy arrays): nothing funnels through the client or the scheduler.

:class:`DaskComm` sums arrays with a reduce-scatter followed by an
all-gather over a full mesh: each rank owns 1/N of every flattened buffer,
receives the other ranks' pieces of it, adds them in rank order (so the
result is the same on every rank, and for two ranks bit-identical to one
process adding the two), and sends the sum back. Per call each rank sends
and receives 2 (N - 1) / N of the buffer, as in a ring all-reduce, in
2 (N - 1) messages. :class:`~dasktrain.parallel.comm.nccl.NcclComm` does
the array part with NCCL through CuPy on GPUs, its unique id handed out
over a :class:`DaskComm`. Between ranks of one machine,
:mod:`~dasktrain.parallel.comm.shm` sums through shared memory instead of
sockets.

Every wait has a deadline: a rank that died closes its connections, and a
rank that hangs stops answering; both raise
:class:`~dasktrain.parallel.comm.base.CollectiveError` on the others
instead of blocking forever.

:meth:`DaskComm.split` gives the ranks of one colour a communicator of
their own (MPI's ``Comm_Split``; connecting is
:mod:`~dasktrain.parallel.comm.mesh`'s); :meth:`DaskComm.exchange` is a
collective step of any shape (a broadcast or gather from any root, an
all-to-all), one message per pair that has something to say.

GPU arrays are copied to the host and back here (each with its own device
current); NCCL is :mod:`~dasktrain.parallel.comm.nccl`'s.
"""
import asyncio

import numpy as np

from dasktrain.parallel.comm import mesh
from dasktrain.parallel.comm.base import (
    CollectiveError,
    Communicator,
    batches,
    packing,
    place,
    signature,
)


class PeerLost(CollectiveError):
    """A peer's connection closed."""


def _to_host(members, staging=None):
    """One flat host buffer holding ``members`` (one dtype) and how it was
    made (:func:`~dasktrain.parallel.comm.base.packing`, and the GPU
    buffer it came from): a flat host array is the buffer itself; GPU
    arrays of one GPU travel in one transfer, not one each, into
    ``staging(dtype, size)``'s buffer where given (pinned memory: both
    transfers run at the bus's speed, not through a pageable bounce)."""
    how = packing([place(a) for a in members])
    if how == 'itself' and isinstance(members[0], np.ndarray):
        return members[0].reshape(-1), (how, None)  # a view: summed there
    if how == 'host':
        return np.concatenate([a.ravel() for a in members]), (how, None)
    if how == 'each':
        return np.concatenate([
            (a if isinstance(a, np.ndarray) else a.get()).ravel()
            for a in members]), (how, None)
    import cupy
    with members[0].device:  # 'itself' or 'device': one GPU's
        flat = members[0].reshape(-1) if how == 'itself' else \
            cupy.concatenate([a.ravel() for a in members])
        out = None if staging is None else staging(flat.dtype, flat.size)
        return flat.get(out=out), (how, flat)  # get() waits for its copy


def _from_host(members, host, made):
    """Write the summed flat ``host`` buffer back into ``members``, as
    :func:`_to_host` ``made`` it."""
    how, flat = made
    if how == 'itself' and flat is None:
        return  # the host array itself was summed
    if flat is not None:  # one transfer back, then copies on that GPU
        with members[0].device:
            flat.set(host)
            if how == 'device':
                _scatter(members, flat)
        return
    _scatter(members, host)


def _scatter(members, flat):
    """``members`` := their consecutive parts of ``flat`` (on the host, or
    on the GPU current, where the members are)."""
    start = 0
    for a in members:
        part = flat[start:start + a.size].reshape(a.shape)
        start += a.size
        if isinstance(a, np.ndarray):
            a[...] = part
            continue
        import cupy
        if isinstance(part, np.ndarray):  # 'each': GPU arrays of several
            with a.device:  # copyto also fills non-contiguous views
                cupy.copyto(a, cupy.asarray(part))
        else:
            cupy.copyto(a, part)


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
        self._shm = None  # a SharedMemoryReducer when all share a host
        self._staging = {}  # pinned host buffers for GPU sums, by batch
        #: (listen host, Security) it was connected with: split()'s too
        self.joined = None

    # -------------------------------------------------------- set-up

    @classmethod
    def rendezvous(cls, name, rank, size, timeout=300.0, client=None,
                   listen_host=None, security=None, shared_memory=True):
        """Meet the other ranks of job attempt ``name`` and connect to all.

        Each rank listens on its worker's host, publishes the address as
        Dask Variable ``{name}/rank{r}``; a rank dials every lower rank.
        Raises CollectiveError after ``timeout`` seconds without them all.
        With ``shared_memory`` and every rank on this machine, all-reduces
        go through shared memory (:mod:`~dasktrain.parallel.comm.shm`).
        """
        from distributed import Variable, get_client, get_worker
        from distributed.comm.addressing import get_address_host, parse_address
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
        return mesh.connect(cls, rank, size, timeout, listen_host, security,
                            publish, lookup, shared_memory)

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

    def attach_shared_memory(self, reducer):
        """Sum through ``reducer`` (a SharedMemoryReducer; None: over the
        connections) from now on."""
        self._shm = reducer

    @property
    def shared_memory(self):
        """Whether all-reduces go through shared memory (every rank on
        this machine) rather than over the sockets."""
        return self._shm is not None

    def close(self):
        """Drop the connections at once: peers still waiting fail fast."""
        self._staging.clear()
        if self._shm is not None:
            self._shm.close()
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
            # Rank 0 releases the others once it has read all they sent:
            # no rank leaves while a message of its own is unread. Rank 0
            # may be gone before its release is read: harmless.
            try:
                self.bcast(None)
            except PeerLost:
                pass
        self.close()

    # -------------------------------------------------------- transport

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _exchange(self, tag, send=None, receive=()):
        """Send ``send[peer]`` to each of its peers while reading one
        message from each peer in ``receive``; returns {peer: message}."""
        from distributed.comm.core import CommClosedError
        from distributed.protocol import to_serialize
        send = send or {}

        async def write(peer):
            await self._comms[peer].write(
                {'tag': tag, 'data': to_serialize(send[peer])})

        async def read(peer):
            msg = await self._comms[peer].read()
            if msg.get('tag') != tag:
                raise CollectiveError(
                    f'rank {peer} is out of step: it sent {msg.get("tag")!r} '
                    f'while rank {self.rank} expected {tag!r}')
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
            if isinstance(error, (CommClosedError, OSError)):
                raise PeerLost(
                    f'rank {tasks[task]} closed its connection during {tag}: '
                    'its worker died or its training failed') from None
            if error is not None:
                raise error
        if pending:
            raise CollectiveError(
                f'no answer from rank(s) {sorted({tasks[t] for t in pending})}'
                f' within {self.timeout:g} s during {tag} '
                '(collective_timeout): a worker hangs or is unreachable')
        return {peer: task.result() for task, peer in reads.items()}

    def _stager(self, k):
        """The pinned host buffers of an all-reduce's ``k``-th batch: one
        per batch position, dtype and size, made once and reused by every
        later sum (each finishes before the next begins)."""
        def staging(dtype, size):
            import cupyx
            key = (k, np.dtype(dtype).str, int(size))
            found = self._staging.get(key)
            if found is None:
                found = self._staging[key] = cupyx.empty_pinned(size, dtype)
            return found
        return staging

    def _tag(self, kind):
        self._calls += 1
        return f'{kind}#{self._calls}'

    # -------------------------------------------------------- collectives

    def allreduce(self, arrays, check=False):
        """Sum ``arrays`` (NumPy or CuPy) over ranks, in place, and return
        them. Each dtype is summed in its own precision, in rank order.
        Ranks whose arrays differ in dtype or size raise CollectiveError
        whatever ``check`` says (the comparison rides with the data)."""
        if self.size == 1:
            return arrays
        if self._shm is not None:
            return self._allreduce_shared(arrays)
        # One flat host buffer per batch; a flat host array (a gradient
        # bucket's buffer) is summed where it lies.
        packed = {str(k): (members, *_to_host(members, self._stager(k)))
                  for k, (_, members) in enumerate(batches(arrays))}
        tag = self._tag('allreduce')
        me, others = self.rank, self._others()
        mine = signature(arrays)
        pieces = {k: np.array_split(flat, self.size)
                  for k, (_, flat, _) in packed.items()}
        got = self._run(self._exchange(
            tag, {p: {'sig': mine,
                      'parts': {k: v[p] for k, v in pieces.items()}}
                  for p in others}, others))
        for peer, msg in list(got.items()):
            if msg['sig'] != mine:
                raise CollectiveError(
                    f'rank {peer} sums {len(msg["sig"])} arrays where rank '
                    f'{me} sums {len(mine)} (or of other sizes): the ranks '
                    'are out of step (different models or optimizer state)')
            got[peer] = msg['parts']
        got[me] = {k: v[me] for k, v in pieces.items()}
        mine = {}
        with np.errstate(over='ignore', invalid='ignore'):  # inf, quietly
            for k in pieces:
                mine[k] = np.array(got[0][k], copy=True)
                for p in range(1, self.size):
                    mine[k] += got[p][k]
        back = self._run(self._exchange(
            tag + '/gather', {p: mine for p in others}, others))
        back[me] = mine
        for k, (members, flat, made) in packed.items():
            # The slices arrive into the flat buffer: no other copy.
            np.concatenate([back[p][k] for p in range(self.size)], out=flat)
            _from_host(members, flat, made)
        return arrays

    def _allreduce_shared(self, arrays):
        groups, back = {}, []
        for k, (key, members) in enumerate(batches(arrays)):
            if all(isinstance(a, np.ndarray) for a in members):
                # packed straight into shared memory
                groups.setdefault(key, []).extend(members)
                continue
            # one transfer per GPU bucket
            flat, made = _to_host(members, self._stager(k))
            groups.setdefault(key, []).append(flat)
            back.append((members, flat, made))
        self._shm.allreduce(groups, signature(arrays))
        for members, flat, made in back:
            _from_host(members, flat, made)
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

