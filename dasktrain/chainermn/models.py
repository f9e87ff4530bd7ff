"""ChainerMN's calls on a model's many arrays, as :class:`ModelCalls`, a
part of :class:`~dasktrain.chainermn.communicator.DaskCommunicator`:
``bcast_data`` (rank 0's parameters everywhere), ``multi_node_mean_grad``
(and its double-buffered ``_async``/``wait_mean``) and
``_multi_node_mean`` (ChainerMN's hook for its batch normalisation).

Each makes one collective of all the arrays. GPU arrays are packed into
one flat buffer per dtype and GPU first (:func:`groups`,
:func:`flatten`; a lone contiguous array is its own buffer), as
ChainerMN's NCCL communicator packs its gradients: one NCCL all-reduce
per step, not one per parameter. Host arrays go as they are: the host's
communicators put them in one buffer per dtype themselves (shared
memory), or in one message per peer (sockets).
The maths are ChainerMN's: parameters in ``sorted(namedparams())`` order,
the sum multiplied by ``1 / size``. Every array is written where it
lies, on its own device, whatever device is current.
"""
import functools

import chainer
import numpy as np

from dasktrain.chainermn.arrays import host, on_gpu
from dasktrain.chainermn.support import fatal, say
from dasktrain.parallel.devices import SideStream, mark


def where(array):
    """The device ``array`` lies on: a GPU id, or None for host memory."""
    return array.device.id if on_gpu(array) else None


def groups(arrays):
    """``arrays`` grouped as they are packed: by dtype and device, in
    first-seen order (the same on every rank whose arrays have the same
    dtypes and places).

    Examples
    --------
    >>> a, b, c = np.zeros(2), np.zeros(3, np.float32), np.zeros(4)
    >>> [len(g) for g in groups([a, b, c])]
    [2, 1]
    """
    found = {}
    for a in arrays:
        found.setdefault((np.dtype(a.dtype).str, where(a)), []).append(a)
    return list(found.values())


def flatten(members):
    """One flat array holding ``members`` (one dtype, one device) one
    after another, on their device: the array itself (a view) when it is
    one contiguous array, else a new one."""
    if len(members) == 1 and members[0].flags.c_contiguous:
        return members[0].reshape(-1)
    if on_gpu(members[0]):
        import cupy
        with members[0].device:
            return cupy.concatenate([a.ravel() for a in members])
    return np.concatenate([a.ravel() for a in members])


def same_memory(a, b):
    """Whether arrays ``a`` and ``b`` are the same memory (a flat view of
    one array and that array)."""
    if on_gpu(a) != on_gpu(b) or a.size != b.size:
        return False
    if on_gpu(a):
        return a.data.ptr == b.data.ptr
    return a.__array_interface__['data'][0] == \
        b.__array_interface__['data'][0]


def host_flat(members):
    """One flat host array holding ``members`` (one dtype) one after
    another: one transfer where they share a GPU."""
    if len({where(a) for a in members}) == 1:
        return host(flatten(members))
    return np.concatenate([host(a).ravel() for a in members])


def spread(flat, members):
    """Write ``flat``'s consecutive parts into ``members`` (each on its
    own device; ``flat`` in host memory or on a GPU): one transfer per
    device, then copies there. Nothing to do where ``flat`` is the one
    member's own memory (:func:`flatten` of one contiguous array)."""
    if len(members) == 1 and same_memory(flat, members[0]):
        return
    by_device = {}
    start = 0
    for a in members:
        by_device.setdefault(where(a), []).append((a, start))
        start += a.size
    for device, parts in by_device.items():
        if device is None:
            source = host(flat)
            for a, start in parts:
                a[...] = source[start:start + a.size].reshape(a.shape)
            continue
        import cupy
        with cupy.cuda.Device(device):
            source = flat if where(flat) == device else cupy.asarray(
                host(flat))
            for a, start in parts:
                cupy.copyto(a, source[start:start + a.size].reshape(a.shape))


def scale(flat, factor):
    """``flat *= factor`` on ``flat``'s own device."""
    if on_gpu(flat):
        with flat.device:
            flat *= factor
    else:
        flat *= factor


def cast(flat, dtype):
    """``flat`` as ``dtype`` (itself where it is one already, or where
    ``dtype`` is None), on its own device."""
    if dtype is None or flat.dtype == dtype:
        return flat
    if on_gpu(flat):
        with flat.device:
            return flat.astype(dtype)
    return flat.astype(dtype)


def back(flat, wire):
    """The summed ``wire`` (from :func:`cast`) into ``flat``."""
    if wire is flat:
        return
    if on_gpu(flat):
        with flat.device:
            flat[...] = wire
    else:
        flat[...] = wire


def pack_all(arrays, dtype=None):
    """``(members, flat, wire)`` for ``arrays``: each group of GPU arrays
    (one dtype, one GPU) joined in one flat buffer, which travels as
    ``wire`` (cast to ``dtype``, ChainerMN's ``allreduce_grad_dtype``,
    where one is set); each host array as itself (the host's
    communicators pack them into one buffer per dtype already: shared
    memory, or the sockets' one message; a flat copy here would only add
    two copies of every array), or cast where ``dtype`` says.

    Examples
    --------
    >>> a, b = np.zeros(3), np.ones(2)
    >>> [(len(m), w is a) for m, _, w in pack_all([a, b])]
    [(1, True), (1, False)]
    >>> [w.dtype.name for _, _, w in pack_all([a, b], np.float16)]
    ['float16']
    """
    packed = []
    for members in groups(arrays):
        if on_gpu(members[0]) or (dtype is not None and
                                  members[0].dtype != dtype):
            flat = flatten(members)
            packed.append((members, flat, cast(flat, dtype)))
        else:
            packed.extend(([a], a, a) for a in members)
    return packed


def unpack_mean(packed, size):
    """Each summed wire of :func:`pack_all` made the mean (``* 1 /
    size``, as ChainerMN scales, in the wire's dtype) and written back
    into its arrays."""
    for _, _, wire in packed:
        scale(wire, 1.0 / size)
    unpack(packed)


def unpack(packed):
    """Each wire of :func:`pack_all` (a mean already) written back into
    its arrays."""
    for members, flat, wire in packed:
        back(flat, wire)
        spread(flat, members)


def diverged(arrays):
    """ChainerMN's check in debug mode: ``ValueError`` where any of
    ``arrays`` holds a value that is not finite.

    Examples
    --------
    >>> diverged([np.ones(2)])
    >>> diverged([np.array([1.0, np.nan])])
    Traceback (most recent call last):
    ...
    ValueError: Parameters diverged after allreduce.
    """
    for a in arrays:
        xp = chainer.backend.get_array_module(a)
        if not bool(xp.isfinite(a).all()):
            raise ValueError('Parameters diverged after allreduce.')


class ModelCalls:
    """ChainerMN's calls on a model's arrays; the communicator provides
    ``comm``, ``mpi_comm`` (whose ``in_flight`` holds a double-buffered
    mean until the next call finishes it), ``rank``, ``size``, ``_nccl``
    and ``_side``."""

    @fatal
    def bcast_data(self, model):
        """Rank 0's parameters into every rank's ``model`` (one broadcast
        of one buffer per dtype; each parameter written on its device)."""
        params = [p for _, p in sorted(model.namedparams())
                  if p.data is not None]
        if self.size == 1:
            return
        arrays = [p.array for p in params]
        parts = [list(g) for g in _by_dtype(arrays)]
        mine = [(np.dtype(g[0].dtype).str, [a.size for a in g])
                for g in parts]
        if not any(on_gpu(a) for a in arrays):
            # host arrays: written where they lie (through shared memory
            # on one machine, the segments their gradients' sums use)
            self._same_layout(self.comm.bcast(mine), mine)
            self.comm.bcast_arrays(arrays)
            return
        got = self.comm.bcast((mine, [host_flat(g) for g in parts])
                              if self.rank == 0 else None)
        if self.rank == 0:
            return
        layout, flats = got
        self._same_layout(layout, mine)
        for members, flat in zip(parts, flats):
            spread(flat, members)

    def _same_layout(self, layout, mine):
        """ValueError where rank 0's parameters (``layout``) are not this
        rank's (``mine``)."""
        if layout != mine:
            raise ValueError(
                f'rank 0 has parameters {_words(layout)}, rank {self.rank} '
                f'{_words(mine)}: the models differ')

    @staticmethod
    def _grads(model, zero_fill):
        """``model``'s gradients in ChainerMN's order (``zero_fill``:
        unused parameters' as zeros, on the parameter's device)."""
        params = [p for _, p in sorted(model.namedparams())
                  if p.data is not None and (zero_fill or
                                             p.grad is not None)]
        for param in params:
            if param.grad is None:  # zero_fill
                with chainer.using_device(param.device):
                    param.grad = param.xp.zeros_like(param.data)
        return [param.grad for param in params]

    @fatal
    def multi_node_mean_grad(self, model, zero_fill=False):
        """Every parameter's gradient made the mean over the ranks (summed
        in ``allreduce_grad_dtype`` where it is set). In Chainer's debug
        mode a mean that is not finite raises ``ValueError``, as
        ChainerMN's (``Parameters diverged after allreduce.``)."""
        grads = self._grads(model, zero_fill)
        self._mean(grads, self.allreduce_grad_dtype)
        if chainer.is_debug():
            diverged(grads)

    @fatal
    def multi_node_mean_grad_async(self, model, zero_fill=False):
        """Start :meth:`multi_node_mean_grad` of ``model``;
        :meth:`wait_mean` (or any collective call) finishes it. The path
        of every dasktrain exchange (``Communicator.iallreduce``: arrays
        bound at the call, a thread of its own; on a GPU a non-blocking
        side stream after an event on the packing kernels, so the next
        step's never wait)."""
        grads = self._grads(model, zero_fill)
        if self.size == 1 or not grads:
            return
        packed = pack_all(grads, self.allreduce_grad_dtype)
        flats = [wire for _, _, wire in packed]
        device = chainer.backend.get_device_from_array(flats[0])
        if self._side is None or self._side.device != device:
            self._side = SideStream(device)
        event, side = mark(device), self._side
        reduction = self._summing(flats).iallreduce(
            flats, around=lambda: side.after(event))
        self.mpi_comm.in_flight = functools.partial(
            self._finish_mean, reduction, packed)

    @fatal
    def wait_mean(self):
        """Wait for :meth:`multi_node_mean_grad_async`'s sums and make
        them the mean; nothing to do without one (any collective call
        waits for it first)."""

    def _finish_mean(self, reduction, packed):
        reduction.wait()
        unpack_mean(packed, self.size)

    @fatal
    def _multi_node_mean(self, sendbuf, recvbuf):
        """ChainerMN's hook for its BatchNormalization: ``recvbuf`` (or
        ``sendbuf`` into it) made the mean over the ranks."""
        if sendbuf is not None:
            recvbuf[...] = sendbuf
        self._mean([recvbuf])

    def _summing(self, arrays):
        """The communicator that sums ``arrays``: NCCL for GPU arrays
        where every rank has it (decided together at the first sum of GPU
        arrays, which every rank makes at the same point), else the
        host's, through host memory."""
        if self.size == 1 or not any(on_gpu(a) for a in arrays):
            return self.comm
        if self._nccl is None:
            from dasktrain.parallel.gpus import (
                CLEAR_NCCL_REFUSED,
                nccl_problem,
            )
            try:
                from cupy.cuda import nccl
                problem = nccl_problem(nccl)
            except Exception as e:  # a broken CuPy: the host path serves
                problem = f'cupy.cuda.nccl cannot be imported ({e})'
            if not self.nccl_network:  # agreed by every rank at creation
                problem = CLEAR_NCCL_REFUSED
            if all(self.comm.allgather(problem is None)):
                from dasktrain.parallel.comm.nccl import NcclComm
                gpu = next(a for a in arrays if on_gpu(a))
                self._nccl = NcclComm(self.comm, gpu.device.id)
            else:
                self._nccl = False
            if self.rank == 0:
                say('dasktrain.chainermn: GPU arrays are summed with '
                    + ('NCCL' if self._nccl else
                       f'host copies ({problem or "a rank lacks NCCL"})'))
        return self._nccl or self.comm

    def _mean(self, arrays, dtype=None):
        """``arrays`` made their mean over the ranks, in place: one
        all-reduce of one buffer per dtype and device (summed as
        ``dtype`` where it is given)."""
        if self.size == 1 or not arrays:
            return
        packed = pack_all(arrays, dtype)
        wires = [wire for _, _, wire in packed]
        # the mean as ChainerMN takes it (the sum, then * 1 / size in the
        # wire's dtype), through shared memory in the same pass
        self._summing(wires).allreduce(wires, scale=1.0 / self.size)
        unpack(packed)


def _by_dtype(arrays):
    found = {}
    for a in arrays:
        found.setdefault(np.dtype(a.dtype).str, []).append(a)
    return list(found.values())


def _words(layout):
    return ', '.join(f'{len(sizes)} of {key}' for key, sizes in layout)
