"""ChainerMN's array calls of a communicator: ``send``/``recv`` (arrays or
tuples of arrays, any shapes and dtypes, matched by source and tag as MPI
matches them), ``bcast``, ``gather``, ``scatter`` (any root),
``allgather``, ``alltoall`` and ``allreduce``, as
:class:`ArrayCalls`, a part of
:class:`~dasktrain.chainermn.communicator.DaskCommunicator`.

Each call is one collective step with one message per pair of ranks that
has something to say (a tuple travels as one message, never one per
array). GPU arrays between two GPU ranks that both have NCCL travel GPU
to GPU, as one buffer over NCCL point to point
(:mod:`~dasktrain.parallel.comm.ncclpair`), never pickled; the
collectives copy GPU arrays through the host, once per call.

Where results land, as ChainerMN says: in the array module of the rank's
own array (``allgather``, ``alltoall``, ``gather`` on the root), on that
array's device, not the current one; what a rank receives without an
array of its own (``recv``, ``bcast`` and ``scatter`` off the root) in
the sender's module, on the current device.
"""
import numpy as np

from dasktrain.chainermn.mpi import ANY_TAG, fill
from dasktrain.chainermn.support import fatal
from dasktrain.parallel.comm.mailbox import ANY
from dasktrain.parallel.comm.ncclpair import (
    NcclPair,
    byte_layout,
    pack,
    route,
    unpack,
)


def on_gpu(array):
    """Whether ``array`` is a CuPy array."""
    return array is not None and not isinstance(array, np.ndarray) and \
        hasattr(array, 'device') and hasattr(array, 'get')


def host(array):
    """``array`` in host memory (a GPU array copied once)."""
    return array.get() if on_gpu(array) else np.asarray(array)


def land(received, gpu, like=None):
    """A received host array where it belongs: host memory unless it was
    sent from a GPU (``gpu``); then on ``like``'s device where ``like`` is
    a GPU array (this rank's own array), else on the current device."""
    if not gpu:
        return received
    import cupy
    device = like.device if on_gpu(like) else cupy.cuda.Device()
    with device:
        return cupy.asarray(received)


def copy(array):
    """A copy of ``array`` on its own device."""
    if on_gpu(array):
        with array.device:
            return array.copy()
    return np.array(array, copy=True)


def arrived(mpi_comm, source, message):
    """The hook of ``mpi_comm``'s mailbox: a message whose GPU arrays
    follow over NCCL takes them now, in the order they were sent (the
    two-rank NCCL communicators of each direction are ``mpi_comm.pairs``,
    shared by every communicator on it, as its messages are)."""
    kind, header, held, _ = message
    if kind != 'arrays' or 'nccl' not in header:
        return message
    import cupy
    sent, pairs = header['nccl'], mpi_comm.pairs
    key = ('from', source, sent['device'])
    if sent['new']:
        old = pairs.pop(key, None)
        if old is not None:
            old.close()
        pairs[key] = NcclPair(1, sent['new'], cupy.cuda.Device().id,
                              mpi_comm.dask.timeout)
    pair = pairs[key]
    specs = [s for s, d in zip(header['specs'], header['direct']) if d]
    total = byte_layout([np.dtype(d).itemsize * int(np.prod(s))
                         for s, d in specs])[1]
    with cupy.cuda.Device(pair.device):
        buffer = cupy.empty(total, dtype=cupy.uint8)
    pair.pull(buffer)
    return kind, header, held, buffer


class ArrayCalls:
    """ChainerMN's array calls; the communicator provides ``comm`` (the
    rank's collectives), ``box`` (its tagged point-to-point messages,
    a :class:`~dasktrain.parallel.comm.mailbox.Mailbox`), ``mpi_comm``
    (whose ``pairs`` are the NCCL point-to-point communicators) and
    ``gpu_direct`` (whether every rank can send GPU arrays over NCCL)."""

    def _check_root(self, root):
        if not 0 <= root < self.size:
            raise ValueError(f'root must be a rank of 0..{self.size - 1}, '
                             f'got {root}')

    def _check_peer(self, rank, what):
        if not 0 <= rank < self.size or rank == self.rank:
            raise ValueError(f'{what} must be another rank of 0..'
                             f'{self.size - 1} than this one '
                             f'({self.rank}), got {rank}')

    # ------------------------------------------------ point to point

    @fatal
    def send(self, data, dest, tag=0):
        """Send an array, or a tuple or list of arrays (any shapes and
        dtypes, NumPy or CuPy), to rank ``dest`` with ``tag``; rank
        ``dest`` takes it with :meth:`recv` of this rank and tag."""
        self._check_peer(dest, 'dest')
        many = isinstance(data, (tuple, list))
        arrays = list(data) if many else [data]
        for a in arrays:
            if not hasattr(a, 'dtype'):
                raise TypeError('send takes an array or a tuple of arrays, '
                                f'got {type(a).__name__}')
        gpu = [on_gpu(a) for a in arrays]
        way = route(gpu, [a.nbytes for a in arrays], self.gpu_direct)
        direct = [g and way == 'nccl' for g in gpu]
        header = {'many': many, 'gpu': gpu, 'direct': direct,
                  'specs': [(a.shape, a.dtype.str) for a in arrays]}
        held = [None if d else host(a) for a, d in zip(arrays, direct)]
        if way != 'nccl':
            self.box.send(('arrays', header, held, None), dest, tag)
            return
        mine = [a for a, d in zip(arrays, direct) if d]
        device = mine[0].device.id
        pairs = self.mpi_comm.pairs
        pair = pairs.get(('to', dest, device))
        buffer = pack(mine, device)
        uid = None
        if pair is None:  # the first message of this direction: its id
            from cupy.cuda import nccl
            uid = nccl.get_unique_id()
        header['nccl'] = {'device': device, 'new': uid}
        self.box.send(('arrays', header, held, None), dest, tag)
        if pair is None:
            pair = pairs[('to', dest, device)] = NcclPair(
                0, uid, device, self.comm.timeout)
        pair.push(buffer)

    @fatal
    def recv(self, source, tag=0):
        """The array (or tuple of arrays, as sent) that rank ``source``
        sent with ``tag``. A GPU array arrives on the current device, as in
        ChainerMN; messages with other tags wait for their own recv."""
        self._check_peer(source, 'source')
        kind, header, held, buffer = self.box.recv(source, tag)
        if kind != 'arrays':
            raise TypeError(f'rank {source} sent an object with tag {tag}, '
                            'which recv_obj takes, not recv')
        arrays = list(held)
        if buffer is not None:
            import cupy
            specs = [s for s, d in zip(header['specs'], header['direct'])
                     if d]
            views = iter(unpack(buffer, specs))
            here = cupy.cuda.Device()
            for i, direct in enumerate(header['direct']):
                if direct:
                    view = next(views)
                    if view.device.id != here.id:
                        with here:
                            view = cupy.array(view)
                    arrays[i] = view
        for i, (gpu, direct) in enumerate(zip(header['gpu'],
                                              header['direct'])):
            if gpu and not direct:
                arrays[i] = land(arrays[i], True)
        return tuple(arrays) if header['many'] else arrays[0]

    # ------------------------------------------------ collectives

    def _others(self):
        return [p for p in range(self.size) if p != self.rank]

    def _exchange(self, send, receive):
        if self.size == 1:  # a Solo: nothing to send or read
            return {}
        return self.mpi_comm.small.exchange(send, receive)

    @fatal
    def bcast(self, x, root=0, max_buf_len=None):
        """Rank ``root``'s array on every rank (the root's own ``x``; on
        the others a new array, on the current device if it is a GPU
        array; their ``x`` is ignored)."""
        self._check_root(root)
        if self.size == 1:
            return x
        if self.rank == root:
            if isinstance(x, (tuple, list)):
                raise TypeError('bcast takes one array, not a tuple')
            message = (host(x), on_gpu(x))
            self._exchange(dict.fromkeys(self._others(), message), [])
            return x
        got, gpu = self._exchange({}, [root])[root]
        return land(got, gpu)

    @fatal
    def gather(self, x, root=0):
        """Every rank's array, in rank order, on ``root`` (in the root's
        array module, on its array's device); None elsewhere."""
        self._check_root(root)
        if self.rank != root:
            self._exchange({root: host(x)}, [])
            return None
        got = self._exchange({}, self._others())
        gpu = on_gpu(x)
        return tuple(copy(x) if p == root else land(got[p], gpu, x)
                     for p in range(self.size))

    @fatal
    def scatter(self, xs, root=0):
        """Rank ``root``'s ``xs[r]`` on each rank r: ``xs`` is a tuple of
        ``size`` arrays, or an array whose first axis has ``size`` rows
        (ignored off the root). Off the root the array arrives on the
        current device if the root's is a GPU array."""
        self._check_root(root)
        if self.rank != root:
            got, gpu = self._exchange({}, [root])[root]
            return land(got, gpu)
        if len(xs) != self.size:
            raise ValueError(f'scatter needs {self.size} arrays (one per '
                             f'rank), got {len(xs)}')
        parts = list(xs)
        self._exchange({p: (host(parts[p]), on_gpu(parts[p]))
                        for p in self._others()}, [])
        return copy(parts[root])

    @fatal
    def allgather(self, x):
        """Every rank's array, in rank order, on every rank (in ``x``'s
        array module, on its device)."""
        got = self.mpi_comm.small.allgather(host(x))
        gpu = on_gpu(x)
        return tuple(copy(x) if p == self.rank else land(a, gpu, x)
                     for p, a in enumerate(got))

    @fatal
    def alltoall(self, xs):
        """Rank p's ``xs[r]`` from every rank p, in rank order, on each
        rank r: ``xs`` holds ``size`` arrays (any shapes and dtypes); what
        arrives is in ``xs[0]``'s array module, on its device."""
        if len(xs) != self.size:
            raise ValueError(f'alltoall needs {self.size} arrays (one per '
                             f'rank), got {len(xs)}')
        others = self._others()
        got = self._exchange({p: host(xs[p]) for p in others}, others)
        like = xs[0]
        return tuple(copy(xs[p]) if p == self.rank else
                     land(got[p], on_gpu(like), like)
                     for p in range(self.size))

    @fatal
    def allreduce(self, x):
        """The sum of every rank's ``x`` (a new array on ``x``'s device)."""
        total = copy(x)
        self._summing([total]).allreduce([total])
        return total

    # ------------------------------------------------ objects

    @fatal
    def send_obj(self, obj, dest, tag=0):
        """Send any picklable ``obj`` to rank ``dest`` with ``tag``."""
        self._check_peer(dest, 'dest')
        self.box.send(('obj', obj, None, None), dest, tag)

    @fatal
    def recv_obj(self, source, status=None, tag=None):
        """The object rank ``source`` sent with ``tag`` (any tag: None or
        ``MPI.ANY_TAG``, as ChainerMN's default); ``status`` (an
        ``MPI.Status``) is set to its source and tag, as ChainerMN's."""
        self._check_peer(source, 'source')
        got, (kind, obj, _, _) = self.box.recv_tagged(
            source, ANY if tag is None or tag == ANY_TAG else tag)
        if kind != 'obj':
            raise TypeError(f'rank {source} sent {kind} with tag {got}, '
                            'which recv takes, not recv_obj')
        fill(status, source, got)
        return obj

    @fatal
    def bcast_obj(self, obj, max_buf_len=None, root=0):
        """Rank ``root``'s ``obj`` on every rank."""
        self._check_root(root)
        if root == 0:
            return self.mpi_comm.small.bcast(obj)
        if self.rank == root:
            self._exchange(dict.fromkeys(self._others(), obj), [])
            return obj
        return self._exchange({}, [root])[root]

    @fatal
    def gather_obj(self, obj, root=0):
        """Every rank's ``obj``, in rank order, on ``root``; else None."""
        self._check_root(root)
        if root == 0:
            return self.mpi_comm.small.gather(obj)
        if self.rank != root:
            self._exchange({root: obj}, [])
            return None
        got = self._exchange({}, self._others())
        got[root] = obj
        return [got[p] for p in range(self.size)]

