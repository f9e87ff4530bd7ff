"""GPU arrays summed on the host: staged through one flat host buffer per
batch (:func:`to_host`, :func:`from_host`), pinned memory of its own for
the arrays of one GPU (:class:`PinnedBuffer`), and which of those buffers
a communicator keeps (:class:`Staging`).

:class:`Staging` decides, as a pure function of the keys asked for round
by round (a round: one all-reduce), which buffers are made, reused and
freed; what a buffer is and how it is made and freed are the callables
it is given (:class:`~dasktrain.parallel.comm.dask.DaskComm`'s:
:class:`PinnedBuffer`; a test's: records of its calls). CuPy is imported
only where GPU arrays are staged. Owns the staging; what travels
between the ranks, and how, is the communicator's.
"""
import collections
import contextlib

import numpy as np

from dasktrain.parallel.comm.batches import packing, place

#: Keys no longer kept whose last use and gap are still remembered, so
#: that one needed again is kept from then on.
REMEMBERED = 4096
#: Gaps a buffer may go unused before it is freed: a period skipped once
#: (an epoch's last, smaller batch in place of a bucket's) keeps it.
SLACK = 2


class Staging:
    """Buffers by key, kept while the sums keep using them.

    The rule: each key's *gap* is the longest number of rounds seen
    between two of its uses (1 for a key used once). At the start of a
    round, every kept buffer whose key has not been used for more than
    :data:`SLACK` times its gap is freed; a buffer the round asks for is
    never freed within it. A key needed again after its buffer was freed
    learns the longer gap, and is kept from then on.

    So a job's steady pattern (the same gradient buckets, one all-reduce
    each, every step) has each buffer made at most twice, in its first
    steps (its second use teaches its gap), and never again, even when
    one step skips it; after sizes change (another bucket plan, arrays
    of varying length), the buffers of sizes no longer asked for are
    freed two periods later; and sizes that never repeat cost the
    buffers of three rounds at most. Memory is bounded by the buffers
    the recent rounds used, never by every size ever seen.

    Parameters
    ----------
    allocate : callable
        ``allocate(key)``: a new buffer for ``key``.
    release : callable
        ``release(key, buffer)``: called once for each buffer freed (it
        waits for the buffer's last copy); the buffer is dropped after.
    remembered : int
        Keys no longer kept whose history is remembered.

    Examples
    --------
    >>> made, freed = [], []
    >>> staging = Staging(lambda key: made.append(key) or key,
    ...                   lambda key, buffer: freed.append(key))
    >>> def step(buckets):  # an all-reduce each
    ...     for bucket in buckets:
    ...         staging.next_round()
    ...         _ = staging.take(bucket)
    >>> for _ in range(3):
    ...     step(['a', 'b'])
    >>> made, freed, staging.keys()
    (['a', 'b'], [], ['a', 'b'])
    >>> for _ in range(3):
    ...     step(['c', 'b'])
    >>> made, freed, staging.keys()
    (['a', 'b', 'c'], ['a'], ['c', 'b'])
    """

    def __init__(self, allocate, release, remembered=REMEMBERED):
        self.allocate, self.release = allocate, release
        self.remembered = remembered
        self.now = 0                # rounds begun
        self._kept = {}             # key -> buffer
        # key -> (round of its last use, its gap), least recently used first
        self._seen = collections.OrderedDict()

    def next_round(self):
        """Begin a round: free each kept buffer whose key has not been used
        for more rounds than its gap."""
        self.now += 1
        for key in [k for k in self._kept if self._stale(k)]:
            self._free(key)

    def take(self, key):
        """The buffer of ``key`` for this round: the kept one, else a new
        one (``allocate``)."""
        last = self._seen.pop(key, None)
        gap = 1 if last is None else max(last[1], self.now - last[0])
        self._seen[key] = (self.now, gap)
        if key not in self._kept:
            self._kept[key] = self.allocate(key)
        self._forget()
        return self._kept[key]

    def keys(self):
        """The keys of the buffers kept now, least recently used first."""
        return [k for k in self._seen if k in self._kept]

    def buffers(self):
        """The buffers kept now, as :meth:`keys` orders them."""
        return [self._kept[k] for k in self.keys()]

    def used(self):
        """The buffers this round has asked for."""
        return [self._kept[k] for k, (last, _) in self._seen.items()
                if last == self.now and k in self._kept]

    def clear(self):
        """Free every buffer (the communicator closes)."""
        for key in list(self._kept):
            self._free(key)

    def _stale(self, key):
        last, gap = self._seen[key]
        return self.now - last > SLACK * gap

    def _free(self, key):
        buffer = self._kept.pop(key)
        self.release(key, buffer)

    def _forget(self):
        """Forget the oldest keys no longer kept beyond ``remembered``."""
        extra = len(self._seen) - len(self._kept) - self.remembered
        for key in list(self._seen):
            if extra <= 0:
                break
            if key not in self._kept:
                del self._seen[key]
                extra -= 1


def to_host(members, staging=None):
    """One flat host buffer holding ``members`` (one dtype) and how it was
    made (:func:`~dasktrain.parallel.comm.batches.packing`, and the GPU
    buffer it came from): a flat host array is the buffer itself; GPU
    arrays of one GPU travel in one transfer, not one each, into
    ``staging(dtype, size, device)``'s buffer where given (pinned memory: both
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
        out = None if staging is None else staging(flat.dtype, flat.size,
                                                   flat.device.id)
        return flat.get(out=out), (how, flat)  # get() waits for its copy


class PinnedBuffer:
    """A staging buffer (:class:`~dasktrain.parallel.comm.staging.Staging`'s,
    by key ``(batch position, dtype, size, GPU)``): pinned host memory of
    its own (``cudaHostAlloc``, portable as CuPy's own; freed with
    ``cudaFreeHost`` when dropped, not kept by CuPy's pool), and a CUDA
    event recorded after the last copy out of it, which every reuse and
    the end wait for."""

    def __init__(self, key):
        import cupy
        _, dtype, size, self.device = key
        dtype = np.dtype(dtype)
        if size:
            memory = cupy.cuda.PinnedMemory(
                size * dtype.itemsize, cupy.cuda.runtime.hostAllocPortable)
            self.array = np.ndarray(size, dtype, buffer=cupy.cuda.
                                    PinnedMemoryPointer(memory, 0))
        else:
            self.array = np.empty(0, dtype)
        with cupy.cuda.Device(self.device):
            self.event = cupy.cuda.Event(disable_timing=True)

    def copied(self):
        """Mark the end of the copy back to the GPU just queued (on this
        thread's stream of the buffer's GPU, where ``set`` queued it)."""
        import cupy
        with cupy.cuda.Device(self.device):
            self.event.record()

    def ready(self):
        """Wait for the last copy out of the buffer (long done, as a rule:
        a copy into it on another stream must not overtake it)."""
        self.event.synchronize()

    @staticmethod
    def free(key, pinned):
        """Before the buffer is dropped (its memory freed): its last copy
        out is done (a GPU in error copies nothing more: it just goes)."""
        with contextlib.suppress(Exception):
            pinned.ready()


def from_host(members, host, made):
    """Write the summed flat ``host`` buffer back into ``members``, as
    :func:`to_host` ``made`` it."""
    how, flat = made
    if how == 'itself' and flat is None:
        return  # the host array itself was summed
    if flat is not None:  # one transfer back, then copies on that GPU
        with members[0].device:
            flat.set(host)
            if how == 'device':
                scatter(members, flat)
        return
    scatter(members, host)


def scatter(members, flat):
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
