"""All-reduce through shared memory among the ranks of one machine.

Between processes on one host, sending 22 MB of gradients through TCP
sockets (even loopback) costs copies into and out of the kernel and a
pickle framing per message; MPI and NCCL use shared memory instead. So does
:class:`SharedMemoryReducer`:

1. every rank copies (packs) its arrays into its own input segment;
2. a barrier: all inputs are written;
3. rank r sums the r-th slice of every input, in rank order (for the same
   bits on every rank and as :class:`~dasktrain.parallel.comm.dask.DaskComm`
   sums), into that slice of a result segment: a reduce-scatter, in place;
4. a barrier: all slices are summed;
5. every rank copies the whole result back into its arrays (the
   all-gather is a read).

The barriers are small messages among the host's ranks (over Unix
domain sockets in the caller's thread: :class:`~dasktrain.parallel.comm.
nearby.NearGroup`, which :class:`~dasktrain.parallel.comm.dask.DaskComm`
gives it once connected; over its ``DaskComm`` for the set-up), which
also carry each rank's signature (dtypes and sizes), so ranks that are out
of step fail instead of reading garbage. Two result segments alternate
between calls: a fast rank writing call k+1's sums never overwrites call
k's result while a slower rank still reads it.

A sum of at most :data:`SMALL_BYTES` (a batch normalisation's
statistics) skips the segments: one exchange of the ranks' copies, each
rank adding them in rank order (the same bits).

Segments are files in ``/dev/shm`` (mode 0600), created on first use for
each buffer size and *unlinked as soon as every rank has mapped them*: the
mappings live on, the names are gone, so nothing is left behind when a
process exits, even by SIGKILL. Linux only; elsewhere, or for ranks on
several hosts, DaskComm sends over TCP as before.

Host arrays only, and no sockets of its own: the caller copies GPU arrays
here and back, and the barriers go over the caller's communicator.
"""
import mmap
import os
import uuid

import numpy as np

from dasktrain.parallel.comm.base import CollectiveError

SHM_DIR = '/dev/shm'
#: ``DASKTRAIN_SHARED_MEMORY=0``: ranks of one host do not sum through it.
ENV = 'DASKTRAIN_SHARED_MEMORY'
ALIGN = 64  # bytes: each dtype's region starts on a cache line
#: Bytes up to which a sum travels as one exchange of copies, each rank
#: adding them: two barriers cost more than those bytes.
SMALL_BYTES = 1 << 16


def available():
    """Whether this machine has POSIX shared memory as files."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def layout(packed):
    """(key, dtype, byte offset, count) of each dtype's region, and the
    total bytes, for ``packed`` = {dtype str: flat array or count}."""
    regions, offset = [], 0
    for key in sorted(packed):
        count = packed[key] if isinstance(packed[key], int) else \
            packed[key].size
        dtype = np.dtype(key)
        regions.append((key, dtype, offset, count))
        offset += -(-count * dtype.itemsize // ALIGN) * ALIGN
    return regions, max(offset, ALIGN)


def bounds(count, size):
    """[lo, hi) of each rank's slice: np.array_split's, as DaskComm's."""
    edges = [0]
    base, extra = divmod(count, size)
    for r in range(size):
        edges.append(edges[-1] + base + (1 if r < extra else 0))
    return list(zip(edges[:-1], edges[1:]))


def _check(theirs, signature, rank):
    """CollectiveError where a rank's signature (the first of each of
    ``theirs``, in rank order) is not this one's."""
    for peer, (other, _) in enumerate(theirs):
        if other != signature:
            raise CollectiveError(
                f'rank {peer} sums {len(other)} arrays where rank {rank} '
                f'sums {len(signature)} (or of other sizes): the ranks are '
                'out of step (different models or optimizer state)')


class _Segment:
    """A shared-memory file mapped into this process."""

    def __init__(self, path, nbytes, create):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.path = path
        self.bytes = np.frombuffer(self.map, dtype=np.uint8)

    def view(self, dtype, offset, count):
        return self.bytes[offset:offset + count * dtype.itemsize].view(dtype)

    def close(self):
        del self.bytes  # the mapping cannot close while viewed
        try:
            self.map.close()
        except BufferError:  # a caller still holds a view: GC frees it
            pass


class SharedMemoryReducer:
    """Sum flat host buffers over the ranks of ``comm``, all on this host.

    Create it with :meth:`connect`, which returns None unless every rank
    sees the same ``/dev/shm`` (one machine, one container).

    Parameters
    ----------
    comm : Communicator
        The ranks' connections, for the barriers and the segment names.
    token : str
        Names this job's segments (the same on every rank).
    """

    def __init__(self, comm, token):
        self.comm, self._token = comm, token
        self.rank, self.size = comm.rank, comm.size
        self._segments = {}  # total bytes -> (inputs by rank, 2 results)
        self._calls = 0

    @classmethod
    def connect(cls, comm):
        """A reducer for ``comm``'s ranks, or None where they do not share
        one ``/dev/shm``: rank 0 makes a probe file there, every rank
        looks for it."""
        token = comm.bcast(uuid.uuid4().hex[:12] if comm.rank == 0 else None)
        probe = os.path.join(SHM_DIR, f'dasktrain-{token}-probe')
        if comm.rank == 0 and available():
            os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_RDWR,
                             0o600))
        try:
            comm.barrier()  # the probe exists, if it can
            seen = comm.allgather(available() and os.path.exists(probe))
        finally:
            if comm.rank == 0 and os.path.exists(probe):
                os.unlink(probe)
        return cls(comm, token) if all(seen) else None

    def _path(self, what, nbytes):
        return os.path.join(SHM_DIR, f'dasktrain-{self._token}-{what}-'
                                     f'{nbytes}')

    def _open(self, nbytes):
        """Every rank's input segment and the two result segments of this
        size, mapped here; their names already unlinked."""
        if nbytes in self._segments:
            return self._segments[nbytes]
        mine = [self._path(f'in{self.rank}', nbytes)]
        if self.rank == 0:
            mine += [self._path(f'out{i}', nbytes) for i in (0, 1)]
        made = []
        try:
            for path in mine:
                made.append(_Segment(path, nbytes, create=True))
            self.comm.barrier()  # every segment exists
            ins = [made[0] if r == self.rank else
                   _Segment(self._path(f'in{r}', nbytes), nbytes, False)
                   for r in range(self.size)]
            outs = made[1:] if self.rank == 0 else \
                [_Segment(self._path(f'out{i}', nbytes), nbytes, False)
                 for i in (0, 1)]
            self.comm.barrier()  # every rank has mapped them all
        finally:
            for segment in made:  # the names go; the mappings stay
                try:
                    os.unlink(segment.path)
                except FileNotFoundError:
                    pass
        self._segments[nbytes] = ins, outs
        return ins, outs

    def allreduce(self, groups, signature, between=None):
        """Sum, in place, ``groups`` = {dtype str: [arrays]} (host arrays,
        any shapes, contiguous or not) over the ranks; ``signature`` is
        compared across ranks at the first barrier (a mismatch raises
        CollectiveError).

        ``between`` (given alike on every rank, or on none): once the sums
        are in the result segment, rank 0 calls ``between(flats)`` on its
        flat regions (one per dtype, in place: the hierarchical path adds
        the other hosts' sums there) while the others wait, then all read
        the result."""
        counts = {k: sum(a.size for a in arrays)
                  for k, arrays in groups.items()}
        regions, nbytes = layout(counts)
        if between is None and nbytes <= SMALL_BYTES:
            return self._allreduce_small(groups, signature)
        ins, outs = self._open(nbytes)
        result = outs[self._calls % 2]
        self._calls += 1
        for key, dtype, offset, count in regions:  # 1. pack into my input
            flat, start = ins[self.rank].view(dtype, offset, count), 0
            for a in groups[key]:
                flat[start:start + a.size].reshape(a.shape)[...] = a
                start += a.size
        theirs = self.comm.allgather(signature)  # 2. inputs written
        _check([(other, None) for other in theirs], signature, self.rank)
        for _, dtype, offset, count in regions:  # 3. my slice's sums
            lo, hi = bounds(count, self.size)[self.rank]
            if hi > lo:  # past the dtype's range: inf, as DaskComm's
                acc = result.view(dtype, offset, count)[lo:hi]
                parts = [peer.view(dtype, offset, count)[lo:hi]
                         for peer in ins]
                with np.errstate(over='ignore', invalid='ignore'):
                    if len(parts) == 1:
                        acc[...] = parts[0]
                    else:  # the first two added straight into the sum
                        np.add(parts[0], parts[1], out=acc)
                    for part in parts[2:]:
                        acc += part
        self.comm.barrier()  # 4. every slice summed
        if between is not None:
            if self.rank == 0:
                between([result.view(dtype, offset, count)
                         for _, dtype, offset, count in regions])
            self.comm.barrier()  # the other hosts' sums added
        for key, dtype, offset, count in regions:  # 5. read the result
            flat, start = result.view(dtype, offset, count), 0
            for a in groups[key]:
                a[...] = flat[start:start + a.size].reshape(a.shape)
                start += a.size

    def _allreduce_small(self, groups, signature):
        """A sum of at most :data:`SMALL_BYTES`: every rank's flat copies
        go to every rank with its signature (one exchange, not two
        barriers), each rank adds them in rank order: the same bits as
        the segments' sum, on every rank."""
        flats = {key: np.concatenate([np.asarray(a).reshape(-1)
                                      for a in arrays])
                 for key, arrays in groups.items()}
        theirs = self.comm.allgather((signature, flats))
        _check(theirs, signature, self.rank)
        for key, arrays in groups.items():
            with np.errstate(over='ignore', invalid='ignore'):
                total = theirs[0][1][key]
                if len(theirs) > 1:
                    total = np.add(total, theirs[1][1][key])
                for _, other in theirs[2:]:
                    total += other[key]
            start = 0
            for a in arrays:
                a[...] = total[start:start + a.size].reshape(a.shape)
                start += a.size

    def close(self):
        for ins, outs in self._segments.values():
            for segment in ins + outs:
                segment.close()
        self._segments.clear()
