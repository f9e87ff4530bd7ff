"""ChainerMN's dual-parallel MNIST example, on synthetic MNIST-like data:
model and data parallelism at once. An even number of ranks: rank r is
part ``r % 2`` of the model (train_mnist_model_parallel.py's MLP0 or
MLP1) in replica ``r // 2``. ``comm.split`` makes ``data_comm`` (the
ranks holding the same part: the multi-node optimizer averages their
gradients, the data is scattered over them) and ``model_comm`` (the two
parts of one replica, which send each other activations and
gradients); a multi-node evaluator averages the replicas' results.

    mpiexec -n 4 python train_mnist_dual_parallel.py
    dasktrain launch -n 4 -- python train_mnist_dual_parallel.py
"""
import argparse
import time

import chainer
import chainer.links as L
import chainermn
import chainermn.datasets
import chainermn.functions
import numpy as np
from chainer import training
from chainer.training import extensions
from train_mnist import synthetic_mnist
from train_mnist_model_parallel import MLP0, MLP1

chainer.disable_experimental_feature_warning = True


def main():
    parser = argparse.ArgumentParser(description='ChainerMN dual parallel')
    parser.add_argument('--batchsize', '-b', type=int, default=100)
    parser.add_argument('--epoch', '-e', type=int, default=5)
    parser.add_argument('--gpu', '-g', action='store_true')
    # its outputs beside dasktrain's runs (git-ignored), not in the cwd
    parser.add_argument('--out', '-o',
                        default='runs/train_mnist_dual_parallel')
    parser.add_argument('--unit', '-u', type=int, default=1000)
    parser.add_argument('--n-train', type=int, default=6000)
    parser.add_argument('--n-test', type=int, default=1000)
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()

    comm = chainermn.create_communicator('pure_nccl' if args.gpu
                                         else 'naive')
    device = comm.intra_rank if args.gpu else -1
    data_axis, model_axis = comm.rank % 2, comm.rank // 2
    data_comm = comm.split(data_axis, comm.rank)
    model_comm = comm.split(model_axis, comm.rank)
    if model_comm.size != 2:
        raise ValueError('This example runs on an even number of '
                         'processes.')
    if comm.rank == 0:
        print(f'Num process (COMM_WORLD): {comm.size}')
        print(f'Num unit: {args.unit}')
        print(f'Num Minibatch-size: {args.batchsize}')
        print(f'Num epoch: {args.epoch}')

    np.random.seed(args.seed)
    if data_axis == 0:
        model = L.Classifier(MLP0(model_comm, args.unit))
    else:
        model = MLP1(model_comm, args.unit, 10)
    if device >= 0:
        chainer.cuda.get_device_from_id(device).use()
        model.to_gpu()
    optimizer = chainermn.create_multi_node_optimizer(
        chainer.optimizers.Adam(), data_comm)
    optimizer.setup(model)

    # The data of ranks 0 and 1 (the first replica), scattered over the
    # replicas; the later parts get empty datasets of the same length.
    if model_axis == 0:
        train, test = synthetic_mnist(args.n_train, args.n_test)
        if data_axis == 1:
            train = chainermn.datasets.create_empty_dataset(train)
            test = chainermn.datasets.create_empty_dataset(test)
    else:
        train, test = None, None
    train = chainermn.scatter_dataset(train, data_comm, shuffle=True,
                                      seed=args.seed)
    test = chainermn.scatter_dataset(test, data_comm, shuffle=True,
                                     seed=args.seed)
    train_iter = chainer.iterators.SerialIterator(
        train, args.batchsize, shuffle=False)
    test_iter = chainer.iterators.SerialIterator(
        test, args.batchsize, repeat=False, shuffle=False)

    updater = training.StandardUpdater(train_iter, optimizer, device=device)
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), out=args.out)
    evaluator = extensions.Evaluator(test_iter, model, device=device)
    trainer.extend(chainermn.create_multi_node_evaluator(evaluator,
                                                         data_comm))
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
        images = args.epoch * len(train) * data_comm.size
        print(f'throughput: {images / seconds:.1f} images/s, '
              f'{seconds:.2f} s for {args.epoch} epochs')


if __name__ == '__main__':
    main()
