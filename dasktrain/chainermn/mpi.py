"""mpi4py's ``MPI`` on dasktrain's communicators: what ChainerMN's code,
its tests and scripts written for it call on an MPI communicator, on the
same transport as :mod:`dasktrain.chainermn` (shared memory on one
machine, TLS or TCP between machines), without MPI.

On a rank of ``dasktrain launch`` (unless ``--no-chainermn``) a script's
``from mpi4py import MPI`` gets this module (the launch's shim folder
holds an ``mpi4py`` package that loads it, see
:mod:`~dasktrain.chainermn.substitution`): ``MPI.COMM_WORLD`` is a
:class:`Comm` of every rank of the launch, joined at its first use;
``chainermn.create_communicator()`` without ``mpi_comm`` uses it, as
ChainerMN uses ``mpi4py.MPI.COMM_WORLD``, and ``comm.mpi_comm`` is the
:class:`Comm` a communicator runs on.

A :class:`Comm` offers mpi4py's object calls (``bcast``, ``gather``,
``scatter``, ``allgather``, ``alltoall``, ``allreduce``, ``reduce``,
``barrier``, ``send``, ``ssend``, ``recv``, ``sendrecv``), the buffer
calls ChainerMN makes on host buffers (``Bcast``, ``Allreduce``,
``Reduce``, ``Allgather``, ``Gather``, ``Scatter``, ``Send``, ``Ssend``,
``Recv``), ``Split``, ``Dup``, ``Free``, ``Abort`` and the ranks. Any other
mpi4py name raises :class:`~dasktrain.chainermn.support.Unsupported`
(which is also an ``AttributeError``), one line naming it.

Messages are matched by source and tag as MPI matches them
(:class:`~dasktrain.parallel.comm.mailbox.Mailbox`); ``ssend`` returns
once the receiver has taken the message (MPI's synchronous send), ``send``
once it is on its way. ``ANY_SOURCE`` needs one peer (a job of two
ranks): the others are refused. Every rank makes the collective calls in
the same order, as under MPI; a peer that is lost ends the rank with one
line, as MPI's fatal errors do.
"""
import atexit
import os
import sys
import threading

import numpy as np

from dasktrain.chainermn.mpitypes import *  # noqa: F403 (mpi4py's names)
from dasktrain.chainermn.mpitypes import (
    ANY_SOURCE,
    ANY_TAG,
    IN_PLACE,
    SUM,
    UNDEFINED,
    Get_processor_name,
    UnsupportedName,
    buffer_of,
    fill,
    into,
    ompi_environment,
    reduce_in_order,
    typedict,
)
from dasktrain.chainermn.support import Unsupported, fatal
from dasktrain.parallel.comm.base import CollectiveError, Solo
from dasktrain.parallel.comm.mailbox import ANY, Mailbox
from dasktrain.parallel.comm.nearby import Nearby, NearCollectives, Routes
from dasktrain.parallel.comm.rendezvous import join, launched

#: mpi4py's name of it (ChainerMN reads ``MPI._typedict``).
_typedict = typedict


def sharing(comm):
    """The other ranks of ``comm`` that share this rank's machine and
    ``/dev/shm``, as its shared-memory probe found (none where
    ``DASKTRAIN_SHARED_MEMORY=0``)."""
    if comm.size == 1:
        return frozenset()
    mine = next((g for g in comm.hosts if comm.rank in g), [comm.rank])
    return frozenset(mine) - {comm.rank}


class Comm:
    """An mpi4py intra-communicator over a dasktrain communicator.

    Parameters
    ----------
    comm : dasktrain.parallel.comm.base.Communicator
        Its collectives (a ``DaskComm``, or a ``Solo`` for one rank).
    p2p : optional
        Its point-to-point messages' own connections (``send(obj, dest)``,
        ``recv(source)``, ``close()``: :meth:`over`'s, so that a message
        waiting for its receive never stands in a collective's way); None
        for one rank.

    Attributes
    ----------
    box : dasktrain.parallel.comm.mailbox.Mailbox
        The tagged messages of every user of this communicator (ChainerMN's
        communicators built on it among them, as under MPI).
    in_flight : callable or None
        Set by a user with a collective still running on a thread of its
        own (ChainerMN's double buffering): every call finishes it first,
        so the ranks' collectives stay in one order.
    pairs : dict
        The two-rank NCCL communicators of GPU arrays sent point to point
        (:mod:`dasktrain.chainermn.arrays`'), closed with the connections.
    sharing : frozenset
        The other ranks that share this rank's machine and ``/dev/shm``
        (the communicator's shared-memory probe): messages to them go
        down Unix domain sockets, their large host arrays through shared
        memory (:mod:`~dasktrain.parallel.comm.nearby`).
    """

    def __init__(self, comm, p2p=None, small=None):
        self.dask, self._p2p = comm, p2p
        #: the collectives of objects: ``small``'s where every rank is on
        #: this machine (NearCollectives), else the Dask comms'
        self.small = small or comm
        self.box = Mailbox(p2p if p2p is not None else comm)
        self.in_flight = None
        self.pairs = {}
        self.sharing = sharing(comm)
        self.name = 'MPI_COMM_WORLD'
        self._closed = False
        if comm.size > 1:
            atexit.register(self._at_exit)

    @classmethod
    def over(cls, comm):
        """A Comm over ``comm`` with point-to-point connections of its
        own (a collective: every rank of ``comm`` calls it): Unix domain
        sockets to the ranks of this machine, and, where some rank is on
        another machine, a split of ``comm`` with every rank in it."""
        if comm.size == 1:
            return cls(comm)
        near = Nearby.connect(comm, sharing(comm))
        far = small = None
        if len(comm.hosts) > 1:
            far = comm.split(0, comm.rank, shared_memory=False)
        else:  # every rank here: object collectives over sockets too
            small = NearCollectives(Nearby.connect(comm, sharing(comm)),
                                    comm.rank, comm.size)
        return cls(comm, Routes(near, far), small)

    def __repr__(self):
        return f'<dasktrain MPI.Comm {self.name}: rank {self.rank} of ' \
               f'{self.size}>'

    def __getattr__(self, name):
        if name.startswith('_'):
            raise AttributeError(name)
        raise UnsupportedName(f'mpi4py.MPI.Comm.{name}',
                              'dasktrain.chainermn.mpi offers what '
                              "ChainerMN's code and tests call "
                              '(docs/chainermn.md)')

    # ------------------------------------------------ who

    rank = property(lambda self: self.dask.rank)
    size = property(lambda self: self.dask.size)

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Is_inter(self):
        return False

    def Is_intra(self):
        return True

    def Get_name(self):
        return self.name

    def Set_name(self, name):
        self.name = name

    @property
    def machine(self):
        """The machine this rank is on, as the ranks tell machines apart
        (the host it listens on); :func:`Get_processor_name`'s."""
        return self.dask.machine or Get_processor_name()

    # ------------------------------------------------ life

    def _settle(self):
        if self.in_flight is not None:
            finish, self.in_flight = self.in_flight, None
            finish()

    @fatal
    def Split(self, color=0, key=0):
        """The ranks that give the same ``color``, ranked by ``key`` (ties
        by rank), as a communicator of their own; ``UNDEFINED``: none
        (``COMM_NULL``). Every rank calls it."""
        self._settle()
        if self.size == 1:
            return Comm(Solo()) if color != UNDEFINED else COMM_NULL
        undefined = color == UNDEFINED
        sub = self.dask.split(('none', self.rank) if undefined else
                              int(color), key)
        if undefined:
            sub.close()
            return COMM_NULL
        return Comm.over(sub)

    def Dup(self):
        """A communicator of the same ranks, with connections (and so
        messages) of its own."""
        return self.Split(0, self.rank)

    Clone = Dup

    def Free(self):
        """Close this communicator's connections (every rank calls it)."""
        self._close()

    def Disconnect(self):
        self._close()

    def Abort(self, errorcode=0):
        """End this rank at once with ``errorcode``; ``dasktrain launch``
        then stops the others, as ``mpiexec`` does."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(errorcode if 0 < errorcode < 256 else 1)

    def _at_exit(self):
        """A normal exit leaves as ``DaskComm`` does, as MPI's
        ``MPI_Finalize`` (collective) leaves: once every rank has come
        (a barrier), so no rank closes while a peer still reads a message
        it sent (a connection closed with data unread drops what is still
        in flight). After an uncaught error, the connections just close:
        the peers fail fast."""
        if self._closed:
            return
        try:
            if getattr(sys, 'last_value', None) is None:
                self._settle()
                self.dask.barrier()
        except CollectiveError:  # a peer already gone
            pass
        finally:
            self._close()

    def _close(self):
        if not self._closed:
            self._closed = True
            for pair in self.pairs.values():
                pair.close()
            self.pairs.clear()
            if self._p2p is not None:
                self._p2p.close()
            if self.small is not self.dask:
                self.small.close()
            self.dask.close()

    # ------------------------------------------------ objects

    def _check_root(self, root):
        if not 0 <= root < self.size:
            raise ValueError(f'root must be a rank of 0..{self.size - 1}, '
                             f'got {root}')

    def _others(self):
        return [p for p in range(self.size) if p != self.rank]

    def _exchange(self, send, receive):
        if self.size == 1:
            return {}
        return self.small.exchange(send, receive)

    @fatal
    def barrier(self):
        """Return once every rank has called it."""
        self._settle()
        self.small.barrier()

    Barrier = barrier

    @fatal
    def bcast(self, obj, root=0):
        """Rank ``root``'s ``obj`` on every rank."""
        self._check_root(root)
        self._settle()
        if self.size == 1:
            return obj
        if root == 0:
            return self.small.bcast(obj)
        if self.rank == root:
            self._exchange(dict.fromkeys(self._others(), obj), [])
            return obj
        return self._exchange({}, [root])[root]

    @fatal
    def gather(self, sendobj, root=0):
        """Every rank's ``sendobj``, in rank order, on ``root``; else
        None."""
        self._check_root(root)
        self._settle()
        if self.size == 1:
            return [sendobj]
        if root == 0:
            return self.small.gather(sendobj)
        if self.rank != root:
            self._exchange({root: sendobj}, [])
            return None
        got = self._exchange({}, self._others())
        got[root] = sendobj
        return [got[p] for p in range(self.size)]

    @fatal
    def scatter(self, sendobj, root=0):
        """``sendobj[r]`` of rank ``root`` on each rank r (``sendobj``:
        ``size`` objects on the root, ignored elsewhere)."""
        self._check_root(root)
        self._settle()
        if self.rank != root:
            return self._exchange({}, [root])[root]
        objs = list(sendobj)
        if len(objs) != self.size:
            raise ValueError(f'scatter needs {self.size} objects (one per '
                             f'rank), got {len(objs)}')
        self._exchange({p: objs[p] for p in self._others()}, [])
        return objs[root]

    @fatal
    def allgather(self, sendobj):
        """Every rank's ``sendobj``, in rank order, on every rank."""
        self._settle()
        return self.small.allgather(sendobj)

    @fatal
    def alltoall(self, sendobj):
        """Rank p's ``sendobj[r]`` from every rank p, in rank order, on
        each rank r."""
        self._settle()
        objs = list(sendobj)
        if len(objs) != self.size:
            raise ValueError(f'alltoall needs {self.size} objects (one per '
                             f'rank), got {len(objs)}')
        others = self._others()
        got = self._exchange({p: objs[p] for p in others}, others)
        got[self.rank] = objs[self.rank]
        return [got[p] for p in range(self.size)]

    def allreduce(self, sendobj, op=SUM):
        """Every rank's ``sendobj`` reduced with ``op``, in rank order
        (``+`` for SUM), on every rank."""
        return reduce_in_order(self.allgather(sendobj), op)

    def reduce(self, sendobj, op=SUM, root=0):
        """:meth:`allreduce` on ``root`` alone; None elsewhere."""
        got = self.gather(sendobj, root)
        return None if got is None else reduce_in_order(got, op)

    # ------------------------------------------------ point to point

    def _check_peer(self, rank, what):
        if not 0 <= rank < self.size or rank == self.rank:
            raise ValueError(f'{what} must be another rank of 0..'
                             f'{self.size - 1} than this one '
                             f'({self.rank}), got {rank}')

    def _source(self, source):
        if source == ANY_SOURCE:
            if self.size != 2:
                raise Unsupported(
                    f'recv from ANY_SOURCE among {self.size} ranks',
                    'name the source rank')
            return 1 - self.rank
        self._check_peer(source, 'source')
        return source

    @staticmethod
    def _tag(tag):
        if tag is None or tag == ANY_TAG:
            return ANY
        if not isinstance(tag, (int, np.integer)) or tag < 0:
            raise ValueError(f'tag must be an int >= 0 or ANY_TAG, got '
                             f'{tag!r}')
        return int(tag)

    @fatal
    def send(self, obj, dest, tag=0):
        """Send ``obj`` to rank ``dest``; it returns once the message is
        on its way (MPI's standard send, buffered)."""
        self._check_peer(dest, 'dest')
        self.box.send(('obj', obj, None, None), dest, self._tag(tag))

    @fatal
    def ssend(self, obj, dest, tag=0):
        """Send ``obj`` to rank ``dest``; it returns once ``dest`` has
        received it (MPI's synchronous send)."""
        self._check_peer(dest, 'dest')
        self.box.send(('obj', obj, None, None), dest, self._tag(tag),
                      sync=True)

    @fatal
    def recv(self, buf=None, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        """The object rank ``source`` sent with ``tag`` (any with
        ``ANY_TAG``); ``status`` (an ``MPI.Status``) is set to its
        source and tag."""
        source = self._source(source)
        got, (kind, obj, _, _) = self.box.recv_tagged(source,
                                                      self._tag(tag))
        if kind != 'obj':
            raise TypeError(f'rank {source} sent {kind} with tag {got}, '
                            'which recv does not take')
        fill(status, source, got)
        return obj

    def sendrecv(self, sendobj, dest, sendtag=0, recvbuf=None,
                 source=ANY_SOURCE, recvtag=ANY_TAG, status=None):
        """:meth:`send` to ``dest``, then :meth:`recv` from ``source``."""
        self.send(sendobj, dest, sendtag)
        return self.recv(recvbuf, source, recvtag, status)

    @fatal
    def Send(self, buf, dest, tag=0):
        """Send the host buffer ``buf`` to rank ``dest`` (a copy of it is
        on its way when this returns)."""
        self._check_peer(dest, 'dest')
        data = np.array(buffer_of(buf, 'Send buffer'), copy=True)
        self.box.send(('buffer', data, None, None), dest, self._tag(tag))

    @fatal
    def Ssend(self, buf, dest, tag=0):
        """:meth:`Send`, returning once ``dest`` has received it."""
        self._check_peer(dest, 'dest')
        data = np.array(buffer_of(buf, 'Ssend buffer'), copy=True)
        self.box.send(('buffer', data, None, None), dest, self._tag(tag),
                      sync=True)

    @fatal
    def Recv(self, buf, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        """Receive into the host buffer ``buf`` what rank ``source`` sent
        with ``Send`` (at most ``buf``'s bytes: a longer message is an
        error, as MPI's truncation)."""
        source = self._source(source)
        target = buffer_of(buf, 'Recv buffer')
        got, (kind, data, _, _) = self.box.recv_tagged(source,
                                                       self._tag(tag))
        if kind != 'buffer':
            raise TypeError(f'rank {source} sent {kind} with tag {got}, '
                            'which Recv does not take')
        raw = target.view(np.uint8)
        if data.nbytes > raw.nbytes:
            raise ValueError(f'message truncated: rank {source} sent '
                             f'{data.nbytes} bytes into a buffer of '
                             f'{raw.nbytes}')
        raw[:data.nbytes] = data.reshape(-1).view(np.uint8)
        fill(status, source, got, data.nbytes)

    # ------------------------------------------------ buffers

    @fatal
    def Bcast(self, buf, root=0):
        """Rank ``root``'s host buffer ``buf`` into every rank's."""
        self._check_root(root)
        self._settle()
        array = buffer_of(buf, 'Bcast buffer')
        if self.size == 1:
            return
        if self.rank == root:
            self._exchange(dict.fromkeys(self._others(), array), [])
            return
        got = self._exchange({}, [root])[root]
        into(array, got, f'rank {root}')

    @fatal
    def Allreduce(self, sendbuf, recvbuf, op=SUM):
        """``sendbuf`` of every rank reduced with ``op`` into ``recvbuf``
        (``sendbuf`` ``IN_PLACE``: ``recvbuf`` itself), elementwise, in
        rank order."""
        self._settle()
        target = buffer_of(recvbuf, 'Allreduce receive buffer')
        if sendbuf is not IN_PLACE:
            into(target, buffer_of(sendbuf, 'Allreduce send buffer'),
                 'the send buffer')
        if self.size == 1:
            return
        if op is SUM:
            self.dask.allreduce([target])
            return
        into(target, reduce_in_order(self.small.allgather(target), op.ufunc),
             'the sum')

    @fatal
    def Reduce(self, sendbuf, recvbuf, op=SUM, root=0):
        """:meth:`Allreduce` into ``recvbuf`` of ``root`` alone."""
        self._check_root(root)
        self._settle()
        mine = buffer_of(recvbuf if sendbuf is IN_PLACE else sendbuf,
                         'Reduce buffer')
        got = self.gather(np.array(mine, copy=True), root)
        if got is not None:
            into(buffer_of(recvbuf, 'Reduce receive buffer'),
                  reduce_in_order(got, op.ufunc), 'the sum')

    @fatal
    def Allgather(self, sendbuf, recvbuf):
        """Every rank's ``sendbuf``, in rank order, one after the other in
        every rank's ``recvbuf``."""
        self._settle()
        got = self.small.allgather(np.array(
            buffer_of(sendbuf, 'Allgather send buffer'), copy=True))
        into(buffer_of(recvbuf, 'Allgather receive buffer'),
              np.concatenate([g.reshape(-1) for g in got]), 'the parts')

    @fatal
    def Gather(self, sendbuf, recvbuf, root=0):
        """Every rank's ``sendbuf``, in rank order, into ``recvbuf`` of
        ``root``."""
        got = self.gather(np.array(buffer_of(sendbuf, 'Gather send buffer'),
                                   copy=True), root)
        if got is not None:
            into(buffer_of(recvbuf, 'Gather receive buffer'),
                  np.concatenate([g.reshape(-1) for g in got]), 'the parts')

    @fatal
    def Scatter(self, sendbuf, recvbuf, root=0):
        """The r-th of ``size`` equal parts of ``root``'s ``sendbuf`` into
        rank r's ``recvbuf``."""
        parts = None
        if self.rank == root:
            whole = buffer_of(sendbuf, 'Scatter send buffer')
            if whole.size % self.size:
                raise ValueError(f'Scatter send buffer of {whole.size} '
                                 f'elements does not split into '
                                 f'{self.size} equal parts')
            parts = [np.array(p, copy=True)
                     for p in np.split(whole, self.size)]
        into(buffer_of(recvbuf, 'Scatter receive buffer'),
              self.scatter(parts, root), f'rank {root}')


class _NullComm:
    """``MPI.COMM_NULL``: what a rank gets from ``Split(UNDEFINED)``."""

    def __bool__(self):
        return False

    def __repr__(self):
        return 'MPI.COMM_NULL'


COMM_NULL = _NullComm()
Intracomm = Comm

_world = []
_world_lock = threading.Lock()


def world():
    """``COMM_WORLD``: every rank of the launch, joined (from the
    environment ``dasktrain launch`` sets) at its first use; one rank
    alone outside a launch. Where it is a launched rank's ``mpi4py.MPI``,
    the rank then has ``mpiexec``'s variables (``mpitypes.OMPI``) too."""
    with _world_lock:
        if not _world:
            comm = Comm.over(join())
            _world.append(comm)
            if launched() and sys.modules.get('mpi4py.MPI') is \
                    sys.modules[__name__]:
                os.environ.update(ompi_environment(
                    comm.allgather(comm.machine), comm.rank))
        return _world[0]


def self_comm():
    """``COMM_SELF``: this rank alone."""
    comm = Comm(Solo())
    comm.name = 'MPI_COMM_SELF'
    return comm


def __getattr__(name):
    if name == 'COMM_WORLD':
        return world()
    if name == 'COMM_SELF':
        return self_comm()
    if name == 'Exception':  # mpi4py's error class; not the builtin here
        return CollectiveError
    if name.startswith('__'):
        raise AttributeError(name)
    raise UnsupportedName(f'mpi4py.MPI.{name}',
                          'dasktrain.chainermn.mpi offers what '
                          "ChainerMN's code and tests call "
                          '(docs/chainermn.md)')
