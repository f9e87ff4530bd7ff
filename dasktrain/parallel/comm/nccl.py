"""NCCL among the GPU ranks of a job, through CuPy.

:class:`NcclComm` sums a rank's GPU arrays with NCCL (one communicator per
rank, bound to its GPU) and passes everything else (host arrays, Python
objects) to the rank's host communicator, a
:class:`~dasktrain.parallel.comm.dask.DaskComm`, which also hands out
NCCL's unique id. Every wait is bounded (see the class), as every DaskComm
wait is.
"""
import time

from dasktrain.parallel.comm.base import (
    CollectiveError,
    Communicator,
    batches,
    packing,
    place,
    poll,
    signature,
)

# ncclResult_t values (nccl.h) that CuPy's NcclError carries as .status.
NCCL_IN_PROGRESS = 7  # a non-blocking communicator is still working
CUDA_NOT_READY = 600  # cudaErrorNotReady: a stream query while work runs


class NcclComm(Communicator):
    """Arrays on one GPU summed with NCCL; everything else over ``host``.

    The NCCL unique id is made on rank 0 and handed to the others through
    the communicator ``host``. The communicator belongs to GPU
    ``device`` (a CUDA ordinal of this process), which every call makes
    current, whatever the caller's current device.

    It is created non-blocking (``NCCL_COMM_BLOCKING=0``, set for the
    process, and inside an NCCL group): set-up and every call return at
    once, and this process polls the
    communicator's asynchronous error (``check_async_error``, which raises
    the real NCCL error) and the CUDA stream (whose query reports a CUDA
    error) until the work is done; at ``host.timeout`` it aborts the
    communicator and raises :class:`CollectiveError`. A peer that died
    after the id went out therefore fails this rank within the timeout
    rather than blocking it, and its GPU, in ``ncclCommInitRank`` forever.
    """

    solo = False
    sums_on_device = True
    _TYPES = {'float16': 'NCCL_FLOAT16', 'float32': 'NCCL_FLOAT32',
              'float64': 'NCCL_FLOAT64', 'int32': 'NCCL_INT32',
              'int64': 'NCCL_INT64'}

    def __init__(self, host, device):
        import os

        import cupy
        from cupy.cuda import nccl
        super().__init__(host.rank, host.size, host.timeout)
        self.host, self.device = host, int(device)
        self._nccl, self._cupy = nccl, cupy
        # NCCL reads this once per process (its parameters are cached), so
        # it is set for good: every dasktrain communicator is non-blocking
        # and every call here copes with 'in progress'.
        os.environ['NCCL_COMM_BLOCKING'] = '0'
        with cupy.cuda.Device(self.device):
            uid = host.bcast(nccl.get_unique_id() if host.rank == 0
                             else None)
            comm = nccl.NcclCommunicator.__new__(nccl.NcclCommunicator)
            # Inside a group, ncclCommInitRank only queues the set-up and
            # groupEnd returns at once (outside one, CuPy 13's plain
            # ncclCommInitRank waits for every peer, with no deadline). NCCL
            # stores the handle before returning, so it can be aborted.
            nccl.groupStart()
            try:
                self._call(comm.__init__, self.size, uid, self.rank)
            finally:
                self._call(nccl.groupEnd)
            self._comm = comm
            poll(self._settled, time.monotonic() + self.timeout,
                 f'NCCL set-up of rank {self.rank} of {self.size}',
                 self._abort)

    def _status(self, error):
        """The ncclResult_t of an error CuPy raised: NcclError(status), or
        KeyError(7), which CuPy's NcclError raises for the statuses its
        message table lacks (ncclInProgress among them)."""
        if isinstance(error, self._nccl.NcclError):
            return error.status
        if isinstance(error, KeyError) and len(error.args) == 1 and \
                isinstance(error.args[0], int):
            return error.args[0]
        return None

    def _call(self, fn, *args):
        """``fn(*args)``; a non-blocking 'in progress' is not an error."""
        try:
            fn(*args)
        except (self._nccl.NcclError, KeyError) as e:
            status = self._status(e)
            if status is None:
                raise
            if status != NCCL_IN_PROGRESS:
                raise CollectiveError(f'NCCL failed on rank {self.rank}: '
                                      f'{e}') from None

    def _settled(self):
        """True once the communicator has no operation in progress; raises
        CollectiveError for an asynchronous NCCL error."""
        try:
            self._comm.check_async_error()
        except (self._nccl.NcclError, KeyError) as e:
            status = self._status(e)
            if status is None:
                raise
            if status == NCCL_IN_PROGRESS:
                return False
            self._abort()
            raise CollectiveError(f'NCCL failed on rank {self.rank}: '
                                  f'{e}') from None
        return True

    def _done(self, stream):
        """True once ``stream`` finished; CUDA errors on it raise (a plain
        ``Stream.done`` reports them as 'not done')."""
        if not self._settled():
            return False
        status = self._cupy.cuda.runtime.streamQuery(stream.ptr)
        if status == CUDA_NOT_READY:
            return False
        if status != 0:
            self._abort()
            raise CollectiveError(
                f'CUDA error during an NCCL all-reduce on rank {self.rank}: '
                f'{self._cupy.cuda.runtime.CUDARuntimeError(status)}')
        return True

    def _abort(self):
        try:
            self._comm.abort()
        except Exception:  # already broken: nothing more to free
            pass

    def allreduce(self, arrays, check=False):
        """Sum ``arrays`` over ranks in place: those on this GPU with
        NCCL, the others over ``host``. With ``check``, the ranks first
        compare what they are about to sum (needed where counts could
        differ, e.g. optimizer state) and raise CollectiveError on a
        mismatch rather than hang or corrupt memory."""
        cupy = self._cupy
        if check:
            mine = signature(arrays, where=True)
            for rank, theirs in enumerate(self.host.allgather(mine)):
                if theirs != mine:
                    raise CollectiveError(
                        f'rank {rank} sums {len(theirs)} arrays '
                        f'{theirs[:3]}... where rank {self.rank} sums '
                        f'{len(mine)} {mine[:3]}...: the ranks are out of '
                        'step (different models or optimizer state)')
        gpu = [a for a in arrays if isinstance(a, cupy.ndarray) and
               a.dtype.name in self._TYPES]
        host = [a for a in arrays if not any(a is g for g in gpu)]
        if host:
            self.host.allreduce(host)
        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.get_current_stream()
            for _, members in batches(gpu):
                dtype = members[0].dtype
                # One buffer per batch on this GPU: a flat one here (a
                # gradient bucket's) is summed in place; else a copy, which
                # also makes non-contiguous views and other GPUs' arrays
                # contiguous here.
                itself = packing([place(a) for a in members]) == \
                    'itself' and members[0].device.id == self.device
                flat = members[0].reshape(-1) if itself else \
                    cupy.concatenate([
                        cupy.asarray(a.get() if a.device.id != self.device
                                     else a).ravel() for a in members])
                self._call(self._comm.allReduce, flat.data.ptr,
                           flat.data.ptr, flat.size,
                           getattr(self._nccl, self._TYPES[dtype.name]),
                           self._nccl.NCCL_SUM, stream.ptr)
                poll(lambda: self._done(stream),
                     time.monotonic() + self.timeout,
                     f'NCCL all-reduce on rank {self.rank}', self._abort)
                if itself:
                    continue
                start = 0
                for a in members:
                    part = flat[start:start + a.size].reshape(a.shape)
                    start += a.size
                    if a.device.id == self.device:
                        cupy.copyto(a, part)
                    else:  # via the host: also fills non-contiguous views
                        host_part = part.get()
                        with a.device:
                            cupy.copyto(a, cupy.asarray(host_part))
        return arrays

    def allgather(self, obj):
        return self.host.allgather(obj)

    def gather(self, obj):
        return self.host.gather(obj)

    def bcast(self, obj):
        return self.host.bcast(obj)

    def barrier(self):
        self.host.barrier()

    def send(self, obj, dest):
        self.host.send(obj, dest)

    def recv(self, source):
        return self.host.recv(source)

    def close(self):
        """Free the NCCL communicator (``host`` is closed by its owner)."""
        with self._cupy.cuda.Device(self.device):
            self._comm.destroy()
