"""The communicator's messages and collectives among 3 ranks, each checked
where it arrives: send/recv of arrays and tuples of any shape and dtype,
matched by source and tag as MPI matches them (a message with another
tag waits for its own recv); objects with tags; collectives from any
root; alltoall and scatter; split into sub-communicators with their own
ranks, collectives and messages; messages and collectives interleaved;
a model's gradients averaged in one all-reduce, summed as float16 where
``allreduce_grad_dtype`` says.

    python messages.py
"""
import chainer
import chainer.links as L
import chainermn
import numpy as np

comm = chainermn.create_communicator('flat')
r, n = comm.rank, comm.size
assert n == 3
eq = np.testing.assert_array_equal

ODD = [np.arange(6, dtype=np.float16).reshape(2, 3),
       np.array(7, dtype=np.int64),                     # 0-d
       np.zeros((0, 4), dtype=np.float32),              # empty
       np.arange(24.0).reshape(2, 3, 4)[:, ::2, 1:],    # a strided view
       np.array([True, False]), np.array([1 + 2j]), np.int8([-3])]

# Tags: rank 0 sends tags 1, 2, 3 to rank 1, which takes 3, 1, 2.
if r == 0:
    for tag in (1, 2, 3):
        comm.send(np.full(tag, tag, dtype=np.int32), dest=1, tag=tag)
    comm.send(ODD, dest=2, tag=9)
    comm.send_obj({'tagged': 4}, dest=2, tag=4)
    comm.send_obj('any', dest=2, tag=8)
elif r == 1:
    for tag in (3, 1, 2):
        eq(comm.recv(0, tag=tag), np.full(tag, tag, dtype=np.int32))
else:
    assert comm.recv_obj(0, tag=4) == {'tagged': 4}
    got = comm.recv(0, tag=9)
    assert isinstance(got, tuple) and len(got) == len(ODD)
    for a, b in zip(got, ODD):
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        eq(a, b)
    assert comm.recv_obj(0) == 'any'  # any tag

# Collectives from any root, of any shape.
x = np.arange(r + 2.0) * (r + 1)
eq(comm.bcast(x if r == 2 else None, root=2), np.arange(4.0) * 3)
got = comm.gather(x, root=1)
assert (got is None) == (r != 1)
if r == 1:
    for p, a in enumerate(got):
        eq(a, np.arange(p + 2.0) * (p + 1))
for p, a in enumerate(comm.allgather(x)):
    eq(a, np.arange(p + 2.0) * (p + 1))
parts = comm.alltoall([np.full((r + 1, q + 1), 10 * r + q, dtype=np.int32)
                       for q in range(n)])
for p, a in enumerate(parts):
    eq(a, np.full((p + 1, r + 1), 10 * p + r, dtype=np.int32))
rows = np.arange(n * 2.0).reshape(n, 2)
eq(comm.scatter(rows if r == 1 else None, root=1), rows[r])
eq(comm.scatter(tuple(np.full(q + 1, q) for q in range(n)) if r == 0
                else None), np.full(r + 1, r))
eq(comm.allreduce(np.float32([r, 1])), np.float32([3, 3]))
assert comm.bcast_obj(('from', r), root=2) == ('from', 2)
assert comm.gather_obj(r, root=2) == ([0, 1, 2] if r == 2 else None)

# A message waits while a collective goes by: rank 0 sends, then all
# broadcast; rank 2 takes the message after the broadcast.
if r == 0:
    comm.send(np.ones(3), dest=2, tag=0)
assert comm.bcast_obj('b' if r == 0 else None) == 'b'
if r == 2:
    eq(comm.recv(0), np.ones(3))

# split: ranks 0 and 2 (color 0, ordered by key: rank 2 first) and rank 1.
sub = comm.split(r % 2, -r)
assert sub.size == (2 if r != 1 else 1)
assert sub.rank == {0: 1, 1: 0, 2: 0}[r]
assert sub.allreduce_obj(r) == (2 if r != 1 else 1)
if sub.size == 2:
    if sub.rank == 0:
        sub.send((np.int16([5]),), dest=1, tag=7)
    else:
        eq(sub.recv(0, tag=7)[0], np.int16([5]))
    eq(sub.bcast(np.float64([r]), root=1), [0.0])  # sub rank 1 is rank 0
columns = comm.split(0, r)
assert (columns.rank, columns.size) == (r, n)
eq(columns.allgather(np.int32([r])), [[0], [1], [2]])

# A model's gradients: one all-reduce of them all, not one per array
# (host arrays as they are: shared memory packs them into one buffer).
model = chainer.Sequential(L.Linear(3, 4), L.Linear(4, 2))
for p in model.params():
    p.grad = np.full(p.shape, r, dtype=p.dtype)
calls = []
summing = comm.comm.allreduce


def spy(arrays, check=False, scale=None):
    calls.append([a.size for a in arrays])
    return summing(arrays, check, scale)


comm.comm.allreduce = spy
comm.multi_node_mean_grad(model)
comm.comm.allreduce = summing
assert calls == [[3 * 4, 4, 4 * 2, 2]], calls
for p in model.params():
    eq(p.grad, np.full(p.shape, 1.0))  # the mean of 0, 1, 2

# A second communicator, as ChainerMN makes one per call, summing the
# gradients as float16 (pure_nccl's allreduce_grad_dtype), cast back.
half = chainermn.create_communicator('pure_nccl',
                                     allreduce_grad_dtype='float16')
assert half.get_config('allreduce_grad_dtype') == np.float16
assert (half.rank, half.size) == (r, n)
model = chainer.Sequential(L.Linear(3, 2))
for p in model.params():
    p.grad = np.full(p.shape, (r + 1) / 3, dtype=np.float32)
dtypes = []
summing = half.comm.allreduce
half.comm.allreduce = lambda arrays, check=False, scale=None: \
    dtypes.extend(a.dtype for a in arrays) or summing(arrays, check, scale)
half.multi_node_mean_grad(model)
assert dtypes == [np.float16], dtypes
mean = np.float16(1 / 3) + np.float16(2 / 3)
mean = (mean + np.float16(3 / 3)) * np.float16(1 / 3)
for p in model.params():
    assert p.grad.dtype == np.float32
    eq(p.grad, np.full(p.shape, np.float32(mean)))
half.finalize()

comm.finalize()
print(f'rank {r} ok', flush=True)
