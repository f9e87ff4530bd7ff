"""The ``dasktrain`` command: the table of its subcommands, the parser
over them, and every error as one line.

The subcommands are :mod:`dasktrain.commands`' modules; :data:`COMMANDS`
lists them in the order ``dasktrain --help`` shows them. A usage error
prints the usage line, the error and where the help is (as git and pip
do); a :class:`~dasktrain.errors.UserError` prints one line; neither a
traceback; nor is a reader that closed the output (``| head``) one.
"""
import contextlib
import logging
import os
import signal
import sys
import threading

from dasktrain import __version__
from dasktrain.commands import Parser, closed_output_survived, printable
from dasktrain.commands.bench import Bench
from dasktrain.commands.cluster import Cluster
from dasktrain.commands.ctl import Ctl
from dasktrain.commands.gpus import Gpus
from dasktrain.commands.jobs import (
    Cancel,
    Jobs,
    Logs,
    Requeue,
    Result,
    Submit,
)
from dasktrain.commands.launch import Launch
from dasktrain.commands.train import Download, Train
from dasktrain.commands.tune import Tune
from dasktrain.errors import Error, flag_names

COMMANDS = (Download, Train, Launch, Cluster, Submit, Jobs, Gpus, Logs,
            Cancel, Requeue, Result, Ctl, Tune, Bench)


class _Stderr(logging.StreamHandler):
    """The ``dasktrain`` logger's lines on whatever ``sys.stderr`` is
    when one is written (a test's capture too), control characters
    escaped (:func:`~dasktrain.commands.printable`)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter('%(message)s'))

    def format(self, record):
        return printable(super().format(record), keep='\n\t')

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler sets it; stderr it stays
        pass


def show_logs():
    """Show the library's log lines (``dasktrain`` logger, INFO and up)
    on stderr, once however often it is called."""
    logger = logging.getLogger('dasktrain')
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        logger.addHandler(_Stderr())
        logger.setLevel(logging.INFO)


@contextlib.contextmanager
def quiet_on_interrupt():
    """Ctrl-C ends a command with one line (:func:`main` prints it): from
    the first SIGINT on, Dask's threads and processes shutting down half
    started (a cluster interrupted while it starts) log and print
    nothing. The handler before is back on leaving; main thread only."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not \
            signal.default_int_handler:
        yield
        return

    def interrupted(signum, frame):
        logging.disable(logging.CRITICAL)
        threading.excepthook = lambda args: None
        sys.unraisablehook = lambda unraisable: None
        signal.signal(signal.SIGINT, signal.default_int_handler)
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def build_parser():
    """The ``dasktrain`` parser: one subparser per entry of
    :data:`COMMANDS`, each knowing its command (``command_obj``) and its
    own parser (``command_parser``, which reports its usage errors)."""
    parser = Parser(prog='dasktrain', description=(
        'Train Chainer models on several GPUs and machines, with Dask.'))
    parser.add_argument('--version', action='version',
                        version=f'dasktrain {__version__}')
    sub = parser.add_subparsers(dest='command', metavar='COMMAND',
                                parser_class=Parser)
    for cls in COMMANDS:
        cmd = cls()
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(command_obj=cmd, command_parser=p)
    return parser


def main(argv=None) -> int:
    """Run ``dasktrain ARGV``; returns the exit code.

    Examples
    --------
    >>> main(['jobs', '--jobs-dir', '/nas/jobs'])  # doctest: +SKIP
    ID  STATE  GPUS  PROGRESS  ...
    0
    """
    show_logs()
    parser = build_parser()
    # Library messages name arguments (`lr`); here they name flags (`--lr`).
    with closed_output_survived(), flag_names(), quiet_on_interrupt():
        return _run(parser, argv)


def _run(parser, argv):
    args = None
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # report against the subcommand, with its help
            (getattr(args, 'command_parser', None) or parser).error(
                f'unrecognized arguments: {" ".join(extra)}')
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        # What was typed, for a command that tells given from default.
        args.argv = list(sys.argv[1:] if argv is None else argv)
        return args.command_obj.run(args)
    except SystemExit as e:  # --help, --version and usage errors
        return e.code if isinstance(e.code, int) else 2
    except Error as e:
        # escaped, but in lines: the traceback of a user's own code
        message = printable(e, keep='\n')
        print(f'dasktrain {args.command}: error: {message}', file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        where = f' {args.command}' if args is not None else ''
        print(f'dasktrain{where}: interrupted', file=sys.stderr)
        return 130


def finish(code):
    """End the process with ``code``. After a Ctrl-C (130) it ends at
    once, once ``atexit``'s handlers ran: the interpreter's teardown of
    what Chainer and Dask loaded costs seconds of CPU on a busy machine,
    and the user asked to stop now (files are closed and written
    atomically before this)."""
    if code == 130:
        import atexit
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == '__main__':
    finish(main())
