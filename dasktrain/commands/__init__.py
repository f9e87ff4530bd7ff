"""The pieces every ``dasktrain`` subcommand is built of; the commands
themselves are this package's modules, one per family (``train``:
download and train; ``cluster``; ``jobs``: submit, jobs, logs, cancel,
result; ``tune``; ``bench``), and :mod:`dasktrain.cli` lists them.

A subcommand is a :class:`Command` subclass: it adds its own arguments and
runs with the parsed namespace, returning an exit code. :class:`Parser`
prints a usage error as the usage line, the error and where the help is
(as git and pip do), not a screenful of help, and takes no abbreviated
option (``--epoch`` is not ``--epochs``). A reader that stops reading
(``dasktrain jobs | head -3``) ends a command's output, not the command
(:func:`closed_output_survived`). Command modules are the only
ones that print, and where a library's error about an argument becomes one
about a flag; what they drive imports on use, so ``dasktrain --help``
stays fast.
"""
import argparse
import contextlib
import dataclasses
import os
import re
import sys

from dasktrain.commands.options import add_arguments
from dasktrain.config import ConfigError, TrainConfig

# Characters a terminal acts on: C0 controls, DEL, C1 controls (ESC and
# CSI start escape sequences: titles, clearing, colours, cursor moves),
# and Unicode's line separators and bidirectional overrides (text that
# reads otherwise than it is).
_CONTROL = re.compile('[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e'
                      '\u2066-\u2069]')


def printable(text, keep=''):
    r"""``text`` (anything: ``str()`` of it) with every character a
    terminal would act on written as an escape, ``\x1b`` or ``\u202e``,
    but those in ``keep`` (``'\n\t'`` for a whole output): a job's name,
    command, user or error never draws on another user's terminal.

    >>> printable('x\x1b]0;TITLE\x07\x1b[2J')
    'x\\x1b]0;TITLE\\x07\\x1b[2J'
    >>> printable('a\tb\nc', keep='\n'), printable(None)
    ('a\\x09b\nc', 'None')
    """
    text = str(text)

    def escape(found):
        c = found.group()
        if c in keep:
            return c
        return f'\\x{ord(c):02x}' if ord(c) < 0x100 else \
            f'\\u{ord(c):04x}'
    return _CONTROL.sub(escape, text)


class _Survivor:
    """A standard stream whose reader may go (a pipe into ``head``): the
    first write or flush that finds it closed sends the rest to
    ``/dev/null`` (the stream's descriptor too, so that what is buffered,
    and what a child process inherits, goes there as well) instead of
    raising ``BrokenPipeError`` wherever a line was printed."""

    def __init__(self, stream):
        self._stream, self.lost = stream, False

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._lose()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._lose()

    def _lose(self):
        self.lost = True
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            self._stream.flush()  # what was buffered: now into /dev/null

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def closed_output_survived():
    """While a command runs, its stdout and stderr closed by their reader
    (``| head``) end its output, not the command: it goes on with what it
    does (a cluster started whole, a run trained), saying nothing more,
    and a command that only shows (``jobs --watch``, ``logs --follow``)
    stops (:func:`output_closed`). Everything is flushed on leaving, so
    the interpreter's own last flush finds nothing to fail on."""
    before = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Survivor(sys.stdout), _Survivor(sys.stderr)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = before


def output_closed():
    """Whether the reader of this command's stdout has gone (see
    :func:`closed_output_survived`)."""
    return bool(getattr(sys.stdout, 'lost', False))


class Command:
    """A subcommand: ``dasktrain NAME``, described by ``help``.

    Examples
    --------
    >>> class Hello(Command):
    ...     name, help = 'hello', 'say hello'
    ...     def run(self, args):
    ...         print('hello')
    ...         return 0
    """
    name = ''
    help = ''

    def add_arguments(self, parser):
        pass

    def run(self, args):
        raise NotImplementedError


class Parser(argparse.ArgumentParser):
    help_command = None  # default: '<prog> --help'

    def __init__(self, *args, **kwargs):
        # `--epoch 1` (a ChainerMN script's spelling) is no --epochs
        kwargs.setdefault('allow_abbrev', False)
        super().__init__(*args, **kwargs)

    def abbreviated(self, words):
        """What an unknown option of ``words`` abbreviates, in words
        (``'; options are never abbreviated: --epochs?'``), or ''.

        >>> p = Parser(prog='p')
        >>> _ = p.add_argument('--epochs')
        >>> p.abbreviated(['--epoch', '1'])
        '; options are never abbreviated: --epoch is not --epochs'
        """
        for word in words:
            name = word.split('=')[0]
            if not name.startswith('--'):
                continue
            longer = sorted(o for o in self._option_string_actions
                            if o.startswith(name) and o != name)
            if longer:
                return (f'; options are never abbreviated: {name} is not '
                        f'{" or ".join(longer)}')
        return ''

    def error(self, message):
        unknown = 'unrecognized arguments: '
        if message.startswith(unknown):
            message += self.abbreviated(message[len(unknown):].split())
        usage = self.format_usage()
        if usage.count('\n') > 3:  # every option of `train`: a screenful
            usage = f'usage: {self.prog} [options]\n'
        see = self.help_command or f'{self.prog} --help'
        self.exit(2, f'{usage}{self.prog}: error: {message}\nsee `{see}`\n')


def config_from_args(args):
    """The TrainConfig whose fields the parsed flags name, one to one; a
    value it refuses is a usage error of ``args.command_parser``."""
    values = {f.name: getattr(args, f.name)
              for f in dataclasses.fields(TrainConfig)}
    try:
        return TrainConfig(**values)
    except ConfigError as e:
        args.command_parser.error(str(e))


def train_config(train_args, prog):
    """The TrainConfig of ``dasktrain train`` options given after ``--``.

    Examples
    --------
    >>> train_config(['--', '--model', 'tiny'], 'dasktrain submit --').model
    'tiny'
    """
    if train_args[:1] == ['--']:
        train_args = train_args[1:]
    train_parser = Parser(prog=prog)
    train_parser.help_command = 'dasktrain train --help'
    add_arguments(train_parser)
    train_parser.set_defaults(command_parser=train_parser)
    return config_from_args(train_parser.parse_args(train_args))


def add_scheduler(parser):
    """``--scheduler``, for every command that talks to a cluster."""
    parser.add_argument('--scheduler', default=None, metavar='ADDR',
                        help='default: the cluster `dasktrain cluster start` '
                             'recorded')


def add_jobs_dir(parser):
    """``--jobs-dir``, for every command that reads or writes job folders."""
    parser.add_argument('--jobs-dir', default=None, metavar='DIR',
                        help='job folders, on storage every worker sees '
                             '(default: $DASKTRAIN_JOBS_DIR, else '
                             '~/.dasktrain/jobs)')
