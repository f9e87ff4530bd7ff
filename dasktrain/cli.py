"""The ``dasktrain`` command: a registry of subcommands.

Each subcommand is a :class:`Command` registered with :func:`command`; it
adds its own arguments and runs with the parsed namespace, returning an exit
code. A usage error prints one line and the subcommand's help; a
:class:`~dasktrain.errors.UserError` prints one line; neither a traceback.
"""
import argparse
import sys

from dasktrain import __version__
from dasktrain.errors import UserError

COMMANDS = {}


def command(cls):
    """Class decorator: register a Command subclass under ``cls.name``."""
    COMMANDS[cls.name] = cls()
    return cls


class Command:
    name = ''
    help = ''

    def add_arguments(self, parser):
        pass

    def run(self, args):
        raise NotImplementedError


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f'{self.prog}: error: {message}\n\n{self.format_help()}')


def _add_data_arguments(parser):
    parser.add_argument('--data-dir', default='data', metavar='DIR',
                        help='CIFAR-10 cache folder (default: %(default)s)')
    parser.add_argument('--url', default=None,
                        help='archive URL, e.g. a lab mirror (default: '
                             '$DASKTRAIN_CIFAR10_URL, else the official one)')
    parser.add_argument('--md5', default=None,
                        help="expected MD5 of the mirror's archive "
                             '(default: the official archive\'s)')


@command
class Download(Command):
    name = 'download'
    help = 'download, verify and extract CIFAR-10'

    def add_arguments(self, parser):
        _add_data_arguments(parser)

    def run(self, args):
        from dasktrain.data import load_cifar10
        cifar = load_cifar10(args.data_dir, url=args.url, md5=args.md5)
        print(f'CIFAR-10 ready in {args.data_dir}: '
              f'{len(cifar.train_labels)} training and '
              f'{len(cifar.test_labels)} test images, '
              f'classes {", ".join(cifar.label_names)}')
        return 0


def _mix_every(text):
    if text == 'epoch':
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an int or 'epoch', got {text!r}") from None


def _devices(text):
    from dasktrain.config import ConfigError, parse_devices
    try:
        return parse_devices(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_train_arguments(parser):
    """One flag per TrainConfig field; defaults come from TrainConfig."""
    from dasktrain.config import MODELS, OPTIMIZERS, TrainConfig
    d = TrainConfig()
    add = parser.add_argument
    add('--model', choices=MODELS, default=d.model,
        help='network (default: %(default)s, the seed post\'s)')
    add('--mode', choices=('dg', 'ipm'), default=d.mode,
        help='dg: average gradients every step; ipm: each replica trains, '
             'parameters are averaged every --mix-every (default: '
             '%(default)s)')
    add('--mix-every', type=_mix_every, default=d.mix_every, metavar='K',
        help="ipm: iterations between mixes, or 'epoch' (default: mix only "
             'at the end)')
    add('--mix-optimizer-state', action='store_true',
        help='ipm: average optimizer state (Adam moments) too')
    add('--devices', type=_devices, default=d.devices, metavar='LIST',
        help="GPU ids '0,1,2,3', 'cpu' or 'cpu:N' replicas (default: all "
             'GPUs, else one CPU replica)')
    add('--batch-size', type=int, default=d.batch_size, metavar='N',
        help='images per replica per step (default: %(default)s)')
    add('--epochs', type=int, default=d.epochs, metavar='N',
        help='(default: %(default)s)')
    add('--optimizer', choices=OPTIMIZERS, default=d.optimizer,
        help='(default: %(default)s)')
    add('--lr', type=float, default=d.lr,
        help='learning rate (default: 1e-3 for adam, 0.05 for momentum-sgd)')
    add('--weight-decay', type=float, default=d.weight_decay, metavar='W',
        help='L2 weight decay (default: %(default)s)')
    add('--seed', type=int, default=d.seed, help='(default: %(default)s)')
    add('--out', default=d.out, metavar='DIR',
        help='log, args, checkpoint and models (default: %(default)s)')
    _add_data_arguments(parser)
    add('--no-augment', dest='augment', action='store_false',
        help='no crop/flip augmentation, normalisation only')
    add('--train-size', type=int, default=d.train_size, metavar='N',
        help='train on the first N images only (quick runs)')
    add('--test-size', type=int, default=d.test_size, metavar='N',
        help='evaluate on the first N test images only')
    add('--tta', type=int, default=d.tta, metavar='K',
        help='test-time augmentation views (default: %(default)s = none)')
    add('--early-stop-patience', type=int, default=d.early_stop_patience,
        metavar='P', help='stop after P epochs without improvement')
    add('--early-stop-monitor', default=d.early_stop_monitor, metavar='KEY',
        help='log key watched for early stopping and the best model '
             '(default: %(default)s)')
    add('--resume', action='store_true',
        help='continue the run in --out from its last checkpoint')
    add('--no-progress', dest='progress', action='store_false',
        help='print nothing while training')


def config_from_args(args):
    """The TrainConfig whose fields the parsed flags name, one to one."""
    import dataclasses
    from dasktrain.config import ConfigError, TrainConfig
    values = {f.name: getattr(args, f.name)
              for f in dataclasses.fields(TrainConfig)}
    try:
        return TrainConfig(**values)
    except ConfigError as e:
        args.command_parser.error(str(e))


@command
class Train(Command):
    name = 'train'
    help = ('train a model on CIFAR-10 on every GPU found (else the CPU), '
            'downloading the data if needed')

    def add_arguments(self, parser):
        add_train_arguments(parser)

    def run(self, args):
        from dasktrain.training import train
        config = config_from_args(args)
        summary = train(config)
        final = summary['final']
        if final is None:
            print(f'nothing to do: {config.out} already finished '
                  f'{config.epochs} epochs')
        else:
            print(f"done: epoch {final['epoch']}, test accuracy "
                  f"{final['validation/main/accuracy']:.4f}, on "
                  f"{', '.join(summary['devices'])}; outputs in "
                  f"{summary['out']}")
        return 0


@command
class Bench(Command):
    name = 'bench'
    help = 'measure throughput on this machine; prints a Markdown table'

    def add_arguments(self, parser):
        which = parser.add_subparsers(dest='bench', metavar='BENCHMARK',
                                      required=True, parser_class=_Parser)
        p = which.add_parser('augment', help='augmentation throughput and '
                             'the trainer\'s data wait')
        p.add_argument('--images', type=int, default=50000,
                       help='images per epoch (default: %(default)s)')
        p.add_argument('--chunk', type=int, default=2500,
                       help='images per Dask task (default: %(default)s)')
        p.add_argument('--repeats', type=int, default=3,
                       help='timed runs, best reported (default: '
                            '%(default)s)')
        p.add_argument('--cores', type=int, default=None,
                       help='workers (default: all cores)')
        p.add_argument('--padding', choices=('zero', 'reflect'),
                       default='zero')
        p.add_argument('--trainer-rate', type=float, default=3846.0,
                       help='images/s of the simulated trainer (default: '
                            'the seed post\'s 4-GPU run, %(default)s)')
        p.set_defaults(command_parser=p)

    def run(self, args):
        from dasktrain import bench
        for name in ('images', 'chunk', 'repeats'):
            if getattr(args, name) < 1:
                args.command_parser.error(f'--{name} must be >= 1, got '
                                          f'{getattr(args, name)}')
        rows = bench.bench_augment(
            n_images=args.images, chunk=args.chunk, repeats=args.repeats,
            cores=args.cores, padding=args.padding,
            trainer_rate=args.trainer_rate)
        print(bench.table(rows, f'dasktrain bench augment '
                                f'(padding={args.padding})'))
        return 0


def build_parser():
    parser = _Parser(prog='dasktrain', description=(
        'Train Chainer models on several GPUs and machines, with Dask.'))
    parser.add_argument('--version', action='version',
                        version=f'dasktrain {__version__}')
    sub = parser.add_subparsers(dest='command', metavar='COMMAND',
                                parser_class=_Parser)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(command_obj=cmd, command_parser=p)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # report against the subcommand, with its help
            (getattr(args, 'command_parser', None) or parser).error(
                f'unrecognized arguments: {" ".join(extra)}')
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        return args.command_obj.run(args)
    except SystemExit as e:  # --help, --version and usage errors
        return e.code if isinstance(e.code, int) else 2
    except UserError as e:
        print(f'dasktrain {args.command}: error: {e}', file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f'dasktrain {args.command}: interrupted', file=sys.stderr)
        return 130


if __name__ == '__main__':
    sys.exit(main())
