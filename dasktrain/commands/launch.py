"""``dasktrain launch -n N -- PROGRAM ARGS...``: a program as N ranks,
the ``mpiexec`` of dasktrain (:mod:`dasktrain.run.launch`); rank 0's output
printed here as it comes."""
import argparse
import sys

from dasktrain.commands import Command


def _echo(stream, text):
    out = sys.stdout if stream == 'stdout' else sys.stderr
    out.write(text)
    out.flush()


class Launch(Command):
    name = 'launch'
    help = ('run a program as N ranks that find each other (the mpiexec '
            'of dasktrain): dasktrain launch -n N -- python train.py')

    def add_arguments(self, parser):
        parser.add_argument('-n', '--np', dest='n', type=int, required=True,
                            metavar='N', help='ranks to start')
        parser.add_argument('--devices', default='cpu',
                            help='cpu, or GPU ids one per rank: 0,1 '
                                 '(default: %(default)s)')
        parser.add_argument('--scheduler', default=None, metavar='ADDR',
                            help='run the ranks on this running cluster '
                                 '(default: N throwaway local workers, '
                                 'started and stopped here)')
        parser.add_argument('--out', default=None, metavar='DIR',
                            help="the ranks' logs (rank0.log, ...); "
                                 'default: a new runs/launch-YYYYmmdd-'
                                 'HHMMSS')
        parser.add_argument('--timeout', type=float, default=300.0,
                            metavar='SECONDS',
                            help='how long a collective waits for a peer '
                                 'before the job fails (default: '
                                 '%(default)s)')
        parser.add_argument('--no-chainermn', action='store_true',
                            help="leave the ranks' `import chainermn` and "
                                 '`import mpi4py` to the installed ones '
                                 '(default: dasktrain.chainermn, ChainerMN '
                                 'and its MPI on Dask)')
        parser.add_argument('program', nargs=argparse.REMAINDER,
                            help='after --: the program and its arguments')

    def run(self, args):
        from dasktrain.run.launch import launch
        if args.n < 1:
            args.command_parser.error(f'-n must be >= 1, got {args.n}')
        if args.timeout <= 0:
            args.command_parser.error(
                f'--timeout must be > 0, got {args.timeout:g}')
        program = args.program[1:] if args.program[:1] == ['--'] \
            else args.program
        if not program:
            args.command_parser.error('give the program after --, e.g. '
                                      '-- python train.py')
        return launch(program, args.n, devices=args.devices,
                      scheduler=args.scheduler, out=args.out,
                      timeout=args.timeout, echo=_echo,
                      chainermn=not args.no_chainermn)
