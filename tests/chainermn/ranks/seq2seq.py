"""An encoder-decoder split over two ranks, as ChainerMN's seq2seq
example splits it: rank 0 encodes the source sentences and sends the
final LSTM states (``create_multi_node_n_step_rnn(..., rank_out=1)``,
whose two sends ``pseudo_connect`` joins into one delegate variable),
rank 1 receives them as its decoder's initial states (``rank_in=0``) and
computes the loss on the target sentences. Both draw the same batches
(``create_synchronized_iterator``). Trained with Adam; each rank saves
its parameters and the batches it drew to OUT/rank{r}.npz.

    python seq2seq.py OUT STEPS BATCH
"""
import sys

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy as np
from parts import EMBED, LAYERS, pairs, params, seq2seq

chainer.disable_experimental_feature_warning = True
out, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
comm = chainermn.create_communicator('naive')
encoder, decoder = seq2seq()
mine = encoder if comm.rank == 0 else decoder
model = chainer.Chain()
with model.init_scope():
    model.embed = L.EmbedID(*mine.embed.W.shape)
    model.rnn = chainermn.links.create_multi_node_n_step_rnn(
        L.NStepLSTM(LAYERS, EMBED, EMBED, 0.0), comm,
        rank_in=None if comm.rank == 0 else 0,
        rank_out=1 if comm.rank == 0 else None)
    if comm.rank == 1:
        model.out = L.Linear(*decoder.out.W.shape[::-1])
model.embed.copyparams(mine.embed)
model.rnn.actual_rnn.copyparams(mine.rnn)
if comm.rank == 1:
    model.out.copyparams(decoder.out)
optimizer = chainer.optimizers.Adam()
optimizer.setup(model)

np.random.seed(7)  # rank 0's seed of the shared order
data = pairs(4 * batch)
iterator = chainermn.iterators.create_synchronized_iterator(
    chainer.iterators.SerialIterator(list(range(len(data))), batch), comm)
drawn = []
for _ in range(steps):
    indices = iterator.next()
    drawn.append(indices)
    if comm.rank == 0:
        xs = [model.embed(data[i][0]) for i in indices]
        _, _, _, delegate = model.rnn(xs)
        loss = delegate
    else:
        ys = [data[i][1] for i in indices]
        _, _, os, _ = model.rnn([model.embed(y[:-1]) for y in ys])
        loss = F.softmax_cross_entropy(
            model.out(F.concat(os, axis=0)),
            np.concatenate([y[1:] for y in ys]))
    model.cleargrads()
    loss.backward()
    optimizer.update()
saved = {name: a for name, a in params(model).items()}
np.savez(f'{out}/rank{comm.rank}.npz', drawn=np.array(drawn), **saved)
print(f'rank {comm.rank} saved', flush=True)
