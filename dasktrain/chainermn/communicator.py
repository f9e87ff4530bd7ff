"""ChainerMN's communicator on dasktrain's collectives.

:func:`create_communicator` takes any ChainerMN communicator name and
returns a :class:`DaskCommunicator`: the ChainerMN
:class:`chainermn.CommunicatorBase` interface (``rank``, ``size``,
``intra_rank``, ..., ``bcast_data``, ``multi_node_mean_grad``, the
``*_obj`` calls, array ``allreduce``/``bcast``/``send``/``recv``,
``finalize``) over the dasktrain communicator that
:func:`dasktrain.parallel.comm.rendezvous.join` makes from the environment
``dasktrain launch`` sets: shared memory between the ranks of one machine,
TLS (or TCP) between machines. ChainerMN names a transport (MPI, NCCL,
CUDA-aware or not); here the best one for where the ranks are is taken
whatever the name, and rank 0 says once which.

The maths are ChainerMN's: parameters in ``sorted(namedparams())`` order,
gradients summed then multiplied by ``1 / size``, ``zero_fill`` as
ChainerMN fills, objects summed with ``+`` in rank order. Sums of GPU
arrays go over NCCL where every rank has it, else through the host.

Owns the communicator only; optimizers, datasets, extensions and links
are the package's other modules.
"""
import atexit
import collections
import functools
import logging
import operator
import os
import socket
import sys

import chainer
import numpy as np
from chainermn.communicators.communicator_base import CommunicatorBase

from dasktrain.chainermn.support import Unsupported
from dasktrain.parallel.comm.base import CollectiveError
from dasktrain.parallel.comm.rendezvous import join
from dasktrain.parallel.devices import SideStream, mark

logger = logging.getLogger(__name__)

#: Every name ChainerMN (any version) accepts; all run on the same
#: collectives here.
NAMES = ('pure_nccl', 'hierarchical', 'two_dimensional', 'single_node',
         'flat', 'naive', 'non_cuda_aware', 'dummy')


def create_communicator(communicator_name='pure_nccl', mpi_comm=None,
                        **kwargs):
    """A communicator joining this process to the other ranks that
    ``dasktrain launch`` started (a job of one rank when run alone).

    Parameters
    ----------
    communicator_name : str
        Any of ChainerMN's names (:data:`NAMES`); the transport is chosen
        by where the ranks are, not by the name.
    mpi_comm : None
        MPI communicators do not exist here: one given is an error.
    **kwargs
        ChainerMN's ``allreduce_grad_dtype`` (None or the parameters'
        dtype; a cast is an error) and ``batched_copy`` (ignored).

    Returns
    -------
    DaskCommunicator
    """
    if communicator_name not in NAMES:
        raise ValueError(f'unrecognized communicator: {communicator_name!r}'
                         f' (ChainerMN names: {", ".join(NAMES)})')
    if mpi_comm is not None:
        raise Unsupported('create_communicator(mpi_comm=...)',
                          'ranks meet through `dasktrain launch`, not MPI')
    dtype = kwargs.pop('allreduce_grad_dtype', None)
    kwargs.pop('batched_copy', None)
    if kwargs:
        raise TypeError('create_communicator() got unexpected keyword '
                        f'argument(s) {", ".join(sorted(kwargs))}')
    if dtype is not None and np.dtype(dtype) != chainer.get_dtype():
        raise Unsupported(f'create_communicator(allreduce_grad_dtype='
                          f'{np.dtype(dtype).name})',
                          'gradients are summed in their own dtype')
    comm = DaskCommunicator(join(), communicator_name)
    if comm.rank == 0 and comm.size > 1:
        _say(f'dasktrain.chainermn: {communicator_name!r} runs on '
             f'{comm.transport} among {comm.size} ranks on '
             f'{comm.inter_size} machine(s)')
    return comm


def _say(line, level=logging.INFO):
    """One line on stderr through the ``dasktrain`` logger, also in a
    script that configured no logging."""
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter('%(message)s'))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    logger.log(level, line)


def _fatal(method):
    """As under MPI, whose errors are fatal: a call that fails because a
    peer died or hangs (:class:`CollectiveError`) ends this process at
    once with one line, without unwinding the user's code. Unwinding would
    run Chainer's extensions' ``finalize``, and the multi-node
    checkpointer's deletes the very checkpoints a relaunch resumes from.

    Every such call first finishes a double-buffered mean still in flight
    (:meth:`DaskCommunicator.wait_mean`): the ranks' collectives run one
    at a time, in the order every rank makes them (a
    MultiNodeBatchNormalization's sums in the next forward pass come after
    the gradients' on every rank)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            self._finish_mean()
            return method(self, *args, **kwargs)
        except CollectiveError as e:
            _say(f'dasktrain.chainermn: rank {self.rank} stops '
                 f'({type(e).__name__}: {e}), as MPI ends a job whose '
                 'peer is lost', logging.ERROR)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(1)
    return call


def _host(array):
    return array.get() if hasattr(array, 'get') else np.asarray(array)


def _like(array, host):
    """``host`` where ``array`` lives (a CuPy array on its device)."""
    if hasattr(array, 'get'):
        import cupy
        return cupy.asarray(host)
    return host


class DaskCommunicator(CommunicatorBase):
    """ChainerMN's communicator interface over a dasktrain communicator.

    Parameters
    ----------
    comm : dasktrain.parallel.comm.base.Communicator
        The rank's collectives (``DaskComm`` or ``Solo``).
    name : str
        The ChainerMN name it was created with.
    """

    def __init__(self, comm, name='pure_nccl'):
        super().__init__()
        self.comm, self.name = comm, name
        hosts = comm.allgather(socket.gethostname())
        mine = hosts[comm.rank]
        same = [r for r, h in enumerate(hosts) if h == mine]
        machines = list(collections.OrderedDict.fromkeys(hosts))
        self._ranks = (same.index(comm.rank), len(same),
                       machines.index(mine), len(machines))
        self._closed = False
        self._nccl = None  # NcclComm, or False: decided at the first GPU sum
        self._pending = None  # double buffering: (reduction, gradients)
        self._side = None     # ... its side stream, made once
        # Most ChainerMN scripts never call finalize(): leave at exit.
        atexit.register(self._at_exit)

    def _at_exit(self):
        """A normal exit leaves as ``DaskComm`` does: rank 0 releases the
        others once all have come, so that no rank closes while a message
        of its own is unread (a closed socket can drop it). After an
        uncaught error (``sys.last_value``), the connections just close:
        the peers fail fast."""
        if self._closed:
            return
        try:
            if getattr(sys, 'last_value', None) is None and self.size > 1:
                self._finish_mean()  # no collective beside the last
                self.comm.bcast(None)
        except CollectiveError:  # a peer already gone: nothing to wait for
            pass
        finally:
            self._close()

    def _close(self):
        if not self._closed:
            self._closed = True
            if self._nccl:
                self._nccl.close()
            self.comm.close()

    @property
    def transport(self):
        """How arrays travel between the ranks, in words."""
        if self.size == 1:
            return 'nothing (one rank)'
        # More than one rank: join() made a DaskComm.
        return 'shared memory' if self.comm.shared_memory else \
            'TLS/TCP peer-to-peer connections'

    rank = property(lambda self: self.comm.rank)
    size = property(lambda self: self.comm.size)
    intra_rank = property(lambda self: self._ranks[0])
    intra_size = property(lambda self: self._ranks[1])
    inter_rank = property(lambda self: self._ranks[2])
    inter_size = property(lambda self: self._ranks[3])

    # ------------------------------------------------ unsupported calls

    def split(self, color, key):
        raise Unsupported('communicator.split()')

    def alltoall(self, xs):
        raise Unsupported('communicator.alltoall()')

    def scatter(self, xs, root=0):
        raise Unsupported('communicator.scatter()')

    # ------------------------------------------------ arrays

    def _check_root(self, root):
        if not 0 <= root < self.size:
            raise ValueError(f'root must be a rank of 0..{self.size - 1}, '
                             f'got {root}')

    @_fatal
    def send(self, data, dest, tag=0):
        """Send an array (or a tuple/list of arrays) to rank ``dest``."""
        many = isinstance(data, (tuple, list))
        arrays = list(data) if many else [data]
        self.comm.send((tag, many, [hasattr(a, 'get') for a in arrays],
                        [_host(a) for a in arrays]), dest)

    @_fatal
    def recv(self, source, tag=0):
        """The array (or tuple of arrays) rank ``source`` sent; a CuPy
        array sent arrives on the current device, as in ChainerMN."""
        sent, many, on_gpu, arrays = self.comm.recv(source)
        if tag != sent:
            raise CollectiveError(f'rank {source} sent tag {sent} where '
                                  f'rank {self.rank} expected {tag}')
        if any(on_gpu):
            import cupy
            arrays = [cupy.asarray(a) if g else a
                      for g, a in zip(on_gpu, arrays)]
        return tuple(arrays) if many else arrays[0]

    @_fatal
    def bcast(self, x, max_buf_len=None, root=0):
        """Rank ``root``'s array, on every rank."""
        got = self.bcast_obj(_host(x) if self.rank == root else None,
                             root=root)
        return _like(x, got) if x is not None else got

    @_fatal
    def gather(self, x, root=0):
        """Every rank's array, in rank order, on ``root``; else None."""
        got = self.gather_obj(_host(x), root=root)
        return None if got is None else tuple(_like(x, a) for a in got)

    @_fatal
    def allgather(self, x):
        """Every rank's array, in rank order, on every rank."""
        return tuple(_like(x, a) for a in self.comm.allgather(_host(x)))

    @_fatal
    def allreduce(self, x):
        """The sum of every rank's ``x`` (a new array)."""
        total = x.copy()
        self._summing([total]).allreduce([total])
        return total

    # ------------------------------------------------ objects

    @_fatal
    def send_obj(self, obj, dest, tag=0):
        self.comm.send(obj, dest)

    @_fatal
    def recv_obj(self, source, status=None, tag=None):
        return self.comm.recv(source)

    @_fatal
    def bcast_obj(self, obj, max_buf_len=None, root=0):
        self._check_root(root)
        if root == 0:
            return self.comm.bcast(obj)
        return self.comm.allgather(obj if self.rank == root else None)[root]

    @_fatal
    def gather_obj(self, obj, root=0):
        self._check_root(root)
        if root == 0:
            return self.comm.gather(obj)
        got = self.comm.allgather(obj)
        return got if self.rank == root else None

    @_fatal
    def allreduce_obj(self, obj):
        """The sum (``+``) of every rank's ``obj``, in rank order."""
        return functools.reduce(operator.add, self.comm.allgather(obj))

    # ------------------------------------------------ models

    @_fatal
    def bcast_data(self, model):
        """Rank 0's parameters into every rank's ``model``."""
        params = [p for _, p in sorted(model.namedparams())
                  if p.data is not None]
        got = self.comm.bcast([_host(p.array) for p in params]
                              if self.rank == 0 else None)
        if self.rank != 0:
            if len(got) != len(params):
                raise CollectiveError(
                    f'rank 0 has {len(got)} initialised parameters, rank '
                    f'{self.rank} {len(params)}: the models differ')
            for param, value in zip(params, got):
                param.array[...] = _like(param.array, value)

    @staticmethod
    def _grads(model, zero_fill):
        """``model``'s gradients in ChainerMN's order (``zero_fill``:
        unused parameters' as zeros)."""
        params = [p for _, p in sorted(model.namedparams())
                  if p.data is not None and (zero_fill or
                                             p.grad is not None)]
        for param in params:
            if param.grad is None:  # zero_fill
                param.grad = param.xp.zeros_like(param.data)
        return [param.grad for param in params]

    @_fatal
    def multi_node_mean_grad(self, model, zero_fill=False):
        """Every parameter's gradient made the mean over the ranks."""
        self._mean(self._grads(model, zero_fill))

    @_fatal
    def multi_node_mean_grad_async(self, model, zero_fill=False):
        """Start :meth:`multi_node_mean_grad` of ``model``; :meth:`wait_mean`
        (or any collective call) finishes it. The path of every dasktrain
        exchange (``Communicator.iallreduce``: arrays bound at the call, a
        thread of its own; on a GPU a non-blocking side stream after an
        event on the gradients' kernels, so the next step's never wait)."""
        grads = self._grads(model, zero_fill)
        if self.size == 1 or not grads:
            return
        device = chainer.backend.get_device_from_array(grads[0])
        if self._side is None or self._side.device != device:
            self._side = SideStream(device)
        event, side = mark(device), self._side
        self._pending = (self._summing(grads).iallreduce(
            grads, around=lambda: side.after(event)), grads)

    @_fatal
    def wait_mean(self):
        """Wait for :meth:`multi_node_mean_grad_async`'s sums and make
        them the mean; nothing to do without one (any collective call
        waits for it first)."""

    def _finish_mean(self):
        pending, self._pending = self._pending, None
        if pending is not None:
            reduction, grads = pending
            reduction.wait()
            for a in grads:
                a *= 1.0 / self.size

    @_fatal
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
        if self.size == 1 or not any(hasattr(a, 'get') for a in arrays):
            return self.comm
        if self._nccl is None:
            from dasktrain.parallel.gpus import nccl_problem
            try:
                from cupy.cuda import nccl
                problem = nccl_problem(nccl)
            except Exception as e:  # a broken CuPy: the host path serves
                problem = f'cupy.cuda.nccl cannot be imported ({e})'
            if all(self.comm.allgather(problem is None)):
                from dasktrain.parallel.comm.nccl import NcclComm
                self._nccl = NcclComm(self.comm, arrays[0].device.id)
            else:
                self._nccl = False
            if self.rank == 0:
                _say('dasktrain.chainermn: GPU arrays are summed with '
                     + ('NCCL' if self._nccl else
                        f'host copies ({problem or "a rank lacks NCCL"})'))
        return self._nccl or self.comm

    def _mean(self, arrays):
        if self.size > 1:
            self._summing(arrays).allreduce(arrays)
            for a in arrays:
                a *= 1.0 / self.size  # as ChainerMN scales its sums

    @_fatal
    def finalize(self):
        """Leave the job: every rank waits for the others, then the
        connections close. Called again, it does nothing."""
        if self._closed:
            return
        try:
            self.comm.barrier()
        finally:
            self._close()
