"""Two ranks train one MLP: rank 0 holds its first layer and the loss,
rank 1 its later layers (a MultiNodeChainList on each), with Adam; each
saves its parameters to OUT/rank{r}.npz. Run by ``dasktrain launch -n 2``
(its ``import chainermn`` is dasktrain's) or ``mpiexec -n 2``; ``gpu``:
each rank on GPU ``intra_rank`` (activations and gradients over NCCL).

    python mp_mlp.py OUT STEPS BATCH [gpu]
"""
import sys

import chainer
import chainer.links as L
import chainermn
import numpy as np
from parts import First, Identity, Rest, batches, mlp, params

chainer.disable_experimental_feature_warning = True
out, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
comm = chainermn.create_communicator('naive')
assert comm.size == 2
whole = mlp()
model = chainermn.MultiNodeChainList(comm)
if comm.rank == 0:
    model.add_link(First(whole), rank_in=None, rank_out=1)
    model.add_link(Identity(), rank_in=1, rank_out=None)
    target = L.Classifier(model)
else:
    model.add_link(Rest(whole), rank_in=0, rank_out=0)
    target = model
gpu = sys.argv[4:] == ['gpu']
if gpu:
    chainer.cuda.get_device_from_id(comm.intra_rank).use()
    target.to_gpu()
optimizer = chainer.optimizers.Adam()
optimizer.setup(target)
for x, t in batches(steps, batch):
    if gpu:
        x, t = chainer.cuda.to_gpu(x), chainer.cuda.to_gpu(t)
    # rank 1's output is the delegate variable of its send: its backward
    # receives the gradient from rank 0 and goes on through l3 and l2
    loss = target(x, t) if comm.rank == 0 else target()
    target.cleargrads()
    loss.backward()
    optimizer.update()
np.savez(f'{out}/rank{comm.rank}.npz', **params(model))
print(f'rank {comm.rank} saved', flush=True)
