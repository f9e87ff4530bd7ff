"""The ``dasktrain`` command: ``download`` and ``train``, and the parser
over every registered subcommand.

The registry is :mod:`dasktrain.commands`; the cluster's and jobs'
commands are in :mod:`dasktrain.cluster.command`, ``tune`` in
:mod:`dasktrain.tuning.command`, ``bench`` in :mod:`dasktrain.bench.command`.
A usage error prints the usage line, the error and where the help is (as git
and pip do); a :class:`~dasktrain.errors.UserError` prints one line; neither
a traceback.
"""
import sys

from dasktrain import __version__
from dasktrain.config import add_arguments, add_data_arguments
from dasktrain.errors import UserError

from dasktrain.commands import (COMMANDS, Command, Parser,  # noqa: F401
                                command, config_from_args)


@command
class Download(Command):
    name = 'download'
    help = 'download, verify and extract CIFAR-10'

    def add_arguments(self, parser):
        add_data_arguments(parser)

    def run(self, args):
        from dasktrain.data.cifar import load_cifar10
        cifar = load_cifar10(args.data_dir, url=args.url, md5=args.md5)
        print(f'CIFAR-10 ready in {args.data_dir}: '
              f'{len(cifar.train_labels)} training and '
              f'{len(cifar.test_labels)} test images, '
              f'classes {", ".join(cifar.label_names)}')
        return 0


@command
class Train(Command):
    name = 'train'
    help = ('train a model on CIFAR-10 on every GPU found (else the CPU), '
            'or across --workers N Dask workers, downloading the data if '
            'needed')

    def add_arguments(self, parser):
        add_arguments(parser)

    def run(self, args):
        from dasktrain.cluster.scaleout import train
        config = config_from_args(args)
        summary = train(config)
        final = summary['final']
        if final is None:
            print(f'nothing to do: {config.out} already finished '
                  f'{config.epochs} epochs')
        else:
            print(f"done: epoch {final['epoch']}, test accuracy "
                  f"{final['validation/main/accuracy']:.4f}, on "
                  f"{_where(summary)}; outputs in "
                  f"{summary['out']}")
        return 0


def _where(summary):
    devices = ', '.join(summary['devices'])
    if 'workers' not in summary:
        return devices
    return (f"{len(summary['workers'])} workers ({devices} each"
            f"{', %d attempts' % summary['attempts'] if summary['attempts'] > 1 else ''})")


# The other commands live beside what they drive (cluster and jobs, the
# tuner, the benchmarks); importing them registers them, in this order.
from dasktrain.cluster import command as _cluster  # noqa: E402,F401
from dasktrain.tuning import command as _tuning  # noqa: E402,F401
from dasktrain.bench import command as _bench  # noqa: E402,F401


def build_parser():
    parser = Parser(prog='dasktrain', description=(
        'Train Chainer models on several GPUs and machines, with Dask.'))
    parser.add_argument('--version', action='version',
                        version=f'dasktrain {__version__}')
    sub = parser.add_subparsers(dest='command', metavar='COMMAND',
                                parser_class=Parser)
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
