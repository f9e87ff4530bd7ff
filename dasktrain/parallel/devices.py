"""Which devices this process can train on, by Chainer specifier, and the
few CUDA runtime calls the rest of the package makes about them
(synchronise, streams and events, free memory), arrays moved between
them in order, and a :class:`Clock` that times work on them by those
events, read later (the devices' own time: hence here).

Decisions about *which* GPU ids a worker, job or rank gets live in
:mod:`dasktrain.parallel.gpus` (no CUDA needed); how many GPUs CuPy can
use here, and why none, in :mod:`dasktrain.parallel.cuda_check`; what
the CUDA driver says of them (UUIDs, contexts) in
:mod:`dasktrain.parallel.cuda_driver`; this module asks CuPy what is
there.
"""
import contextlib
import time
import traceback

import chainer
import numpy as np

from dasktrain.errors import UserError, plural
from dasktrain.parallel.cuda_check import check_gpus_usable, gpu_count
from dasktrain.parallel.cuda_driver import (
    driver_uuids,
    format_uuid,
    uuid_bytes,
)


class DeviceError(UserError, ValueError):
    """A device that was asked for is not there."""


def available_devices(count=None):
    """Chainer specifiers of the devices this process can use (``count``:
    its GPUs, default :func:`gpu_count`'s)."""
    if count is None:
        count, _ = gpu_count()
    return ['@numpy'] + [f'@cupy:{i}' for i in range(count)]


def resolve_devices(devices):
    """Chainer devices for GPU ids, ``'@cupy:N'``, ``'@numpy'`` or ``'cpu'``.

    An int ``n`` alone means GPUs ``0..n-1``, as in the seed post.
    """
    if isinstance(devices, (int, np.integer)) and not isinstance(devices,
                                                                 bool):
        if devices < 1:
            raise ValueError(f'devices must be >= 1 GPUs, got {devices}')
        devices = range(devices)
    elif isinstance(devices, str):
        devices = [devices]
    devices = list(devices)
    if not devices:
        raise ValueError('devices must name at least one device, got []')
    return [chainer.get_device(spec) for spec in check_available(devices)]


def check_available(devices):
    """The Chainer specifiers of ``devices`` (GPU ids, ``'@cupy:N'``,
    ``'@numpy'``, ``'cpu'``), each one this process can use; else one
    :class:`DeviceError` line naming it, why, and what is available (or
    :func:`~dasktrain.parallel.cuda_check.check_gpus_usable`'s line where
    the machine has GPUs CuPy cannot use). What :func:`resolve_devices`
    checks, without a Chainer device: a command asks it before it says
    anything else."""
    count, reason = gpu_count()
    available = available_devices(count)
    specs = []
    for d in devices:
        spec = (f'@cupy:{d}' if isinstance(d, (int, np.integer))
                else '@numpy' if d == 'cpu' else d)
        if spec not in available and spec.startswith('@cupy') and \
                not count:
            check_gpus_usable((spec,))  # GPUs CuPy cannot use: that line
        if spec not in available:
            why = reason if spec.startswith('@cupy') and reason else \
                f'this process sees {plural(count, "GPU")}' \
                if spec.startswith('@cupy') else 'no such device'
            raise DeviceError(f'device {d!r} is not available ({why}); '
                              f'available: {", ".join(available)}')
        specs.append(spec)
    return specs


def gpus_of(devices):
    """The distinct ``cupy.cuda.Device`` objects among Chainer devices."""
    found = {}
    for d in devices:
        if d.xp is not np:
            found.setdefault(d.device.id, d.device)
    return list(found.values())


def synchronize(devices):
    """Wait until every GPU among ``devices`` has finished its queued work
    (a no-op on the CPU): before a timer reads the clock, and before one
    GPU's arrays are read from another."""
    for gpu in gpus_of(devices):
        gpu.synchronize()


class Clock:
    """Communication time: seconds that :meth:`timed` work took, summed in
    :attr:`total` (merging gradients, syncing and mixing replicas, and the
    waits for sums from a communication thread), without making the host
    wait for a GPU.

    On the CPU each call's wall time. On GPUs a CUDA event is recorded on
    this thread's current stream of each GPU before and after the work,
    and their elapsed time read once both are done: when :attr:`total` is
    read, or as older calls' events complete. For work queued on those
    streams (a merge's copies and kernels) that is its GPU time; for a
    wait on another thread (a side stream's all-reduce) it is the time the
    GPU sat idle between the last kernel before and the first after,
    i.e. the communication the step did not hide, and none where the host
    came back before the GPU ran out of work. A call spanning several GPUs
    counts its slowest. Synchronising the stream instead, every step,
    kept the host from running ahead of the GPU; a device-wide wait would
    also wait for the side stream and count nothing.
    """

    #: Calls whose events are kept before the completed ones are read.
    KEEP = 64

    def __init__(self, devices):
        self.devices = devices
        self._gpus = gpus_of(devices)
        self._total = 0.0
        self._pending = []  # per call on GPUs: [(start, end) per GPU]

    @property
    def total(self):
        self._read(wait=True)
        return self._total

    @total.setter
    def total(self, seconds):
        self._pending = []
        self._total = float(seconds)

    def _marks(self):
        import cupy
        marks = []
        for gpu in self._gpus:
            with gpu:  # an event belongs to the device current at record
                event = cupy.cuda.Event()  # timing on: it is read later
                event.record(cupy.cuda.get_current_stream())
                marks.append(event)
        return marks

    def _read(self, wait):
        """Add the calls whose events are done (all, with ``wait``)."""
        if not self._pending:  # the CPU's, or all read already
            return
        import cupy
        while self._pending:
            pairs = self._pending[0]
            if wait:
                for _, end in pairs:
                    end.synchronize()
            elif not all(end.done for _, end in pairs):
                return
            self._pending.pop(0)
            self._total += max(cupy.cuda.get_elapsed_time(start, end)
                               for start, end in pairs) / 1000

    def timed(self, work):
        """``work()``'s result, its time added to :attr:`total`."""
        if not self._gpus:
            began = time.perf_counter()
            result = work()
            self._total += time.perf_counter() - began
            return result
        start = self._marks()
        result = work()
        self._pending.append(list(zip(start, self._marks())))
        if len(self._pending) > self.KEEP:
            self._read(wait=False)
        return result


def mark(device):
    """A CUDA event recorded on ``device``'s current stream in this thread:
    it completes once the work queued there so far is done (e.g. the kernels
    that computed a bucket of gradients). None on the CPU, where an array is
    final once the call that wrote it returned."""
    if device.xp is np:
        return None
    import cupy
    with device.device:  # an event belongs to the device current at record
        event = cupy.cuda.Event(disable_timing=True)  # a marker, no clock
        event.record(cupy.cuda.get_current_stream())
        return event


def after(device, event):
    """Make this thread's current stream on ``device`` wait, on the GPU,
    for ``event`` (from :func:`mark`, perhaps of another GPU: CUDA's
    ``cudaStreamWaitEvent`` takes an event of any device): what is queued
    there next starts once the work before the event is done. The host
    does not wait. A no-op on the CPU or without an event."""
    if event is None or device.xp is np:
        return
    import cupy
    with device.device:
        cupy.cuda.get_current_stream().wait_event(event)


class SideStream:
    """A non-blocking CUDA stream of ``device``, for work that runs on
    another thread while this one goes on (all-reducing gradients during
    the backward pass). A no-op on the CPU.

    ``non_blocking``: CuPy's default (legacy null) stream synchronises with
    every blocking stream, so the backward kernels queued on it would wait
    for the all-reduce and the other way round; a non-blocking stream runs
    beside them and orders itself only through the events it waits for.
    """

    def __init__(self, device):
        self.device = device
        self._stream = None

    @contextlib.contextmanager
    def after(self, event, wait=True):
        """Inside the block, this thread's current device and stream are
        ``device`` and the side stream, whose work starts after ``event``
        (from :func:`mark`); on leaving, this thread waits until that work
        is done, so the arrays it wrote can be read on any stream. With
        ``wait=False`` it leaves at once (more work follows on the side
        stream, and a later block waits for all of it), except after an
        error: nothing may still write then."""
        if self.device.xp is np:
            yield
            return
        import cupy
        with self.device.device:
            if self._stream is None:
                self._stream = cupy.cuda.Stream(non_blocking=True)
            stream = self._stream
            if event is not None:
                stream.wait_event(event)
            failed = True
            try:
                with stream:
                    yield
                failed = False
            finally:
                if wait or failed:
                    stream.synchronize()


@contextlib.contextmanager
def frames_released():
    """Within: an exception leaving the block has the locals of its
    traceback's frames cleared (its lines stay, to print), so that a
    failed run's model, held by those frames, can be collected and
    :func:`free_gpu_memory` return its GPU memory while the exception is
    still on its way up."""
    try:
        yield
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)
        raise


def free_gpu_memory(ids):
    """Return CuPy's cached blocks on the GPUs ``ids`` (CUDA ordinals) to
    the driver, so that the next job on them starts with the memory free.
    A no-op where CuPy was never used."""
    import gc
    import sys
    cupy = sys.modules.get('cupy')
    if cupy is None or not ids:
        return
    gc.collect()  # Chainer's graphs hold arrays in reference cycles
    pool, pinned = cupy.get_default_memory_pool(), \
        cupy.get_default_pinned_memory_pool()
    for i in ids:
        with cupy.cuda.Device(i):
            cupy.cuda.Device(i).synchronize()
            pool.free_all_blocks()
    pinned.free_all_blocks()


def device_uuids(devices):
    """``{'@cupy:N': 'GPU-...'}`` for the GPUs among ``devices``: which
    physical GPU a job really used, for its log."""
    found = {}
    for gpu in gpus_of(devices):
        raw = uuid_bytes(gpu.id)
        if raw is not None:
            found[f'@cupy:{gpu.id}'] = format_uuid(raw)
    return found


def own_gpu(devices, machine, env=None):
    """The GPU a rank on ``devices`` holds as its own, as the ranks of a
    job compare it (:func:`~dasktrain.parallel.gpus.rank_gpu`): on
    ``machine``, by its ``CUDA_VISIBLE_DEVICES`` entry (of ``env``,
    default this process's) and, for this process, the driver's UUID;
    None for a rank on the CPU, which asks the driver nothing."""
    from dasktrain.parallel.gpus import rank_gpu, visible_gpus
    if rank_gpu(devices, machine, ()) is None:
        return None
    uuids = driver_uuids() if env is None else None
    return rank_gpu(devices, machine, visible_gpus(env), uuids)


# ------------------------------------------------- arrays across devices

def common_dtype(arrays):
    """The arrays' one dtype, or float64 where they differ (exact for
    every float and int32 value)."""
    kinds = {a.dtype for a in arrays}
    return kinds.pop() if len(kinds) == 1 else np.dtype(np.float64)


def transfer(arrays, src, dst):
    """Copies on ``dst`` of ``arrays`` (all on ``src``), or the arrays
    themselves when ``src`` is ``dst``.

    Between devices they travel as one flat buffer (concatenated on
    ``src``, one copy, split into views on ``dst``): one transfer, not one
    per array. Views come in :func:`common_dtype`. Ordered by events on
    this thread's streams, the host never waiting: CuPy's cross-device
    copy (``_core/core.pyx``, ``ndarray.copy``:
    ``copy_from_device_async`` with ``dst`` current) runs on ``dst``'s
    current stream, which first waits for the kernel that wrote ``flat``
    on ``src``'s; ``src``'s stream then waits for the copy, since CuPy's
    pool hands ``flat``'s block, once freed, to the next allocation on the
    stream it was allocated on (``cuda/memory.pyx``, arenas by stream).
    What reads the views on ``dst``'s stream in this thread is ordered
    after the copy; another thread marks that stream first (:func:`mark`).
    """
    arrays = list(arrays)
    if src == dst or not arrays:
        return arrays
    dtype = common_dtype(arrays)
    with chainer.using_device(src):
        flat = src.xp.concatenate([a.ravel().astype(dtype, copy=False)
                                   for a in arrays])
    after(dst, mark(src))
    with chainer.using_device(dst):
        moved = dst.send(flat)
    after(src, mark(dst))
    views, start = [], 0
    for a in arrays:
        views.append(moved[start:start + a.size].reshape(a.shape))
        start += a.size
    return views


def copy_into(targets, sources, device):
    """``targets[i][...] = sources[i]`` with ``device`` (theirs) current:
    CuPy launches a kernel on the current device, and one reading another
    device's memory needs peer access (a PerformanceWarning, or an error
    without it)."""
    with chainer.using_device(device):
        for target, source in zip(targets, sources):
            device.xp.copyto(target, source, casting='unsafe')


def input_dtype(link):
    """The dtype floating inputs of ``link`` take: float16 under Chainer's
    mixed16 (its activations' dtype, whatever parameter comes first: a
    BatchNormalization's are float32), else its parameters' (float64
    under ``CHAINER_DTYPE=float64``), else Chainer's default dtype.

    Examples
    --------
    >>> import chainer.links as L
    >>> input_dtype(L.Linear(3, 2))
    dtype('float32')
    >>> with chainer.using_config('dtype', chainer.mixed16):
    ...     input_dtype(L.BatchNormalization(3))
    dtype('float16')
    """
    if chainer.config.dtype is chainer.mixed16:
        return np.dtype(np.float16)
    for param in link.params():
        if param.array is not None and param.array.dtype.kind == 'f':
            return param.array.dtype
    return np.dtype(chainer.get_dtype())
