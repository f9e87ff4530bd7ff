"""Four ranks, 2 x 2 (ChainerMN's dual parallelism): two replicas of an
MLP split over two ranks each. As in ChainerMN's example, rank r is part
``r % 2`` of the model (0: the first layer and the loss, 1: the later
layers) in replica ``r // 2``; ``data_comm`` joins the ranks holding the
same part (the multi-node optimizer averages their gradients),
``model_comm`` the two parts of one replica. Replica m trains on half m of
every batch of 2 * BATCH. Each rank saves its parameters to
OUT/rank{r}.npz.

    python dual_mlp.py OUT STEPS BATCH
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
data_axis, model_axis = comm.rank % 2, comm.rank // 2
data_comm = comm.split(data_axis, comm.rank)
model_comm = comm.split(model_axis, comm.rank)
assert model_comm.size == 2 and data_comm.size == comm.size // 2
assert model_comm.rank == data_axis and data_comm.rank == model_axis
whole = mlp()
model = chainermn.MultiNodeChainList(model_comm)
if data_axis == 0:
    model.add_link(First(whole), rank_in=None, rank_out=1)
    model.add_link(Identity(), rank_in=1, rank_out=None)
    target = L.Classifier(model)
else:
    model.add_link(Rest(whole), rank_in=0, rank_out=0)
    target = model
optimizer = chainermn.create_multi_node_optimizer(
    chainer.optimizers.Adam(), data_comm)
optimizer.setup(target)
for x, t in batches(steps, batch * data_comm.size):
    part = slice(model_axis * batch, (model_axis + 1) * batch)
    loss = target(x[part], t[part]) if data_axis == 0 else target()
    target.cleargrads()
    loss.backward()
    optimizer.update()
np.savez(f'{out}/rank{comm.rank}.npz', **params(model))
print(f'rank {comm.rank} saved', flush=True)
