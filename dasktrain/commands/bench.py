"""``dasktrain bench``: the benchmarks' subcommands (augment, train,
scaleout, allreduce, overlap, model-scaling), each printing a Markdown
table with the machine; the benchmarks (:mod:`dasktrain.bench`) import
on use.
"""
import argparse

from dasktrain.commands import Command, Parser
from dasktrain.commands.options import devices_type
from dasktrain.config import MODELS


def _mib_list(text):
    """'0,0.5,4' -> (0.0, 0.5, 4.0): bucket sizes in MiB, each >= 0."""
    try:
        sizes = tuple(float(v) for v in text.split(','))
    except ValueError:
        sizes = ()
    if not sizes or not all(v >= 0 for v in sizes):
        raise argparse.ArgumentTypeError(
            f"expected sizes in MiB >= 0 separated by commas, e.g. "
            f"'0,1,4', got {text!r}")
    return sizes


def _model_scaling(args):
    from dasktrain.bench import costmodel
    links = dict(costmodel.LINKS)
    if args.measure:
        from dasktrain.bench.allreduce import bench_allreduce
        sizes = [(mb * 1e6, bench_allreduce(mbytes=mb, iterations=5,
                                            rounds=1)[0][1] / 1000)
                 for mb in (1.0, args.mbytes)]
        links['this machine, shared memory (fitted)'] = \
            costmodel.fit_link(*sizes)
    rows = [(f'{name}, {n} GPUs', f'{100 * plain:.0f} % / '
             f'{100 * overlapped:.0f} %', 'no overlap / overlap')
            for name, n, plain, overlapped in costmodel.predict(
                args.step_ms / 1000, args.mbytes * 1e6, links=links)]
    rows.append(('ChainerMN, published: 32 GPUs vs 8',
                 f'{100 * costmodel.CHAINERMN_32_GPUS:.0f} %', ''))
    return rows


class Bench(Command):
    name = 'bench'
    help = 'measure throughput on this machine; prints a Markdown table'

    def add_arguments(self, parser):
        which = parser.add_subparsers(dest='bench', metavar='BENCHMARK',
                                      required=True, parser_class=Parser)
        p = which.add_parser('augment', help='augmentation throughput and '
                             'the trainer\'s data wait')
        p.add_argument('--images', type=int, default=50000,
                       help='images per epoch (default: %(default)s)')
        p.add_argument('--chunk', type=int, default=2500,
                       help='images per Dask task (default: %(default)s)')
        p.add_argument('--repeats', type=int, default=3,
                       help='timed runs, best reported (default: %(default)s)')
        p.add_argument('--cores', type=int, default=None,
                       help='workers (default: all cores)')
        p.add_argument('--padding', choices=('zero', 'reflect'),
                       default='zero')
        p.add_argument('--trainer-rate', type=float, default=3846.0,
                       help='images/s of the simulated trainer (default: '
                            'the seed post\'s 4-GPU run, %(default)s)')
        p.set_defaults(command_parser=p, positive=('images', 'chunk',
                                                   'repeats'))
        p = which.add_parser('train', help='plain Chainer vs the wrapper, '
                             'N-replica scaling, step split, data wait')
        p.add_argument('--model', default='cifar10',
                       help='network (default: %(default)s)')
        p.add_argument('--devices', type=devices_type, default=None,
                       metavar='LIST', help="'0,1', 'cpu:N' (default: all "
                       'GPUs, else 2 CPU replicas)')
        p.add_argument('--batch-size', type=int, default=100,
                       help='per replica (default: %(default)s)')
        p.add_argument('--iterations', type=int, default=10,
                       help='timed steps per measurement (default: '
                            '%(default)s)')
        p.add_argument('--repeats', type=int, default=3,
                       help='measurements, best reported (default: '
                            '%(default)s)')
        p.add_argument('--epoch-images', type=int, default=2000,
                       help='images per epoch of the data-wait run '
                            '(default: %(default)s)')
        p.set_defaults(command_parser=p, positive=(
            'batch_size', 'iterations', 'repeats', 'epoch_images'))
        p = which.add_parser('scaleout', help='one job across 1, 2, ... '
                             'Dask worker processes: dg vs ipm, '
                             'communication, accuracy')
        p.add_argument('--workers', type=int, default=2,
                       help='largest number of workers (default: %(default)s)')
        p.add_argument('--model', default='cifar10',
                       help='network (default: %(default)s)')
        p.add_argument('--batch-size', type=int, default=100,
                       help='per worker (default: %(default)s)')
        p.add_argument('--mix-every', type=int, default=10,
                       help='ipm iterations between mixes (default: '
                            '%(default)s)')
        p.add_argument('--epochs', type=int, default=3,
                       help='(default: %(default)s)')
        p.add_argument('--train-size', type=int, default=4000,
                       help='training images (default: %(default)s)')
        p.add_argument('--test-size', type=int, default=2000,
                       help='test images (default: %(default)s)')
        p.add_argument('--data-dir', default=None, metavar='DIR',
                       help='CIFAR-10 folder (default: synthetic '
                            'CIFAR-format images in a temp folder)')
        p.set_defaults(command_parser=p, positive=(
            'workers', 'batch_size', 'mix_every', 'epochs', 'train_size',
            'test_size'))
        p = which.add_parser('allreduce', help='the all-reduce between two '
                             'processes of this machine: shared memory, TCP '
                             "and OpenMPI's (mpi4py)")
        p.add_argument('--mbytes', type=float, default=22.5,
                       help='float32 buffer size (default: %(default)s, the '
                            "seed network's gradients)")
        p.add_argument('--iterations', type=int, default=10,
                       help='timed all-reduces per round (default: '
                            '%(default)s)')
        p.add_argument('--rounds', type=int, default=3,
                       help='rounds of the three in turns, best reported '
                            '(default: %(default)s)')
        p.set_defaults(command_parser=p, positive=('iterations', 'rounds'))
        p = which.add_parser('overlap', help='dg steps between two worker '
                             'processes, the all-reduce overlapped with the '
                             'backward pass in buckets of several sizes')
        p.add_argument('--model', choices=MODELS, default='cifar10',
                       help='network (default: %(default)s)')
        p.add_argument('--batch-size', type=int, default=100,
                       help='images per worker per step (default: '
                            '%(default)s)')
        p.add_argument('--buckets', type=_mib_list,
                       default=(0, 0.25, 1, 4, 16),
                       metavar='LIST', help='bucket sizes in MiB, 0: after '
                       'the backward pass (default: 0,0.25,1,4,16)')
        p.add_argument('--steps', type=int, default=6,
                       help='timed steps per size and round (default: '
                            '%(default)s)')
        p.add_argument('--rounds', type=int, default=3,
                       help='rounds of all sizes in turns, best reported '
                            '(default: %(default)s)')
        p.add_argument('--sockets', action='store_true',
                       help='sum over links (sealed), the path between '
                            'machines (default: shared memory)')
        p.set_defaults(command_parser=p, positive=('batch_size', 'steps',
                                                   'rounds'))
        p = which.add_parser('model-scaling', help='predicted dg scaling '
                             'efficiency on 2-64 GPUs over named links, with '
                             'and without overlap (a cost model)')
        p.add_argument('--step-ms', type=float, default=100.0,
                       help="one GPU's compute per step in ms (default: "
                            "%(default)s, the seed post's GPUs)")
        p.add_argument('--mbytes', type=float, default=22.5,
                       help='gradient bytes per step in MB (default: '
                            "%(default)s, the seed network's)")
        p.add_argument('--measure', action='store_true',
                       help="also fit this machine's shared-memory all-"
                            'reduce (2 sizes, bench allreduce) as a link')
        p.set_defaults(command_parser=p, positive=('step_ms', 'mbytes'))

    def run(self, args):
        from dasktrain.bench import benchmarks as bench
        for name in args.positive:
            if getattr(args, name) < 1:
                args.command_parser.error(
                    f'--{name.replace("_", "-")} must be >= 1, got '
                    f'{getattr(args, name)}')
        if args.bench == 'augment':
            rows = bench.bench_augment(
                n_images=args.images, chunk=args.chunk,
                repeats=args.repeats, cores=args.cores,
                padding=args.padding, trainer_rate=args.trainer_rate)
            title = f'dasktrain bench augment (padding={args.padding})'
        elif args.bench == 'model-scaling':
            rows = _model_scaling(args)
            title = (f'dasktrain bench model-scaling (step {args.step_ms:g} '
                     f'ms, {args.mbytes:g} MB of gradients; a prediction)')
        elif args.bench == 'allreduce':
            from dasktrain.bench.allreduce import bench_allreduce
            rows = bench_allreduce(mbytes=args.mbytes,
                                   iterations=args.iterations,
                                   rounds=args.rounds)
            title = (f'dasktrain bench allreduce ({args.mbytes:g} MB of '
                     'float32, 2 processes)')
        elif args.bench == 'overlap':
            from dasktrain.bench.allreduce import bench_overlap
            rows = bench_overlap(model=args.model, batch=args.batch_size,
                                 buckets=args.buckets, steps=args.steps,
                                 rounds=args.rounds,
                                 shared=not args.sockets)
            title = (f'dasktrain bench overlap (model={args.model}, batch '
                     f'{args.batch_size} per worker, 2 workers, '
                     f'{"links" if args.sockets else "shared memory"})')
        elif args.bench == 'scaleout':
            from dasktrain.bench.scaleout import bench_scaleout
            rows = bench_scaleout(
                workers=range(1, args.workers + 1), model=args.model,
                batch_size=args.batch_size, mix_every=args.mix_every,
                epochs=args.epochs, train_size=args.train_size,
                test_size=args.test_size, data_dir=args.data_dir)
            title = (f'dasktrain bench scaleout (model={args.model}, batch '
                     f'{args.batch_size} per worker, {args.epochs} epochs '
                     f'of {args.train_size} images)')
        else:
            rows = bench.bench_train(
                model=args.model, devices=args.devices,
                batch_size=args.batch_size, iterations=args.iterations,
                repeats=args.repeats, epoch_images=args.epoch_images)
            title = (f'dasktrain bench train (model={args.model}, batch '
                     f'{args.batch_size} per replica)')
        print(bench.table(rows, title))
        return 0
