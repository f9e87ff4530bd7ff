"""The pieces every ``dasktrain`` subcommand is built of; the commands
themselves are this package's modules, one per family (``train``:
download and train; ``cluster``; ``jobs``: submit, jobs, logs, cancel,
result; ``tune``; ``bench``), and :mod:`dasktrain.cli` lists them.

A subcommand is a :class:`Command` subclass: it adds its own arguments and
runs with the parsed namespace, returning an exit code. :class:`Parser`
prints a usage error as the usage line, the error and where the help is
(as git and pip do), not a screenful of help. Command modules are the only
ones that print, and where a library's error about an argument becomes one
about a flag; what they drive imports on use, so ``dasktrain --help``
stays fast.
"""
import argparse
import dataclasses
import re

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

    def error(self, message):
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
