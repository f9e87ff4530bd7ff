"""A convolution split over the ranks by output channels: rank r holds
the weights of its block of channels, convolves the whole input, and
``allgather`` + ``concat`` make the whole output on every rank. Every rank
computes the loss on it, divided by the number of ranks: the ranks'
losses add up to the one process's, and ``allgather``'s backward brings
each rank the gradient of its channels from all of them. Trained with
Adam; each rank saves its parameters and first output to OUT/rank{r}.npz.

    python parallel_conv.py OUT STEPS BATCH
"""
import sys

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import chainermn.functions
import numpy as np
from parts import CLASSES, IN_CHANNELS, channels, conv, conv_loss, images

chainer.disable_experimental_feature_warning = True
out, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
comm = chainermn.create_communicator('naive')
mine = channels(comm.rank, comm.size)
whole = conv()
link = L.Convolution2D(IN_CHANNELS, mine.stop - mine.start, ksize=3, pad=1)
link.W.array[...] = whole.W.array[mine]
link.b.array[...] = whole.b.array[mine]
optimizer = chainer.optimizers.Adam()
optimizer.setup(link)
first = None
for x, t in images(steps, batch):
    y = F.concat(chainermn.functions.allgather(comm, link(x)), axis=1)
    assert y.shape[1] == CLASSES
    first = np.array(y.array) if first is None else first
    link.cleargrads()
    (conv_loss(y, t) / comm.size).backward()
    optimizer.update()
np.savez(f'{out}/rank{comm.rank}.npz', W=link.W.array, b=link.b.array,
         first=first)
print(f'rank {comm.rank} saved', flush=True)
