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


@command
class Train(Command):
    name = 'train'
    help = 'train a model on CIFAR-10'

    def add_arguments(self, parser):
        _add_data_arguments(parser)

    def run(self, args):
        from dasktrain.data import load_cifar10
        cifar = load_cifar10(args.data_dir, url=args.url, md5=args.md5)
        for split in ('train', 'test'):
            images = getattr(cifar, f'{split}_images')
            print(f'{split}: images {images.dtype} {images.shape} in '
                  f'{images.numblocks[0]} chunks')
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
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.command_obj.run(args)
    except UserError as e:
        print(f'dasktrain {args.command}: error: {e}', file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f'dasktrain {args.command}: interrupted', file=sys.stderr)
        return 130


if __name__ == '__main__':
    sys.exit(main())
