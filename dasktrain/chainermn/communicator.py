"""ChainerMN's communicator on dasktrain's collectives.

:func:`create_communicator` takes any ChainerMN communicator name and
returns a :class:`DaskCommunicator`: the ChainerMN
:class:`chainermn.CommunicatorBase` interface over an mpi4py-like
communicator of dasktrain's (:mod:`dasktrain.chainermn.mpi`), by default
``MPI.COMM_WORLD``, as in ChainerMN: every rank ``dasktrain launch``
started, joined once per process from the environment it sets, talking
through shared memory on one machine, TLS (or TCP) between machines.
ChainerMN names a transport (MPI, NCCL, CUDA-aware or not); here the best
one for where the ranks are is taken whatever the name, and rank 0 says
once which. ChainerMN's class names
(``NaiveCommunicator(mpi_comm)``, ...) build the same communicator.

Its parts: the ranks (``rank``, ``size``, ``intra_rank``, ...),
``split`` and ``finalize`` here; the array and object calls
(``send``/``recv`` matched by source and tag, the collectives from any
root) are :mod:`~dasktrain.chainermn.arrays`'; the calls on a model's
arrays (``bcast_data``, ``multi_node_mean_grad``, batch normalisation's
mean), each one collective of packed buffers, are
:mod:`~dasktrain.chainermn.models`'. The connections, and leaving at
exit, are ``mpi_comm``'s: communicators made on the same ``mpi_comm``
share them, as ChainerMN's share an MPI communicator.
"""
import functools
import os

import numpy as np
from chainermn.communicators.communicator_base import CommunicatorBase

from dasktrain.chainermn import mpi
from dasktrain.chainermn.arrays import ArrayCalls, arrived
from dasktrain.chainermn.models import ModelCalls
from dasktrain.chainermn.support import Unsupported, fatal, say
from dasktrain.parallel.comm.base import Communicator
from dasktrain.parallel.placement import machine_place

#: Every name ChainerMN (any version) accepts; all run on the same
#: collectives here.
NAMES = ('pure_nccl', 'hierarchical', 'two_dimensional', 'single_node',
         'flat', 'naive', 'non_cuda_aware', 'dummy')


def create_communicator(communicator_name='pure_nccl', mpi_comm=None,
                        **kwargs):
    """A communicator of the ranks that ``dasktrain launch`` started (a
    job of one rank when run alone), as ChainerMN's.

    Parameters
    ----------
    communicator_name : str
        Any of ChainerMN's names (:data:`NAMES`); the transport is chosen
        by where the ranks are, not by the name.
    mpi_comm : dasktrain.chainermn.mpi.Comm, optional
        The ranks to run on, as ChainerMN's ``mpi_comm``: ``MPI.COMM_WORLD``
        (every rank; the default, as in ChainerMN) or a communicator made
        from it (``Split``, ``Dup``). A real mpi4py communicator is
        refused: a launched rank has no MPI.
    **kwargs
        ChainerMN's ``allreduce_grad_dtype`` (``pure_nccl`` only, as in
        ChainerMN: gradients are summed in this float dtype, e.g.
        float16 to halve the bytes, and cast back) and ``batched_copy``
        (kept, without effect: packing is always one copy per array).

    Returns
    -------
    DaskCommunicator

    Examples
    --------
    >>> comm = create_communicator('naive')  # run alone: one rank
    >>> comm.rank, comm.size
    (0, 1)
    """
    if communicator_name not in NAMES:
        raise ValueError(f'unrecognized communicator: {communicator_name!r}'
                         f' (ChainerMN names: {", ".join(NAMES)})')
    dtype = kwargs.pop('allreduce_grad_dtype', None)
    batched_copy = kwargs.pop('batched_copy', True)
    if kwargs:
        raise TypeError('create_communicator() got unexpected keyword '
                        f'argument(s) {", ".join(sorted(kwargs))}')
    if dtype is not None and communicator_name != 'pure_nccl':
        raise ValueError("allreduce_grad_dtype is only available at "
                         "'pure_nccl' communicator.")
    comm = DaskCommunicator(mpi.world() if mpi_comm is None else mpi_comm,
                            communicator_name)
    comm.set_config('allreduce_grad_dtype', dtype)
    comm.set_config('batched_copy', batched_copy)
    return comm


def gpu_direct_possible(environ=None):
    """Whether this process could send GPU arrays over NCCL point to
    point: CuPy imports with NCCL 2.14 or later, and its GPUs are not
    hidden (``CUDA_VISIBLE_DEVICES=''``: ``dasktrain launch``'s CPU
    ranks, which do not even import CuPy)."""
    env = os.environ if environ is None else environ
    if env.get('CUDA_VISIBLE_DEVICES') == '':
        return False
    try:
        from cupy.cuda import nccl
    except Exception:  # no CuPy, or one that cannot load
        return False
    from dasktrain.parallel.gpus import nccl_problem
    return nccl_problem(nccl) is None


_told = set()  # the transports rank 0 has named, once each


class DaskCommunicator(ArrayCalls, ModelCalls, CommunicatorBase):
    """ChainerMN's communicator interface over an mpi4py-like communicator
    of dasktrain's (:class:`dasktrain.chainermn.mpi.Comm`), as ChainerMN's
    communicators are over an mpi4py one.

    Parameters
    ----------
    mpi_comm : dasktrain.chainermn.mpi.Comm or Communicator
        The ranks (``MPI.COMM_WORLD``, or one split from it); a dasktrain
        communicator (``DaskComm``, ``Solo``) is made one.
    name : str
        The ChainerMN name it was created with.

    Attributes
    ----------
    mpi_comm : dasktrain.chainermn.mpi.Comm
        As ChainerMN's: mpi4py's calls on the same ranks and connections.
    box : dasktrain.parallel.comm.mailbox.Mailbox
        Point-to-point messages, matched by source and tag (``mpi_comm``'s:
        a message sent by ``send_obj`` is received by ``mpi_comm.recv``).
    gpu_direct : bool
        Whether GPU arrays sent to a rank travel over NCCL (every rank
        has NCCL, and the network allows it: ``nccl_network``), rather
        than through host memory.
    nccl_network : bool
        Whether NCCL may join these ranks as far as the network goes: all
        on one machine, or every rank's cluster allows NCCL in clear
        between machines (:func:`~dasktrain.parallel.gpus.nccl_between`;
        a shared cluster does unless ``cluster start --allow-clear-nccl``
        said so); else GPU arrays travel over the ranks' sealed links.
    """

    def __init__(self, mpi_comm, name='pure_nccl'):
        super().__init__()
        if not isinstance(mpi_comm, mpi.Comm):
            if not isinstance(mpi_comm, Communicator):
                raise Unsupported(
                    f'create_communicator(mpi_comm={mpi_comm!r})',
                    'a launched rank has no MPI: give MPI.COMM_WORLD of '
                    "`from mpi4py import MPI` under `dasktrain launch`, or "
                    'a communicator split from it')
            mpi_comm = mpi.Comm.over(mpi_comm)
        self.mpi_comm, self.name = mpi_comm, name
        self.comm = mpi_comm.dask
        self.box = mpi_comm.box
        self.box.arrival = functools.partial(arrived, mpi_comm)
        # intra_rank: the rank's place among its machine's ranks, by the
        # machine the communicator knows it on (its listening host, which
        # clones of one image do not share, unlike their hostname).
        from dasktrain.parallel.gpus import clear_nccl_allowed, nccl_between
        facts = mpi_comm.allgather((mpi_comm.machine, self.size > 1 and
                                    gpu_direct_possible(),
                                    clear_nccl_allowed()))
        self._ranks = machine_place([m for m, _, _ in facts], self.rank)
        self.nccl_network = nccl_between([(m, a) for m, _, a in facts])
        self.gpu_direct = all(ok for _, ok, _ in facts) and \
            self.size > 1 and self.nccl_network
        self.allreduce_grad_dtype = None  # set_config's
        self.batched_copy = True
        self._nccl = None  # NcclComm, or False: decided at the first GPU sum
        self._side = None     # double buffering's side stream, made once
        if self.rank == 0 and self.size > 1 and \
                (name, self.transport) not in _told:
            _told.add((name, self.transport))
            say(f'dasktrain.chainermn: {name!r} runs on {self.transport} '
                f'among {self.size} ranks on {self.inter_size} machine(s)'
                + ('; GPU arrays go rank to rank over NCCL'
                   if self.gpu_direct else ''))

    def _settle(self):
        """Finish what runs in the background on these ranks (a
        double-buffered mean) before the next call."""
        self.mpi_comm._settle()

    def _at_exit(self):
        """Leave as a rank does at exit (see ``mpi.Comm``)."""
        self.mpi_comm._at_exit()

    @property
    def transport(self):
        """How arrays travel between the ranks, in words."""
        if self.size == 1:
            return 'nothing (one rank)'
        # More than one rank: join() made a DaskComm.
        return 'shared memory' if self.comm.shared_memory else \
            'TLS/TCP peer-to-peer connections'

    def set_config(self, name, value=True, **kwargs):
        """ChainerMN's configurations: ``allreduce_grad_dtype`` (a float
        dtype, or None: each gradient in its own) and ``batched_copy``."""
        if name == 'allreduce_grad_dtype':
            if value is not None:
                value = np.dtype(value)
                if value.kind != 'f':
                    raise ValueError('allreduce_grad_dtype must be '
                                     'numpy.float16, numpy.float32, '
                                     f'numpy.float64, or None, got {value}')
            with self.config_scope():
                self.allreduce_grad_dtype = value
        elif name == 'batched_copy':
            with self.config_scope():
                self.batched_copy = value
        else:
            super().set_config(name, **kwargs)

    def get_config(self, name=None):
        """A configuration's value; all of them by name without one."""
        configs = {'allreduce_grad_dtype': self.allreduce_grad_dtype,
                   'batched_copy': self.batched_copy}
        return configs if name is None else configs[name]

    rank = property(lambda self: self.comm.rank)
    size = property(lambda self: self.comm.size)
    intra_rank = property(lambda self: self._ranks[0])
    intra_size = property(lambda self: self._ranks[1])
    inter_rank = property(lambda self: self._ranks[2])
    inter_size = property(lambda self: self._ranks[3])

    @fatal
    def split(self, color, key):
        """A communicator of the ranks that give the same ``color``,
        ranked by ``key`` (ties by rank), as ChainerMN's (MPI's
        ``Comm_Split``): every rank calls it. It has its own ``rank`` and
        ``size``, collectives and point-to-point messages among its ranks
        only, over connections of its own, on the same transports (shared
        memory on one machine, NCCL for GPU arrays).

        Examples
        --------
        >>> comm = create_communicator('naive')
        >>> comm.split(comm.rank % 2, comm.rank).size  # run alone
        1
        """
        if not isinstance(color, (int, np.integer)) or color < 0:
            raise ValueError(f'color must be an int >= 0, got {color!r}')
        child = type(self)(self.mpi_comm.Split(int(color), key), self.name)
        for name, value in self.get_config().items():
            child.set_config(name, value)
        return child

    @fatal
    def allreduce_obj(self, obj):
        """The sum (``+``) of every rank's ``obj``, in rank order."""
        got = self.mpi_comm.small.allgather(obj)
        total = got[0]
        for other in got[1:]:
            total = total + other
        return total

    @fatal
    def finalize(self):
        """As ChainerMN's: free what the communicator holds beyond its
        ranks' connections (its NCCL communicators, after a barrier where
        it has one, as ``PureNcclCommunicator.finalize``); the
        connections are ``mpi_comm``'s and close at exit. It waits for no
        rank that has none, so one rank may call it alone."""
        if self._nccl:
            self.mpi_comm.barrier()
            self._nccl.close()
        self._nccl = None


class NaiveCommunicator(DaskCommunicator):
    """ChainerMN's class names: ``NaiveCommunicator(mpi_comm)`` is
    ``create_communicator('naive', mpi_comm)``, and so on (ChainerMN's
    modules ``chainermn.communicators.naive_communicator``, ... hold them
    on a launched rank)."""

    def __init__(self, mpi_comm=None, name='naive'):
        super().__init__(mpi.world() if mpi_comm is None else mpi_comm,
                         name)
        self.set_config('batched_copy', False)  # ChainerMN's default


class FlatCommunicator(NaiveCommunicator):
    __doc__ = NaiveCommunicator.__doc__

    def __init__(self, mpi_comm=None, name='flat'):
        super().__init__(mpi_comm, name)


class NonCudaAwareCommunicator(NaiveCommunicator):
    __doc__ = NaiveCommunicator.__doc__

    def __init__(self, mpi_comm=None, name='non_cuda_aware'):
        super().__init__(mpi_comm, name)


class PureNcclCommunicator(NaiveCommunicator):
    __doc__ = NaiveCommunicator.__doc__

    def __init__(self, mpi_comm=None, name='pure_nccl'):
        super().__init__(mpi_comm, name)


class DummyCommunicator(NaiveCommunicator):
    __doc__ = NaiveCommunicator.__doc__

    def __init__(self, mpi_comm=None, name='dummy'):
        super().__init__(mpi_comm, name)


#: ChainerMN's modules of its communicator classes, and the class each
#: holds (a launched rank's ``chainermn.communicators.<module>``).
CLASS_MODULES = {
    'naive_communicator': NaiveCommunicator,
    'flat_communicator': FlatCommunicator,
    'non_cuda_aware_communicator': NonCudaAwareCommunicator,
    'pure_nccl_communicator': PureNcclCommunicator,
    'dummy_communicator': DummyCommunicator,
}
