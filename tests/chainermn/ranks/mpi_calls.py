"""mpi4py's calls on a launched rank, as ChainerMN's code, its tests and
scripts written for it make them, each checked where it arrives:
``from mpi4py import MPI`` is dasktrain's, ``MPI.COMM_WORLD`` the
communicator's ``mpi_comm``; object and buffer collectives from any root;
messages matched by tag with their ``Status``; ``ssend`` back only once
received, ``send`` at once; ``Split``/``Dup``; ChainerMN's own modules
(``chainermn.testing``, ``_communication_utility``, ``MpiCommunicatorBase``
subclassed, its communicator classes, ``chainermn.nccl`` refused on a
CPU); large arrays through shared memory; debug mode's divergence;
``finalize`` on one rank alone.

    dasktrain launch -n 2 -- python mpi_calls.py
"""
import os
import time

import chainer
import chainer.links as L
import chainermn
import chainermn.testing
import numpy as np
from chainermn import nccl
from chainermn.communicators import _communication_utility, _memory_utility
from chainermn.communicators.mpi_communicator_base import MpiCommunicatorBase
from chainermn.communicators.naive_communicator import NaiveCommunicator
from chainermn.extensions import _multi_node_snapshot
from chainermn.iterators.multi_node_iterator import _build_ctrl_msg
from mpi4py import MPI

eq = np.testing.assert_array_equal
w = MPI.COMM_WORLD
r, n = w.rank, w.size
assert MPI.__name__ == 'dasktrain.chainermn.mpi', MPI
assert (w.Get_rank(), w.Get_size(), n) == (r, n, 2)
assert r == int(os.environ['DASKTRAIN_RANK'])
# mpiexec's variables, which scripts read (one machine: local = global)
assert os.environ['OMPI_COMM_WORLD_LOCAL_RANK'] == str(r)
assert os.environ['OMPI_COMM_WORLD_SIZE'] == '2'
comm = chainermn.create_communicator('naive')
assert comm.mpi_comm is w and comm.get_config('batched_copy')
assert chainermn.create_communicator('flat').mpi_comm is w  # as ChainerMN

# Objects, from any root.
assert w.bcast('x' if r == 1 else None, root=1) == 'x'
assert w.gather(r * 10, root=1) == ([0, 10] if r == 1 else None)
assert w.scatter(['a', 'b'] if r == 0 else None, root=0) == 'ab'[r]
assert w.allgather(r) == [0, 1]
assert w.alltoall([(r, 0), (r, 1)]) == [(0, r), (1, r)]
assert w.allreduce(r + 1) == 3 and w.allreduce(r, op=MPI.MAX) == 1
assert w.reduce([r], root=0) == ([0, 1] if r == 0 else None)

# Host buffers, as ChainerMN passes them.
data = bytearray(b'hello') if r == 0 else bytearray(5)
w.Bcast(data, root=0)
assert data == b'hello'
raw = bytearray(np.float32([1.5, 2.5]).tobytes()) if r == 1 else \
    bytearray(8)
w.Bcast([raw, MPI.FLOAT], root=1)
eq(np.frombuffer(raw, np.float32), [1.5, 2.5])
a = np.arange(4.0) + r
w.Allreduce(MPI.IN_PLACE, a)
eq(a, 2 * np.arange(4.0) + 1)
m = np.empty(4)
w.Allreduce(np.arange(4.0) * (r + 1), m, op=MPI.MAX)
eq(m, 2 * np.arange(4.0))
g = np.empty(4, np.int32)
w.Allgather(np.full(2, r, np.int32), g)
eq(g, [0, 0, 1, 1])
s = np.empty(2)
w.Scatter(np.arange(4.0) if r == 0 else None, s, root=0)
eq(s, np.arange(4.0)[2 * r:2 * r + 2])
total = np.empty(1)
w.Reduce(np.array([r + 1.0]), total, root=1)
assert r != 1 or total[0] == 3.0

# Messages matched by tag, with their status; ChainerMN's send_obj is
# mpi_comm's send, as in ChainerMN.
if r == 0:
    w.send('first', dest=1, tag=1)
    w.send('second', dest=1, tag=2)
    comm.send_obj({'obj': 3}, dest=1, tag=3)
    w.Send(np.arange(3, dtype=np.int64), dest=1, tag=4)
else:
    st = MPI.Status()
    assert w.recv(source=0, tag=2, status=st) == 'second'
    assert (st.Get_source(), st.Get_tag()) == (0, 2)
    assert w.recv(source=MPI.ANY_SOURCE) == 'first'
    assert comm.recv_obj(0, status=st) == {'obj': 3}
    assert (st.source, st.tag) == (0, 3)
    got = np.zeros(3, np.int64)
    w.Recv(got, source=0, tag=4, status=st)
    eq(got, np.arange(3))
    assert st.Get_count(MPI.LONG) == 3

# The ordering rule: ssend returns once the peer has received (as
# ChainerMN's send of arrays, and a GPU send over NCCL); send at once
# (rank 1 takes the later message first: had send waited, no rank would
# go on).
w.barrier()
if r == 0:
    w.send('early', dest=1, tag=5)
    w.send('late', dest=1, tag=6)
    w.ssend('sync', dest=1, tag=7)
    returned = time.time()
    received = w.recv(source=1, tag=8)
    assert returned >= received, (returned, received)
else:
    assert w.recv(source=0, tag=6) == 'late'
    assert w.recv(source=0, tag=5) == 'early'
    time.sleep(0.2)  # rank 0 waits in ssend meanwhile
    received = time.time()
    assert w.recv(source=0, tag=7) == 'sync'
    w.send(received, dest=0, tag=8)

# Large arrays to a rank of this machine go through shared memory (a
# ring of the sender's, named over the Unix socket, its name removed once
# mapped; the space reused once read); small ones inline.
assert w.sharing == {1 - r}
big = np.arange(1 << 15, dtype=np.float64)  # 256 KiB
near = w.box.comm.near


def segments(prefix):
    return [f for f in os.listdir('/dev/shm') if f.startswith(prefix)]


if r == 0:
    w.send(near.prefix, dest=1, tag=21)
    for i in range(20):  # the ring's space is reused: 5 MiB through 4
        comm.send((big + i, big[:4]), dest=1, tag=20)
    w.Send(big, dest=1, tag=22)
    assert near._out[1]._written > 0  # the ring, not one-off segments
else:
    prefix = w.recv(source=0, tag=21)
    for i in range(20):
        got = comm.recv(0, tag=20)
        eq(got[0], big + i)
        eq(got[1], big[:4])
    into = np.empty_like(big)
    w.Recv(into, source=0, tag=22)
    eq(into, big)
    assert segments(prefix) == []  # names removed once mapped or read
w.barrier()
# Both ranks send each other large messages before either receives:
# nothing waits for the other's receive (MPI's buffered send).
w.send(list(range(100_000)), dest=1 - r, tag=30)  # a 0.5 MB pickle
comm.send(big * r, dest=1 - r, tag=31)
assert w.recv(source=1 - r, tag=30) == list(range(100_000))
eq(comm.recv(1 - r, tag=31), big * (1 - r))

# Communicators of their own: Split, Dup, COMM_NULL.
alone = w.Split(color=r, key=0)
assert (alone.rank, alone.size) == (0, 1)
dup = w.Dup()
assert (dup.rank, dup.size) == (r, 2)
assert dup.bcast(r if r == 0 else None) == 0 and w.allgather(r) == [0, 1]
assert bool(w.Split(MPI.UNDEFINED if r else 0, 0)) == (r == 0)
sub = comm.split(0, -r)  # ChainerMN's split: ranks reversed by key
assert sub.rank == 1 - r and sub.mpi_comm is not w

# ChainerMN's own modules, on these ranks.
assert chainermn.testing.get_device().xp is np
assert not nccl._available and not hasattr(nccl, 'get_build_version')
try:
    _ = nccl.NcclCommunicator
except chainermn.Unsupported as e:
    assert 'chainermn.nccl.NcclCommunicator' in str(e), e
    assert '\n' not in str(e)
else:
    raise AssertionError('chainermn.nccl gave a name on a CPU rank')
obj = _communication_utility.chunked_bcast_obj(
    np.arange(10) if r == 1 else None, w, 7, root=1)
eq(obj, np.arange(10))
assert _memory_utility.array_to_buffer_object(np.ones(2)).size == 2


class NodeAware(MpiCommunicatorBase):  # as ChainerMN's own test does
    def multi_node_mean_grad(self, model):
        raise NotImplementedError


ranks = NodeAware(w)  # ChainerMN's init_ranks on Get_processor_name
assert (ranks.intra_rank, ranks.intra_size, ranks.inter_size) == \
    (comm.intra_rank, comm.intra_size, comm.inter_size) == (r, 2, 1)
naive = NaiveCommunicator(w)
assert naive.mpi_comm is w and not naive.batched_copy and naive.size == 2
assert _build_ctrl_msg(0, 1, 0, 1, 2).tolist() == [0, 1, 0, 1, 2]
assert _multi_node_snapshot.multi_node_snapshot
try:
    _ = w.Alltoallv
except chainermn.Unsupported as e:
    assert 'mpi4py.MPI.Comm.Alltoallv' in str(e), e
else:
    raise AssertionError('Alltoallv was not refused')

# Chainer's debug mode: a mean that is not finite is an error, as
# ChainerMN's ("Parameters diverged after allreduce.").
model = L.Linear(2, 3)
model.W.grad = np.full((3, 2), np.nan if r == 1 else 1.0, np.float32)
chainer.set_debug(True)
try:
    comm.multi_node_mean_grad(model)
except ValueError as e:
    assert 'diverged' in str(e)
else:
    raise AssertionError('no divergence seen')
chainer.set_debug(False)

# finalize as ChainerMN's: one rank may call it alone; all exit 0.
if r == 0:
    comm.finalize()
print(f'rank {r} ok', flush=True)
