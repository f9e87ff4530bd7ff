"""How dasktrain starts Python processes: never with the folder it was
started in (or any folder a stranger can write to) on ``sys.path``.

``python -m pkg`` puts the working directory first on ``sys.path``: run
from a shared folder, a planted ``getpass.py`` would run as the cluster's
owner, with its certificates. Every process the project spawns (the
scheduler, the worker, each job's child) starts with :func:`python` and
in a folder of its own. And :func:`check_main_guard`: local worker
processes re-import the user's script, which must keep its calls under
``if __name__ == '__main__':``. And how a parent waits for a child it
started: :class:`ExitWaiter`. Owns those decisions only: it starts
nothing.
"""
import ast
import ctypes
import inspect
import os
import select
import signal
import sys
import time

from dasktrain.errors import UserError


def python(module, *args, version=None):
    """The argv that runs ``python -m module args`` without the working
    directory on ``sys.path``: ``-P`` where Python has it (3.11+); on
    3.10 the caller's ``cwd`` (a folder only the owner writes) is what
    keeps strangers' modules out.

    Parameters
    ----------
    module : str
        The module to run (``-m``).
    *args : str
        Its arguments.
    version : tuple, optional
        The interpreter's ``sys.version_info`` (default: this one's).

    Examples
    --------
    >>> python('dask', 'worker', version=(3, 11))[1:]
    ['-P', '-m', 'dask', 'worker']
    >>> python('dask', version=(3, 10))[1:]
    ['-m', 'dask']
    """
    version = sys.version_info[:2] if version is None else version
    safe = ['-P'] if tuple(version[:2]) >= (3, 11) else []
    return [sys.executable, *safe, '-m', module, *map(str, args)]


def die_with_parent(signum=signal.SIGKILL):
    """A ``preexec_fn``: the child gets ``signum`` (default SIGKILL) when
    the thread that started it ends (Linux ``PR_SET_PDEATHSIG``). A job's
    or a rank's program must not outlive a killed worker: a rerun
    elsewhere would share its output folder with a ghost."""
    libc = ctypes.CDLL('libc.so.6', use_errno=True)
    libc.prctl(1, signum)  # PR_SET_PDEATHSIG


def unguarded_call(main_module=None, stack=None):
    """Where ``main_module`` (default: ``__main__``) is running its
    top-level code outside ``if __name__ == '__main__':`` right now, as
    ``(file, line)``; else None.

    Worker processes start by importing the main script again (Python's
    "spawn"): code outside that guard would run once more in every one of
    them and start workers of its own, which ends in screens of
    tracebacks. Checked before dasktrain starts local processes.
    """
    main_module = main_module or sys.modules.get('__main__')
    path = getattr(main_module, '__file__', None)
    if not path or not path.endswith('.py'):
        return None  # a notebook, `python -c`, the REPL: nothing re-runs
    frames = stack if stack is not None else inspect.stack(0)
    line = next((f.lineno for f in frames
                 if f.frame.f_globals is vars(main_module) and
                 f.function == '<module>'), None)
    if line is None:
        return None  # called from a function after the script ran
    try:
        tree = ast.parse(open(path, encoding='utf-8').read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and \
                node.body[0].lineno <= line <= node.end_lineno:
            return None
    return path, line


def _is_main_test(test):
    """``__name__ == '__main__'`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    sides = [test.left, *test.comparators]
    names = [getattr(s, 'id', None) for s in sides]
    values = [getattr(s, 'value', None) for s in sides]
    return '__name__' in names and '__main__' in values



def check_main_guard():
    """UserError (one line saying what to do) where the main script is
    calling dasktrain from its top level without the ``__main__`` guard,
    before any process is started."""
    where = unguarded_call()
    if where is not None:
        path, line = where
        raise UserError(
            f'{path}, line {line}, starts worker processes from the '
            "script's top level: each would run the script again. Put the "
            "calls under `if __name__ == '__main__':` (see docs/training.md)")


class ExitWaiter:
    """``waiter(seconds)`` returns once child ``pid`` has exited (it is
    not reaped: the caller's ``poll()`` does it) or ``seconds`` have
    passed: through a pidfd where Linux has one (woken by the exit
    itself, not at the caller's next look), else by sleeping. ``close()``
    once done."""

    def __init__(self, pid):
        try:
            self._fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # not Linux 5.3+, or gone
            self._fd = None

    def __call__(self, seconds):
        if self._fd is None:
            time.sleep(seconds)
        else:
            select.select([self._fd], [], [], seconds)

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
