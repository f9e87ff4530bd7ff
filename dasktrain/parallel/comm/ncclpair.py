"""GPU arrays from one rank to another over NCCL point to point.

A message of GPU arrays (any shapes and dtypes) travels as one buffer of
bytes: :func:`byte_layout` places each array at an offset aligned for any
dtype, :func:`pack` copies them there on the sender's GPU, one
``ncclSend`` carries it, one ``ncclRecv`` takes it on the receiver's GPU,
and :func:`unpack` views the arrays in it without copying. Nothing is
pickled and nothing passes through host memory.

:class:`NcclPair` is the NCCL communicator of two ranks for one direction
(the sender is its rank 0, the receiver its rank 1): NCCL matches a
pair's sends to its receives in the order they were made, so a direction
of its own keeps a rank's messages to a peer apart from the peer's to it,
and no send waits for the other direction. The sender makes the unique
id and hands it over with the message that first uses the pair (the
receiver joins when it reads that message). It is a
:class:`~dasktrain.parallel.comm.nccl.NcclComm` of two ranks, with its
non-blocking set-up and bounded waits: a dead peer fails this rank
within the timeout instead of blocking its GPU.

:func:`route` is the decision of how a message's GPU arrays travel.
CuPy (>= 13, NCCL >= 2.7 for ``send``/``recv``) is imported only when a
pair is made.
"""
import time

from dasktrain.parallel.comm.base import CollectiveError, poll
from dasktrain.parallel.comm.nccl import NcclComm

#: Bytes each array's offset in a message's buffer is a multiple of:
#: CUDA's allocation alignment, so every view is aligned for its dtype.
ALIGN = 256


def byte_layout(nbytes, align=ALIGN):
    """Each array's byte offset in one buffer and the buffer's size, for
    arrays of ``nbytes`` bytes, each starting at a multiple of ``align``.

    Examples
    --------
    >>> byte_layout([12, 0, 300, 8])
    ([0, 256, 256, 768], 776)
    """
    offsets, end = [], 0
    for n in nbytes:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + int(n)
    return offsets, end


def route(on_gpu, nbytes, nccl_everywhere):
    """How a message's GPU arrays travel: ``'nccl'`` (one buffer, NCCL
    point to point) where every rank has NCCL and they hold any bytes;
    ``'host'`` (copied to host memory and sent with the message's
    header) otherwise; None for a message of host arrays only.

    Examples
    --------
    >>> route([True, False], [8, 8], True), route([True], [8], False)
    ('nccl', 'host')
    >>> route([False], [8], True), route([True], [0], True)
    (None, 'host')
    """
    if not any(on_gpu):
        return None
    held = sum(n for g, n in zip(on_gpu, nbytes) if g)
    return 'nccl' if nccl_everywhere and held > 0 else 'host'


def pack(arrays, device):
    """One uint8 CuPy buffer on GPU ``device`` holding ``arrays`` (CuPy
    arrays, any GPU) at :func:`byte_layout`'s offsets."""
    import cupy
    offsets, total = byte_layout([a.nbytes for a in arrays])
    with cupy.cuda.Device(device):
        buffer = cupy.empty(total, dtype=cupy.uint8)
        for a, start in zip(arrays, offsets):
            if a.size:
                if a.device.id != device:  # a peer copy, onto this GPU
                    a = cupy.array(a)
                view = buffer[start:start + a.nbytes].view(a.dtype)
                # copyto also reads a non-contiguous view
                cupy.copyto(view.reshape(a.shape), a)
    return buffer


def unpack(buffer, specs):
    """The arrays of ``specs`` (``(shape, dtype)`` each) in ``buffer``
    (from :func:`pack` of arrays of those shapes and dtypes): views,
    nothing copied."""
    import numpy as np
    dtypes = [np.dtype(dtype) for _, dtype in specs]
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape, _ in specs]
    offsets, _ = byte_layout([n * d.itemsize for n, d in zip(sizes, dtypes)])
    return [buffer[start:start + n * d.itemsize].view(d).reshape(shape)
            for (shape, _), d, n, start in zip(specs, dtypes, sizes,
                                               offsets)]


class PairHost:
    """What :class:`~dasktrain.parallel.comm.nccl.NcclComm` asks of its
    host communicator, for two ranks that already share the unique id."""

    def __init__(self, rank, uid, timeout):
        self.rank, self.size, self.timeout = rank, 2, timeout
        self._uid = uid

    def bcast(self, obj):
        return self._uid


class NcclPair(NcclComm):
    """The NCCL communicator of one direction between two ranks.

    Parameters
    ----------
    rank : int
        0 on the sending rank, 1 on the receiving one.
    uid : tuple
        NCCL's unique id (``cupy.cuda.nccl.get_unique_id()``), made by the
        sender and handed to the receiver.
    device : int
        This rank's GPU (a CUDA ordinal of this process) for the pair.
    timeout : float
        Seconds the set-up or any one transfer may wait for the peer.
    """

    def __init__(self, rank, uid, device, timeout):
        super().__init__(PairHost(rank, uid, timeout), device)

    def _refuse_shared_gpu(self, host):
        """Nothing: a pair's ranks meet in a message, not a collective;
        NCCL itself refuses a pair on one GPU."""

    def _new_id(self):
        """None: the sender made the pair's id (``uid``), which
        :class:`PairHost` hands to both ranks."""
        return None

    def _transfer(self, call, buffer, what):
        """``call`` (the NCCL communicator's ``send`` or ``recv``) of
        ``buffer`` with the other rank, on this thread's current stream
        of the pair's GPU, as :class:`NcclComm` makes its sums: under its
        lock, counted as in flight (a close then aborts), waited for
        within the timeout."""
        cupy = self._cupy
        self._enter()
        try:
            with cupy.cuda.Device(self.device):
                stream = cupy.cuda.get_current_stream()
                if stream.ptr == cupy.cuda.runtime.streamPerThread:
                    # NCCL launches from a thread of its own, where this
                    # handle names another stream (see NcclComm._sum)
                    raise CollectiveError(
                        'NCCL cannot send on CuPy\'s per-thread default '
                        'stream: unset CUPY_CUDA_PER_THREAD_DEFAULT_STREAM '
                        'or make another stream current')
                with self._lock:
                    if self._failed:
                        raise CollectiveError(f'NCCL on rank {self.rank} '
                                              'of a pair was aborted')
                    self._call(call, buffer.data.ptr, buffer.size,
                               self._nccl.NCCL_UINT8, 1 - self.rank,
                               stream.ptr)
                poll(lambda: self._done(stream),
                     time.monotonic() + self.timeout,
                     f'NCCL {what} on rank {self.rank} of a pair',
                     self._abort)
        finally:
            self._leave()

    def push(self, buffer):
        """Send ``buffer`` (uint8, contiguous, on this pair's GPU) to the
        other rank; returns once it has been taken."""
        self._transfer(self._comm.send, buffer, 'send')

    def pull(self, buffer):
        """Fill ``buffer`` (uint8, contiguous, on this pair's GPU) with
        what the other rank pushes; returns once it has arrived."""
        self._transfer(self._comm.recv, buffer, 'recv')
