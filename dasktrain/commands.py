"""The registry behind the ``dasktrain`` command (:mod:`dasktrain.cli`).

A subcommand is a :class:`Command` subclass registered with
:func:`command`, in the module beside what it drives; it adds its own
arguments and runs with the parsed namespace, returning an exit code.
:class:`Parser` prints a usage error as the usage line, the error and
where the help is (as git and pip do), not a screenful of help.
"""
import argparse

from dasktrain.config import add_arguments

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


class Parser(argparse.ArgumentParser):
    help_command = None  # default: '<prog> --help'

    def error(self, message):
        usage = self.format_usage()
        if usage.count('\n') > 3:  # every option of `train`: a screenful
            usage = f'usage: {self.prog} [options]\n'
        see = self.help_command or f'{self.prog} --help'
        self.exit(2, f'{usage}{self.prog}: error: {message}\n'
                     f'see `{see}`\n')


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


def train_config(train_args, prog):
    """The TrainConfig of ``dasktrain train`` options given after ``--``."""
    if train_args[:1] == ['--']:
        train_args = train_args[1:]
    train_parser = Parser(prog=prog)
    train_parser.help_command = 'dasktrain train --help'
    add_arguments(train_parser)
    train_parser.set_defaults(command_parser=train_parser)
    return config_from_args(train_parser.parse_args(train_args))
