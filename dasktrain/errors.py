"""The exception types the CLI turns into a one-line message.

:class:`Error` is the base of every error the CLI shows as one line
without a traceback; :class:`UserError` is the user's mistake (the message
says what was wrong and how to fix it). A fault that is not the user's (a
peer that died, a network that failed) derives from :class:`Error` but not
from :class:`UserError`.

Messages name arguments with :func:`argument`: the argument's name for
Python callers, its flag under the CLI (:func:`flag_names`).
"""
import contextlib


class Error(Exception):
    """An error the CLI prints as one line, without a traceback."""


class UserError(Error):
    """A mistake the user can fix; the message says what was wrong and how."""


class DataError(UserError):
    """A problem with the data a user can fix; the message says how."""


# Messages name an argument as the caller gave it: `lr` to a Python
# caller, `--lr` under the `dasktrain` command, which switches this on.
_FLAG_NAMES = False


def argument(name):
    """How a message names the argument ``name`` (a TrainConfig field or a
    function's parameter): ``name`` itself, or under
    :func:`flag_names` its command-line flag.

    Examples
    --------
    >>> argument('batch_size')
    'batch_size'
    >>> with flag_names():
    ...     argument('batch_size')
    '--batch-size'
    """
    if not _FLAG_NAMES:
        return name
    return FLAGS.get(name) or '--' + name.replace('_', '-')


def plural(n, what, many=None):
    """``n`` and ``what``, plural (``many``, default ``what`` + 's')
    unless ``n`` is one: how a message counts.

    Examples
    --------
    >>> plural(2, 'GPU'), plural(1, 'CPU slot'), plural(0, 'worker')
    ('2 GPUs', '1 CPU slot', '0 workers')
    >>> plural(3, 'process', 'processes')
    '3 processes'
    """
    return f'{n:g} {what if n == 1 else many or what + "s"}'


# Arguments whose flag is not their name with dashes.
FLAGS = {'model_args': '--model-arg'}


def naming_flags():
    """Whether messages name flags now (under :func:`flag_names`)."""
    return _FLAG_NAMES


@contextlib.contextmanager
def flag_names():
    """Within: messages built by :func:`argument` name flags (the CLI)."""
    global _FLAG_NAMES
    before, _FLAG_NAMES = _FLAG_NAMES, True
    try:
        yield
    finally:
        _FLAG_NAMES = before
