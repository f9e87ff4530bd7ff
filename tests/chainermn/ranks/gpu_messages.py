"""GPU arrays between two GPU ranks (``dasktrain launch -n 2 --devices
0,1``; each rank sees both GPUs and uses GPU ``intra_rank``), each
checked where it arrives: send/recv of CuPy arrays and tuples of mixed
dtypes over NCCL point to point, matched by tag (a message kept for its
own recv), arriving on the current device; the collectives' results on
their array's device whatever device is current; a model's gradients
averaged in one NCCL all-reduce of one buffer, written on their device.

    python gpu_messages.py
"""
import chainer.links as L
import chainermn
import cupy
import numpy as np

comm = chainermn.create_communicator('pure_nccl')
r = comm.rank
assert comm.gpu_direct, 'every rank has NCCL: GPU arrays go over it'
mine, other = cupy.cuda.Device(comm.intra_rank), \
    cupy.cuda.Device(1 - comm.intra_rank)
mine.use()
eq = cupy.testing.assert_array_equal

sent = (cupy.arange(6, dtype=cupy.float16).reshape(2, 3),
        cupy.arange(24.0).reshape(2, 3, 4)[:, ::2],  # a strided view
        cupy.array([True, False]), cupy.zeros((0, 3), cupy.float32),
        cupy.array(7, dtype=cupy.int64))
if r == 0:
    comm.send(sent, dest=1, tag=2)
    comm.send(cupy.full(5, 7, dtype=cupy.int32), dest=1, tag=1)
    comm.send(np.ones(3), dest=1, tag=3)
    comm.send(cupy.arange(4.0), dest=1, tag=4)
else:
    one = comm.recv(0, tag=1)  # the tuple, tag 2, came first: kept
    assert isinstance(one, cupy.ndarray) and one.device.id == mine.id
    eq(one, cupy.full(5, 7, dtype=cupy.int32))
    got = comm.recv(0, tag=2)
    assert isinstance(got, tuple) and len(got) == len(sent)
    for a, b in zip(got, sent):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert a.device.id == mine.id
        eq(a, b)
    assert isinstance(comm.recv(0, tag=3), np.ndarray)  # host stays host
    with other:  # arrives on the current device, as in ChainerMN
        moved = comm.recv(0, tag=4)
    assert moved.device.id == other.id
    eq(moved, cupy.arange(4.0))

x, y = cupy.full(3, r + 1.0), cupy.full(2, r + 5.0)
with other:  # results land on x's device, not the current one
    parts = comm.allgather(x)
    total = comm.allreduce(x)
    rows = comm.alltoall([x, y])
for a in (*parts, total, *rows):
    assert a.device.id == mine.id
eq(total, cupy.full(3, 3.0))

model = L.Linear(3, 4)
model.to_gpu(mine.id)
for p in model.params():
    p.grad = cupy.full(p.shape, float(r), dtype=p.dtype)
calls = []
summing = comm._nccl.allreduce  # made by the allreduce above
comm._nccl.allreduce = lambda arrays, check=False, scale=None: \
    calls.append([a.size for a in arrays]) or summing(arrays, check, scale)
with other:
    comm.multi_node_mean_grad(model)
assert calls == [[3 * 4 + 4]], calls  # one NCCL call, one buffer
for p in model.params():
    assert p.grad.device.id == mine.id
    eq(p.grad, cupy.full(p.shape, 0.5, dtype=p.dtype))
comm.finalize()
print(f'rank {r} ok', flush=True)
