"""A ChainerMN script in the style of ChainerMN's MNIST example, on
synthetic MNIST-like data (784 features, 10 classes): Trainer, a
multi-node optimizer and evaluator, MultiNodeBatchNormalization, a
checkpointer, LogReport, PrintReport and a snapshot.

Under MPI with real ChainerMN::

    mpiexec -n 2 python train_mnist.py

With dasktrain, change the one import line below to
``import dasktrain.chainermn as chainermn`` and::

    dasktrain launch -n 2 -- python train_mnist.py

``--reference-ranks R`` (for tests, one process): read the samples in the
order that R ranks' batches cover them together, so that one process on
the batch of R * B takes the same steps as R ranks of batch B.
"""
import argparse
import time

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy as np
from chainer import training
from chainer.training import extensions


class MLP(chainer.Chain):

    def __init__(self, comm, n_in, n_units, n_out):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_units)
            self.bn1 = chainermn.links.MultiNodeBatchNormalization(
                n_units, comm)
            self.l2 = L.Linear(n_units, n_units)
            self.l3 = L.Linear(n_units, n_out)

    def forward(self, x):
        h = F.relu(self.bn1(self.l1(x)))
        h = F.relu(self.l2(h))
        return self.l3(h)


def synthetic_mnist(n_train, n_test, seed=0):
    """MNIST-shaped data: 10 class centres in 784 dimensions, noise."""
    rng = np.random.RandomState(seed)
    dtype = chainer.get_dtype()
    centres = rng.normal(0, 0.25, (10, 784))

    def make(n):
        labels = rng.randint(0, 10, n).astype(np.int32)
        x = centres[labels] + rng.normal(0, 4.0, (n, 784))
        return chainer.datasets.TupleDataset(x.astype(dtype), labels)
    return make(n_train), make(n_test)


def reference_order(n, ranks, batch):
    """Indices such that batch k of size ranks * batch holds batch k of
    every rank's contiguous part, rank after rank."""
    part = n // ranks
    order = []
    for k in range(part // batch):
        for r in range(ranks):
            start = r * part + k * batch
            order.extend(range(start, start + batch))
    return np.array(order)


def main():
    parser = argparse.ArgumentParser(description='ChainerMN MNIST-like')
    parser.add_argument('--batchsize', '-b', type=int, default=100)
    parser.add_argument('--communicator', default='pure_nccl')
    parser.add_argument('--epoch', '-e', type=int, default=5)
    parser.add_argument('--gpu', '-g', action='store_true')
    # its outputs beside dasktrain's runs (git-ignored), not in the cwd
    parser.add_argument('--out', '-o', default='runs/train_mnist')
    parser.add_argument('--unit', '-u', type=int, default=1000)
    parser.add_argument('--n-train', type=int, default=6000)
    parser.add_argument('--n-test', type=int, default=1000)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--reference-ranks', type=int, default=0)
    parser.add_argument('--lr', type=float, default=0.05)
    parser.add_argument('--double-buffering', action='store_true')
    args = parser.parse_args()

    if args.gpu and args.communicator == 'naive':
        args.communicator = 'pure_nccl'
    if not args.gpu and args.communicator == 'pure_nccl':
        args.communicator = 'naive'  # ChainerMN's CPU communicator
    comm = chainermn.create_communicator(args.communicator)
    device = comm.intra_rank if args.gpu else -1
    if comm.rank == 0:
        print(f'Num process (COMM_WORLD): {comm.size}')
        print(f'Num unit: {args.unit}')
        print(f'Num Minibatch-size: {args.batchsize}')
        print(f'Num epoch: {args.epoch}')

    np.random.seed(args.seed)  # the initial weights; rank 0's win
    model = L.Classifier(MLP(comm, 784, args.unit, 10))
    if device >= 0:
        chainer.cuda.get_device_from_id(device).use()
        model.to_gpu()
    optimizer = chainermn.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(lr=args.lr), comm,
        double_buffering=args.double_buffering)
    optimizer.setup(model)

    if comm.rank == 0:
        train, test = synthetic_mnist(args.n_train, args.n_test)
    else:
        train, test = None, None
    train = chainermn.scatter_dataset(train, comm, shuffle=True,
                                      seed=args.seed)
    test = chainermn.scatter_dataset(test, comm, shuffle=True,
                                     seed=args.seed)
    batch = args.batchsize
    if args.reference_ranks:
        train = chainer.datasets.SubDataset(
            train, 0, len(train),
            reference_order(len(train), args.reference_ranks, batch))
        batch *= args.reference_ranks

    train_iter = chainer.iterators.SerialIterator(train, batch,
                                                  shuffle=False)
    test_iter = chainer.iterators.SerialIterator(test, batch, repeat=False,
                                                 shuffle=False)
    updater = training.StandardUpdater(train_iter, optimizer, device=device)
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), out=args.out)

    checkpointer = chainermn.create_multi_node_checkpointer(
        name='mnist', comm=comm)
    checkpointer.maybe_load(trainer, optimizer)
    trainer.extend(checkpointer, trigger=(1, 'epoch'))

    evaluator = extensions.Evaluator(test_iter, model, device=device)
    evaluator = chainermn.create_multi_node_evaluator(evaluator, comm)
    trainer.extend(evaluator)

    if comm.rank == 0:
        trainer.extend(extensions.snapshot(), trigger=(args.epoch, 'epoch'))
        trainer.extend(extensions.LogReport())
        trainer.extend(extensions.PrintReport(
            ['epoch', 'main/loss', 'validation/main/loss',
             'main/accuracy', 'validation/main/accuracy', 'elapsed_time']))

    start = time.perf_counter()
    trainer.run()
    seconds = time.perf_counter() - start
    if comm.rank == 0:
        chainer.serializers.save_npz(f'{args.out}/model.npz', model)
        images = args.epoch * len(train) * comm.size
        print(f'throughput: {images / seconds:.1f} images/s, '
              f'{seconds:.2f} s for {args.epoch} epochs')
    comm.finalize()


if __name__ == '__main__':
    main()
