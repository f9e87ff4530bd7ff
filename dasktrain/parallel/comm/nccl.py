"""NCCL among the GPU ranks of a job, through CuPy.

:class:`NcclComm` sums a rank's GPU arrays with NCCL (one communicator per
rank, bound to its GPU) and passes everything else (host arrays, Python
objects) to the rank's host communicator, a
:class:`~dasktrain.parallel.comm.dask.DaskComm`, which also hands out
NCCL's unique id. Every wait is bounded (see the class), as every DaskComm
wait is, and so is the communicator's end: :meth:`NcclComm.close` aborts or
destroys it within :data:`CLOSE_DEADLINE`, after which the process exits
rather than hold its GPU forever.
"""
import logging
import os
import sys
import threading
import time

from dasktrain.parallel.comm.base import CollectiveError, Communicator, poll
from dasktrain.parallel.comm.batches import (
    batches,
    packing,
    place,
    scaled,
    signature,
)

logger = logging.getLogger(__name__)

# ncclResult_t values (nccl.h) that CuPy's NcclError carries as .status.
NCCL_IN_PROGRESS = 7  # a non-blocking communicator is still working
CUDA_NOT_READY = 600  # cudaErrorNotReady: a stream query while work runs

#: Seconds ncclCommAbort or ncclCommDestroy may take before the process
#: exits (status :data:`STUCK_EXIT`): a communicator that cannot be freed
#: would keep its GPU, and the queue would hand that GPU to the next job.
CLOSE_DEADLINE = 30.0
STUCK_EXIT = 70  # EX_SOFTWARE

_ENV_LOCK = threading.Lock()


def non_blocking_environment(environ=os.environ):
    """Set ``NCCL_COMM_BLOCKING=0`` in ``environ`` unless it already is,
    under a lock: NCCL reads it with ``getenv`` (once per process), and a
    ``putenv`` racing a ``getenv`` in another thread is undefined in
    glibc. Ranks as threads of one worker each make a communicator; only
    the first writes the variable, before any of them exists.

    Examples
    --------
    >>> env = {}
    >>> non_blocking_environment(env), non_blocking_environment(env)
    (True, False)
    >>> env
    {'NCCL_COMM_BLOCKING': '0'}
    """
    with _ENV_LOCK:
        if environ.get('NCCL_COMM_BLOCKING') == '0':
            return False
        environ['NCCL_COMM_BLOCKING'] = '0'
        return True


def ending(failed, busy, raising):
    """How a communicator ends: ``'abort'`` where it failed, a call is
    still in flight (a communication thread polling it) or the caller is
    raising (a peer may be inside a collective this rank never joins:
    ncclCommDestroy would first finish every operation, and wait for the
    peer forever), else ``'destroy'``, which lets the peers' operations
    end cleanly.

    Examples
    --------
    >>> ending(False, 0, False), ending(False, 1, False)
    ('destroy', 'abort')
    >>> ending(True, 0, False), ending(False, 0, True)
    ('abort', 'abort')
    """
    return 'abort' if failed or busy or raising else 'destroy'


def _exit_stuck(what):  # replaced by tests; the rank's process ends
    logger.critical('%s did not return within %.0f s: ending this process '
                    'so that its GPU is freed', what, CLOSE_DEADLINE)
    logging.shutdown()
    os._exit(STUCK_EXIT)


def within(call, seconds, what, stuck=None):
    """Run ``call()`` on a daemon thread; if it has not returned after
    ``seconds``, call ``stuck(what)`` (default: log and end the process).
    Returns True when ``call`` returned in time. ``call``'s errors are
    logged, not raised: it frees what is already failing.

    Examples
    --------
    >>> within(lambda: None, 1.0, 'nothing')
    True
    >>> within(lambda: time.sleep(1), 0.01, 'a nap', stuck=print)
    a nap
    False
    """
    done = threading.Event()

    def run():
        try:
            call()
        except Exception:  # the communicator is gone either way
            logger.exception('%s failed', what)
        finally:
            done.set()
    threading.Thread(target=run, daemon=True, name='dasktrain-nccl-end') \
        .start()
    if done.wait(seconds):
        return True
    (stuck or _exit_stuck)(what)
    return False


class NcclComm(Communicator):
    """Arrays on one GPU summed with NCCL; everything else over ``host``.

    The NCCL unique id is made on rank 0 and handed to the others through
    the communicator ``host``. The communicator belongs to GPU
    ``device`` (a CUDA ordinal of this process), which every call makes
    current, whatever the caller's current device.

    It is created non-blocking (``NCCL_COMM_BLOCKING=0``, set once for the
    process, and inside an NCCL group): set-up and every call return at
    once, and this process polls the communicator's asynchronous error
    (``check_async_error``, which raises the real NCCL error) and the CUDA
    stream (whose query reports a CUDA error) until the work is done; at
    ``host.timeout`` it aborts the communicator and raises
    :class:`CollectiveError`. A peer that died after the id went out
    therefore fails this rank within the timeout rather than blocking it,
    and its GPU, in ``ncclCommInitRank`` forever.

    Every NCCL call holds a lock, so that an abort from another thread (a
    close while a communication thread still polls) never frees the
    communicator under a call; the polling thread's next query then fails
    at once. :meth:`allreduce_queued` queues sums without waiting (gradient
    buckets one after another, NCCL ordering them on the stream), and
    :meth:`finish_queued` waits for them all.
    """

    solo = False
    sums_on_device = True
    _TYPES = {'float16': 'NCCL_FLOAT16', 'float32': 'NCCL_FLOAT32',
              'float64': 'NCCL_FLOAT64', 'int32': 'NCCL_INT32',
              'int64': 'NCCL_INT64'}

    def __init__(self, host, device):
        import cupy
        from cupy.cuda import nccl
        super().__init__(host.rank, host.size, host.timeout)
        self.host, self.device = host, int(device)
        self._nccl, self._cupy = nccl, cupy
        self._lock = threading.Lock()   # around every NCCL call
        self._busy = 0                  # calls in flight, on any thread
        self._busy_lock = threading.Lock()
        self._failed = False
        self._queued = {}               # streams of queued sums, by ptr
        # NCCL reads it once per process (its parameters are cached), so
        # it is set for good: every dasktrain communicator is non-blocking
        # and every call here copes with 'in progress'.
        non_blocking_environment()
        self._refuse_shared_gpu(host)
        with cupy.cuda.Device(self.device):
            uid = host.bcast(self._new_id() if host.rank == 0 else None)
            comm = nccl.NcclCommunicator.__new__(nccl.NcclCommunicator)
            # Inside a group, ncclCommInitRank only queues the set-up and
            # groupEnd returns at once (outside one, CuPy 13's plain
            # ncclCommInitRank waits for every peer, with no deadline). NCCL
            # stores the handle before returning, so it can be aborted.
            self._comm = comm
            try:
                with self._lock:
                    nccl.groupStart()
                    try:
                        self._call(comm.__init__, self.size, uid, self.rank)
                    finally:
                        self._call(nccl.groupEnd)
                poll(self._settled, time.monotonic() + self.timeout,
                     f'NCCL set-up of rank {self.rank} of {self.size}',
                     self._abort)
            except BaseException:
                # Aborted, not left to CuPy's __dealloc__, whose destroy
                # frees nothing of a failed communicator (and hides it)
                self._abort()
                raise

    def _refuse_shared_gpu(self, host):
        """Before NCCL is set up, the ranks of a communicator of several
        compare their GPUs (one all-gather over ``host``): GpuError on
        every rank, in one line, where two would be on one, which NCCL
        does not support (it refuses, or an older one hangs)."""
        if host.size < 2:
            return
        from dasktrain.parallel.devices import own_gpu
        from dasktrain.parallel.gpus import refuse_shared_gpu
        refuse_shared_gpu(
            host.allgather(own_gpu((self.device,), host.machine)),
            remedy='under `dasktrain launch --devices 0,1` a ChainerMN '
            'script takes GPU comm.intra_rank')

    # -------------------------------------------------- NCCL's answers


    def _new_id(self):
        """Rank 0's unique id for the others: each ``get_unique_id`` starts
        a bootstrap root thread in NCCL that lives until the communicator
        made from it is set up, so only an id that is used is made."""
        return self._nccl.get_unique_id()
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
        """``fn(*args)`` (the caller holds the lock); a non-blocking 'in
        progress' is not an error."""
        try:
            fn(*args)
        except (self._nccl.NcclError, KeyError) as e:
            status = self._status(e)
            if status is None:
                raise
            if status != NCCL_IN_PROGRESS:
                self._failed = True
                raise CollectiveError(f'NCCL failed on rank {self.rank}: '
                                      f'{e}') from None

    def _settled(self):
        """True once the communicator has no operation in progress; raises
        CollectiveError for an asynchronous NCCL error (or an aborted
        communicator)."""
        if self._failed:  # before the lock: an abort may still hold it
            raise CollectiveError(f'NCCL on rank {self.rank} was aborted')
        with self._lock:
            if self._failed:
                raise CollectiveError(f'NCCL on rank {self.rank} was '
                                      'aborted')
            try:
                self._comm.check_async_error()
            except (self._nccl.NcclError, KeyError) as e:
                status = self._status(e)
                if status is None:
                    raise
                if status == NCCL_IN_PROGRESS:
                    return False
                error = e
            else:
                return True
        self._abort()  # outside the lock, bounded
        raise CollectiveError(f'NCCL failed on rank {self.rank}: '
                              f'{error}') from None

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

    def _abort_locked(self):
        self._failed = True
        try:
            self._comm.abort()
        except Exception:  # already broken: nothing more to free
            pass

    def _abort(self):
        """Abort (once), within :data:`CLOSE_DEADLINE`: ncclCommAbort
        synchronises NCCL's own streams and frees its memory, which a hung
        GPU may not let it do."""
        self._failed = True  # pollers on other threads stop at once

        def abort():
            with self._cupy.cuda.Device(self.device), self._lock:
                self._abort_locked()
        within(abort, CLOSE_DEADLINE, f'NCCL abort on rank {self.rank}')

    # -------------------------------------------------- the sums

    def _enter(self):
        with self._busy_lock:
            self._busy += 1

    def _leave(self):
        with self._busy_lock:
            self._busy -= 1

    def allreduce(self, arrays, check=False, scale=None):
        """Sum ``arrays`` over ranks in place: those on this GPU with
        NCCL, the others over ``host``; returns once the sums are done.
        With ``check``, the ranks first compare what they are about to
        sum (needed where counts could differ, e.g. optimizer state) and
        raise CollectiveError on a mismatch rather than hang or corrupt
        memory. ``scale``: each GPU array times it after its sum, on its
        device's current stream (where its sum was copied back)."""
        gpu = self._sum(arrays, check, wait=True, scale=scale)
        scaled(gpu, scale)
        return arrays

    def allreduce_queued(self, arrays):
        """:meth:`allreduce`, returning once the sums are queued on this
        thread's current stream of this GPU (they are complete after
        :meth:`finish_queued`): NCCL orders queued sums on the stream, so
        the next bucket goes without waiting for this one. Arrays on
        another GPU or the host are summed at once."""
        self._sum(arrays, False, wait=False)
        return arrays

    def finish_queued(self):
        """Wait, within the timeout, until every sum queued by
        :meth:`allreduce_queued` is done."""
        streams = list(self._queued.values())
        self._enter()
        try:
            with self._cupy.cuda.Device(self.device):  # streams' device
                for stream in streams:
                    poll(lambda s=stream: self._done(s),
                         time.monotonic() + self.timeout,
                         f'NCCL all-reduce on rank {self.rank}',
                         self._abort)
            self._queued = {}
        finally:
            self._leave()

    def _enqueue(self, flat, stream):
        """One NCCL all-reduce of ``flat`` in place, on ``stream``; back
        once NCCL has queued it (a non-blocking communicator may answer
        'in progress' first, and takes no other call until it is
        settled)."""
        with self._lock:
            if self._failed:
                raise CollectiveError(f'NCCL on rank {self.rank} was '
                                      'aborted')
            self._call(self._comm.allReduce, flat.data.ptr, flat.data.ptr,
                       flat.size,
                       getattr(self._nccl, self._TYPES[flat.dtype.name]),
                       self._nccl.NCCL_SUM, stream.ptr)
        poll(self._settled, time.monotonic() + self.timeout,
             f'NCCL all-reduce on rank {self.rank}', self._abort)

    def _sum(self, arrays, check, wait, scale=None):
        """Sum ``arrays`` (host arrays times ``scale`` too); the GPU arrays
        that NCCL summed."""
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
            self.host.allreduce(host, scale=scale)
        self._enter()
        try:
            with cupy.cuda.Device(self.device):
                stream = cupy.cuda.get_current_stream()
                if stream.ptr == cupy.cuda.runtime.streamPerThread:
                    # NCCL (2.23+) launches from a thread of its own, where
                    # this handle names another stream: the sum would be
                    # unordered with this thread's work
                    raise CollectiveError(
                        'NCCL cannot sum on CuPy\'s per-thread default '
                        'stream: unset CUPY_CUDA_PER_THREAD_DEFAULT_STREAM '
                        'or make another stream current')
                for _, members in batches(gpu):
                    self._batch(members, stream, wait)
        finally:
            self._leave()
        return gpu

    def _batch(self, members, stream, wait):
        """Sum one batch (arrays of one dtype) through one flat buffer on
        this GPU: a bucket's flat buffer in place, else a copy (which also
        makes non-contiguous views and other GPUs' arrays contiguous
        here), copied back on this stream."""
        cupy = self._cupy
        itself = packing([place(a) for a in members]) == 'itself' and \
            members[0].device.id == self.device
        elsewhere = any(a.device.id != self.device for a in members)
        if elsewhere:
            # Another GPU's arrays are read after the work queued there
            # (by whichever stream wrote them): rare, several GPUs per rank
            for gpu in {a.device.id for a in members} - {self.device}:
                cupy.cuda.Device(gpu).synchronize()
        flat = members[0].reshape(-1) if itself else cupy.concatenate([
            cupy.asarray(a.get() if a.device.id != self.device else a)
            .ravel() for a in members])
        self._enqueue(flat, stream)
        if wait or elsewhere:  # copies to another GPU go by the host
            poll(lambda: self._done(stream),
                 time.monotonic() + self.timeout,
                 f'NCCL all-reduce on rank {self.rank}', self._abort)
        else:
            self._queued[stream.ptr] = stream
        if itself:
            return
        start = 0
        for a in members:
            part = flat[start:start + a.size].reshape(a.shape)
            start += a.size
            if a.device.id == self.device:
                cupy.copyto(a, part)  # on the stream, after the sum
            else:  # via the host: also fills non-contiguous views
                host_part = part.get()
                with a.device:
                    cupy.copyto(a, cupy.asarray(host_part))

    # -------------------------------------------------- the rest

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

    def _clean(self):
        """Whether the communicator reports no asynchronous error (the
        caller holds the lock): ncclCommDestroy of one that does frees
        nothing, and CuPy, ignoring its result, forgets the handle."""
        if self._failed:
            return False
        try:
            self._comm.check_async_error()
        except (self._nccl.NcclError, KeyError):
            return False
        return True

    def close(self):
        """Free the NCCL communicator (``host`` is closed by its owner):
        aborted where a call failed or is still in flight on another
        thread, or where ``close`` runs while an exception propagates (a
        ``finally`` on an error path), else destroyed (:func:`ending`).
        Either runs within :data:`CLOSE_DEADLINE`, else the process exits.
        After an abort, threads still polling fail at their next query;
        they are given the deadline to leave."""
        raising = sys.exc_info()[0] is not None
        way = ending(self._failed, self._busy or self._queued, raising)
        cupy = self._cupy

        def end():
            with cupy.cuda.Device(self.device), self._lock:
                if way == 'destroy' and self._clean():
                    self._comm.destroy()
                else:
                    self._abort_locked()
        within(end, CLOSE_DEADLINE, f'NCCL {way} on rank {self.rank}')
        deadline = time.monotonic() + CLOSE_DEADLINE
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.01)  # pollers see the abort at their next query
