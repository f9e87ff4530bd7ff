"""The seed post's network trained the plain Chainer way (a Trainer, a
StandardUpdater over a SerialIterator, an Evaluator, LogReport), on a
CIFAR-10-format folder, with no augmentation: the anchor
``bench/vs_chainer.py`` holds ``dasktrain train`` against. Depends on
Chainer alone (and ChainerMN with ``--chainermn``), not on dasktrain.

    python train_cifar.py --data DIR/cifar-10-batches-py
    mpiexec -n 2 python train_cifar.py --data ... --chainermn

Prints ``throughput: X images/s, Y s``: the images trained over the
seconds spent in the updater's steps from the second epoch on (the first
includes warming up), over all ranks.
"""
import argparse
import pickle
import time
from pathlib import Path

import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
from chainer import training
from chainer.training import extensions


class Cifar10(chainer.Chain):
    """The seed post's network (after mitmul's chainer-cifar10)."""

    def __init__(self, n_classes=10):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, 32, 5, stride=1, pad=2)
            self.conv2 = L.Convolution2D(32, 32, 5, stride=1, pad=2)
            self.conv3 = L.Convolution2D(32, 64, 5, stride=1, pad=2)
            self.fc4 = L.Linear(1344, 4096)
            self.fc5 = L.Linear(4096, n_classes)

    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.conv1(x)), 3, stride=2)
        h = F.max_pooling_2d(F.relu(self.conv2(h)), 3, stride=2)
        h = F.relu(self.conv3(h))
        h = F.spatial_pyramid_pooling_2d(h, 3, pooling='max')
        h = F.dropout(F.relu(self.fc4(h)), ratio=0.5)
        return self.fc5(h)


def load(folder, n_train, n_test):
    """CIFAR-10's python pickles: (train, test) TupleDatasets, float32
    images normalised per channel with the training set's statistics."""
    def read(names):
        xs, ys = [], []
        for name in names:
            with open(Path(folder) / name, 'rb') as f:
                batch = pickle.load(f, encoding='bytes')
            xs.append(np.asarray(batch[b'data'], np.uint8))
            ys.append(np.asarray(batch[b'labels'], np.int32))
        return (np.concatenate(xs).reshape(-1, 3, 32, 32).astype(np.float32),
                np.concatenate(ys))
    x, y = read([f'data_batch_{i}' for i in range(1, 6)])
    xt, yt = read(['test_batch'])
    x, y, xt, yt = x[:n_train], y[:n_train], xt[:n_test], yt[:n_test]
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    std = x.std(axis=(0, 2, 3), keepdims=True)
    return (chainer.datasets.TupleDataset((x - mean) / std, y),
            chainer.datasets.TupleDataset((xt - mean) / std, yt))


class Timed(training.StandardUpdater):
    """StandardUpdater that counts the seconds of its steps and their
    images after the first epoch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds, self.images = 0.0, 0

    def update_core(self):
        began = time.perf_counter()
        epoch = self.epoch
        super().update_core()
        if epoch >= 1:
            self.seconds += time.perf_counter() - began
            self.images += self._iterators['main'].batch_size


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--data', required=True)
    parser.add_argument('--batchsize', type=int, default=100)
    parser.add_argument('--epoch', type=int, default=3)
    parser.add_argument('--n-train', type=int, default=4000)
    parser.add_argument('--n-test', type=int, default=1000)
    parser.add_argument('--out', default='result')
    parser.add_argument('--chainermn', action='store_true')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()
    comm = None
    if args.chainermn:
        import chainermn
        comm = chainermn.create_communicator('naive')  # its CPU one
    np.random.seed(args.seed)
    model = L.Classifier(Cifar10())
    optimizer = chainer.optimizers.Adam(alpha=1e-3)
    if comm is not None:
        optimizer = chainermn.create_multi_node_optimizer(optimizer, comm)
    optimizer.setup(model)
    train, test = load(args.data, args.n_train, args.n_test) \
        if comm is None or comm.rank == 0 else (None, None)
    if comm is not None:
        train = chainermn.scatter_dataset(train, comm, shuffle=True,
                                          seed=args.seed)
        test = chainermn.scatter_dataset(test, comm, shuffle=True,
                                         seed=args.seed)
    train_iter = chainer.iterators.SerialIterator(train, args.batchsize)
    test_iter = chainer.iterators.SerialIterator(test, args.batchsize,
                                                 repeat=False, shuffle=False)
    updater = Timed(train_iter, optimizer)
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), out=args.out)
    evaluator = extensions.Evaluator(test_iter, model)
    if comm is not None:
        evaluator = chainermn.create_multi_node_evaluator(evaluator, comm)
    trainer.extend(evaluator)
    if comm is None or comm.rank == 0:
        trainer.extend(extensions.LogReport())
        trainer.extend(extensions.PrintReport(
            ['epoch', 'main/loss', 'validation/main/accuracy',
             'elapsed_time']))
    trainer.run()
    seconds, images = updater.seconds, updater.images
    if comm is not None:  # every rank's images, the slowest rank's time
        images = sum(comm.mpi_comm.allgather(images))
        seconds = max(comm.mpi_comm.allgather(seconds))
    if comm is None or comm.rank == 0:
        print(f'throughput: {images / seconds:.1f} images/s, '
              f'{seconds:.1f} s', flush=True)


if __name__ == '__main__':
    main()
