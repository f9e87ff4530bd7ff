"""A ChainerMN script in the style of ChainerMN's parallel-convolution
example, on synthetic CIFAR-like data (3 x 32 x 32 images, 10 classes):
a small VGG whose convolutions are split over the ranks by output
channels (:class:`ParallelConvolution2D`: each rank holds the filters of
its share of the channels, convolves the whole input, and ``allgather``
joins the shares), rank 0's data (the others an empty dataset) given to
every rank by a multi-node iterator, MomentumSGD, an Evaluator, and on
rank 0 LogReport, PlotReport (``loss.png``, ``accuracy.png``) and
PrintReport.

    mpiexec -n 2 python train_parallel_convolution.py
    dasktrain launch -n 2 -- python train_parallel_convolution.py

The same file runs under both: under ``dasktrain launch`` its ``import
chainermn`` is dasktrain's.
"""
import argparse

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import chainermn.datasets
import chainermn.functions
import chainermn.iterators
import matplotlib
import numpy as np
from chainer import training
from chainer.training import extensions

matplotlib.use('Agg')  # PlotReport's figures, without a display


class ParallelConvolution2D(L.Convolution2D):
    """A 2-D convolution of ``out_channels`` split over the ranks of
    ``comm``: this rank's link holds its share of the filters (rank r the
    r-th block, the first ``out_channels % size`` ranks one more, drawn
    from a stream of its own: ``rng``, a seed and this layer's number),
    every rank's output is the whole one. Its own counts are kept apart
    from Convolution2D's ``in_channels``/``out_channels``, which Chainer 7
    sets to this rank's share."""

    def __init__(self, comm, in_channels, out_channels, *args, rng=(0, 0),
                 **kwargs):
        self.comm = comm
        self.whole_in, self.whole_out = in_channels, out_channels
        share = out_channels // comm.size + \
            (comm.rank < out_channels % comm.size)
        kwargs.setdefault('initialW', chainer.initializers.LeCunNormal(
            rng=np.random.RandomState([*rng, comm.rank])))
        super().__init__(in_channels, share, *args, **kwargs)

    def forward(self, x):
        shares = chainermn.functions.allgather(self.comm, super().forward(x))
        return F.concat(shares, axis=1)


class VGG(chainer.Chain):
    """Two VGG blocks of channel-split convolutions, then a classifier
    every rank holds whole."""

    def __init__(self, comm, n_classes, width=16, seed=0):
        super().__init__()
        with self.init_scope():
            self.conv1 = ParallelConvolution2D(comm, 3, width, 3, pad=1,
                                               rng=(seed, 1))
            self.conv2 = ParallelConvolution2D(comm, width, 2 * width, 3,
                                               pad=1, rng=(seed, 2))
            self.fc = L.Linear(None, n_classes)

    def forward(self, x):
        # ChainerMN's multi-node iterator sends the other ranks a pair
        # dataset's arrays as float32: a float64 model takes them in its own
        h = F.cast(x, self.conv1.W.dtype)
        h = F.max_pooling_2d(F.relu(self.conv1(h)), 2)
        h = F.max_pooling_2d(F.relu(self.conv2(h)), 2)
        return self.fc(h)


class Classifier(L.Classifier):
    """Chainer's Classifier on every rank: each computes the same loss on
    the whole output, and ``allgather``'s backward adds the ranks'
    gradients of each share, so each rank back-propagates its part of
    the loss (the ranks' parts add up to one process's gradient); the
    loss reported is the whole one."""

    def __init__(self, predictor, comm):
        super().__init__(predictor)
        self.ranks = comm.size

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) / self.ranks


def synthetic_cifar(n_train, n_test, seed=0):
    """CIFAR-shaped data: 10 class centres in 3 x 32 x 32, noise; each
    value a float32 (ChainerMN sends them as such), so every rank convolves
    the same images whatever Chainer's dtype."""
    rng = np.random.RandomState(seed)
    dtype = chainer.get_dtype()
    centres = rng.normal(0, 0.5, (10, 3, 32, 32))

    def make(n):
        labels = rng.randint(0, 10, n).astype(np.int32)
        x = centres[labels] + rng.normal(0, 2.0, (n, 3, 32, 32))
        return chainer.datasets.TupleDataset(
            x.astype(np.float32).astype(dtype), labels)
    return make(n_train), make(n_test)


def main():
    parser = argparse.ArgumentParser(
        description='ChainerMN parallel convolution')
    parser.add_argument('--batchsize', '-b', type=int, default=64)
    parser.add_argument('--epoch', '-e', type=int, default=5)
    parser.add_argument('--learnrate', '-l', type=float, default=0.01)
    parser.add_argument('--gpu', '-g', action='store_true')
    # its outputs beside dasktrain's runs (git-ignored), not in the cwd
    parser.add_argument('--out', '-o',
                        default='runs/train_parallel_convolution')
    parser.add_argument('--n-train', type=int, default=2000)
    parser.add_argument('--n-test', type=int, default=500)
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()

    # ChainerMN's CPU communicator, or NCCL's between GPUs
    communicator = 'pure_nccl' if args.gpu else 'naive'
    comm = chainermn.create_communicator(communicator)
    device = comm.intra_rank if args.gpu else -1
    if comm.rank == 0:
        print(f'Num process (COMM_WORLD): {comm.size}')
        print(f'Num Minibatch-size: {args.batchsize}')
        print(f'Num epoch: {args.epoch}')

    np.random.seed(args.seed)  # the classifier, the same on every rank
    model = Classifier(VGG(comm, 10, seed=args.seed), comm)
    if device >= 0:
        chainer.cuda.get_device_from_id(device).use()
        model.to_gpu()
    optimizer = chainer.optimizers.MomentumSGD(args.learnrate)
    optimizer.setup(model)

    train, test = synthetic_cifar(args.n_train, args.n_test, args.seed)
    if comm.rank != 0:  # the data is rank 0's
        train = chainermn.datasets.create_empty_dataset(train)
        test = chainermn.datasets.create_empty_dataset(test)
    train_iter = chainermn.iterators.create_multi_node_iterator(
        chainer.iterators.SerialIterator(train, args.batchsize, shuffle=False),
        comm)
    test_iter = chainermn.iterators.create_multi_node_iterator(
        chainer.iterators.SerialIterator(test, args.batchsize, repeat=False,
                                         shuffle=False), comm)

    trainer = training.Trainer(
        training.StandardUpdater(train_iter, optimizer, device=device),
        (args.epoch, 'epoch'), out=args.out)
    trainer.extend(extensions.Evaluator(test_iter, model, device=device))
    if comm.rank == 0:
        trainer.extend(extensions.LogReport())
        trainer.extend(extensions.PlotReport(
            ['main/loss', 'validation/main/loss'], 'epoch',
            file_name='loss.png'))
        trainer.extend(extensions.PlotReport(
            ['main/accuracy', 'validation/main/accuracy'], 'epoch',
            file_name='accuracy.png'))
        trainer.extend(extensions.PrintReport(
            ['epoch', 'main/loss', 'validation/main/loss',
             'main/accuracy', 'validation/main/accuracy', 'elapsed_time']))
    trainer.run()
    chainer.serializers.save_npz(f'{args.out}/model{comm.rank}.npz', model)


if __name__ == '__main__':
    main()
