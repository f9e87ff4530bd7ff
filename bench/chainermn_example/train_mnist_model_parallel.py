"""ChainerMN's model-parallel MNIST example, on synthetic MNIST-like data
(bench/chainermn_example/train_mnist.py's): one MLP split over two ranks
with ``MultiNodeChainList``, rank 0 holding the first layer and the loss,
rank 1 the two later layers; rank 0's batches, rank 1 an empty dataset of
the same length; Adam; an Evaluator on both; LogReport and PrintReport
on rank 0.

    mpiexec -n 2 python train_mnist_model_parallel.py
    dasktrain launch -n 2 -- python train_mnist_model_parallel.py

The same file runs under both: under ``dasktrain launch`` its ``import
chainermn`` is dasktrain's.
"""
import argparse
import time

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import chainermn.datasets
import chainermn.functions
import numpy as np
from chainer import training
from chainer.training import extensions
from train_mnist import synthetic_mnist

chainer.disable_experimental_feature_warning = True


class MLP0SubA(chainer.Chain):
    def __init__(self, n_out):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(784, n_out)

    def forward(self, x):
        return F.relu(self.l1(x))


class MLP0SubB(chainer.Chain):
    def forward(self, y):
        return y


class MLP0(chainermn.MultiNodeChainList):
    """Rank 0's part: the first layer, sent to rank 1; what rank 1 sends
    back is the output."""

    def __init__(self, comm, n_out):
        super().__init__(comm=comm)
        self.add_link(MLP0SubA(n_out), rank_in=None, rank_out=1)
        self.add_link(MLP0SubB(), rank_in=1, rank_out=None)


class MLP1Sub(chainer.Chain):
    def __init__(self, n_units, n_out):
        super().__init__()
        with self.init_scope():
            self.l2 = L.Linear(None, n_units)
            self.l3 = L.Linear(None, n_out)

    def forward(self, h0):
        return self.l3(F.relu(self.l2(h0)))


class MLP1(chainermn.MultiNodeChainList):
    """Rank 1's part: from rank 0, back to rank 0."""

    def __init__(self, comm, n_units, n_out):
        super().__init__(comm=comm)
        self.add_link(MLP1Sub(n_units, n_out), rank_in=0, rank_out=0)


def main():
    parser = argparse.ArgumentParser(description='ChainerMN model parallel')
    parser.add_argument('--batchsize', '-b', type=int, default=100)
    parser.add_argument('--epoch', '-e', type=int, default=5)
    parser.add_argument('--gpu', '-g', action='store_true')
    # its outputs beside dasktrain's runs (git-ignored), not in the cwd
    parser.add_argument('--out', '-o',
                        default='runs/train_mnist_model_parallel')
    parser.add_argument('--unit', '-u', type=int, default=1000)
    parser.add_argument('--n-train', type=int, default=6000)
    parser.add_argument('--n-test', type=int, default=1000)
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()

    comm = chainermn.create_communicator('pure_nccl' if args.gpu
                                         else 'naive')
    device = comm.intra_rank if args.gpu else -1
    if comm.size != 2:
        raise ValueError('This example runs on exactly 2 processes.')
    if comm.rank == 0:
        print(f'Num process (COMM_WORLD): {comm.size}')
        print(f'Num unit: {args.unit}')
        print(f'Num Minibatch-size: {args.batchsize}')
        print(f'Num epoch: {args.epoch}')

    np.random.seed(args.seed)  # each rank's part, the same every run
    if comm.rank == 0:
        model = L.Classifier(MLP0(comm, args.unit))
    else:
        model = MLP1(comm, args.unit, 10)
    if device >= 0:
        chainer.cuda.get_device_from_id(device).use()
        model.to_gpu()
    optimizer = chainer.optimizers.Adam()
    optimizer.setup(model)

    train, test = synthetic_mnist(args.n_train, args.n_test)
    if comm.rank == 1:  # the data is rank 0's
        train = chainermn.datasets.create_empty_dataset(train)
        test = chainermn.datasets.create_empty_dataset(test)
    train_iter = chainer.iterators.SerialIterator(
        train, args.batchsize, shuffle=False)
    test_iter = chainer.iterators.SerialIterator(
        test, args.batchsize, repeat=False, shuffle=False)

    updater = training.StandardUpdater(train_iter, optimizer, device=device)
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), out=args.out)
    trainer.extend(extensions.Evaluator(test_iter, model, device=device))
    if comm.rank == 0:
        trainer.extend(extensions.LogReport())
        trainer.extend(extensions.PrintReport(
            ['epoch', 'main/loss', 'validation/main/loss',
             'main/accuracy', 'validation/main/accuracy', 'elapsed_time']))

    start = time.perf_counter()
    trainer.run()
    seconds = time.perf_counter() - start
    chainer.serializers.save_npz(f'{args.out}/model{comm.rank}.npz', model)
    if comm.rank == 0:
        images = args.epoch * len(train)
        print(f'throughput: {images / seconds:.1f} images/s, '
              f'{seconds:.2f} s for {args.epoch} epochs')


if __name__ == '__main__':
    main()
