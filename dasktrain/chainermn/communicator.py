"""ChainerMN's communicator on dasktrain's collectives.

:func:`create_communicator` takes any ChainerMN communicator name and
returns a :class:`DaskCommunicator`: the ChainerMN
:class:`chainermn.CommunicatorBase` interface over the dasktrain
communicator that :func:`dasktrain.parallel.comm.rendezvous.join` makes
from the environment ``dasktrain launch`` sets: shared memory between the
ranks of one machine, TLS (or TCP) between machines. ChainerMN names a
transport (MPI, NCCL, CUDA-aware or not); here the best one for where the
ranks are is taken whatever the name, and rank 0 says once which.

Its parts: the ranks (``rank``, ``size``, ``intra_rank``, ...),
``split``, ``finalize`` and leaving at exit here; the array and object
calls (``send``/``recv`` matched by source and tag, the collectives from
any root) are :mod:`~dasktrain.chainermn.arrays`'; the calls on a
model's arrays (``bcast_data``, ``multi_node_mean_grad``, batch
normalisation's mean), each one collective of packed buffers, are
:mod:`~dasktrain.chainermn.models`'.

Point-to-point messages travel over connections of their own (a split
of the ranks' communicator with every rank in it, MPI's duplicate), so
that a message waiting for its ``recv`` never stands in a collective's
way.
"""
import atexit
import os
import sys

import numpy as np
from chainermn.communicators.communicator_base import CommunicatorBase

from dasktrain.chainermn.arrays import ArrayCalls
from dasktrain.chainermn.models import ModelCalls
from dasktrain.chainermn.support import Unsupported, fatal, say
from dasktrain.parallel.comm.base import CollectiveError, Solo
from dasktrain.parallel.comm.mailbox import Mailbox
from dasktrain.parallel.comm.rendezvous import JOB, join
from dasktrain.parallel.placement import machine_place

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
    if mpi_comm is not None:
        raise Unsupported('create_communicator(mpi_comm=...)',
                          'ranks meet through `dasktrain launch`, not MPI')
    dtype = kwargs.pop('allreduce_grad_dtype', None)
    batched_copy = kwargs.pop('batched_copy', True)
    if kwargs:
        raise TypeError('create_communicator() got unexpected keyword '
                        f'argument(s) {", ".join(sorted(kwargs))}')
    if dtype is not None and communicator_name != 'pure_nccl':
        raise ValueError("allreduce_grad_dtype is only available at "
                         "'pure_nccl' communicator.")
    comm = DaskCommunicator(join(_environment()), communicator_name)
    comm.set_config('allreduce_grad_dtype', dtype)
    comm.set_config('batched_copy', batched_copy)
    if comm.rank == 0 and comm.size > 1:
        say(f'dasktrain.chainermn: {communicator_name!r} runs on '
            f'{comm.transport} among {comm.size} ranks on '
            f'{comm.inter_size} machine(s)'
            + ('; GPU arrays go rank to rank over NCCL'
               if comm.gpu_direct else ''))
    return comm


_made = [0]  # communicators this process has made


def _environment():
    """The environment the next communicator joins from: every call makes
    a new one (as ChainerMN's), all ranks in the same order, each meeting
    under a name of its own (``DASKTRAIN_JOB#k``)."""
    made, _made[0] = _made[0], _made[0] + 1
    if made == 0 or JOB not in os.environ:
        return os.environ
    return dict(os.environ, **{JOB: f'{os.environ[JOB]}#{made}'})


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


class DaskCommunicator(ArrayCalls, ModelCalls, CommunicatorBase):
    """ChainerMN's communicator interface over a dasktrain communicator.

    Parameters
    ----------
    comm : dasktrain.parallel.comm.base.Communicator
        The rank's collectives (``DaskComm`` or ``Solo``).
    name : str
        The ChainerMN name it was created with.

    Attributes
    ----------
    box : dasktrain.parallel.comm.mailbox.Mailbox
        Point-to-point messages, matched by source and tag.
    gpu_direct : bool
        Whether GPU arrays sent to a rank travel over NCCL (every rank
        has NCCL), rather than through host memory.
    """

    def __init__(self, comm, name='pure_nccl'):
        super().__init__()
        self.comm, self.name = comm, name
        # intra_rank: the rank's place among its machine's ranks, by the
        # machine the communicator knows it on (its listening host, which
        # clones of one image do not share, unlike their hostname).
        facts = comm.allgather((comm.machine,
                                comm.size > 1 and gpu_direct_possible()))
        self._ranks = machine_place([m for m, _ in facts], comm.rank)
        self.gpu_direct = all(ok for _, ok in facts) and comm.size > 1
        self.allreduce_grad_dtype = None  # set_config's
        self.batched_copy = True
        self._closed = False
        self._nccl = None  # NcclComm, or False: decided at the first GPU sum
        self._pending = None  # double buffering: (reduction, packed)
        self._side = None     # ... its side stream, made once
        self._pairs = {}      # NCCL point to point, one per direction
        # Point to point on connections of its own (MPI's Comm_dup).
        self._p2p = comm.split(0, comm.rank, shared_memory=False) \
            if comm.size > 1 else comm
        self.box = Mailbox(self._p2p, arrival=self._arrived)
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
            for pair in self._pairs.values():
                pair.close()
            if self._nccl:
                self._nccl.close()
            if self._p2p is not self.comm:
                self._p2p.close()
            self.comm.close()

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
        sub = self.comm.split(int(color), key) if self.size > 1 else Solo()
        child = DaskCommunicator(sub, self.name)
        for name, value in self.get_config().items():
            child.set_config(name, value)
        return child

    @fatal
    def allreduce_obj(self, obj):
        """The sum (``+``) of every rank's ``obj``, in rank order."""
        got = self.comm.allgather(obj)
        total = got[0]
        for other in got[1:]:
            total = total + other
        return total

    @fatal
    def finalize(self):
        """Leave the job: every rank waits for the others, then the
        connections close. Called again, it does nothing."""
        if self._closed:
            return
        try:
            self.comm.barrier()
        finally:
            self._close()
