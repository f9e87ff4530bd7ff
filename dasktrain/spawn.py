"""How dasktrain starts Python processes: never with the folder it was
started in (or any folder a stranger can write to) on ``sys.path``.

``python -m pkg`` puts the working directory first on ``sys.path``: run
from a shared folder, a planted ``getpass.py`` would run as the cluster's
owner, with its certificates. Every process the project spawns (the
scheduler, the worker, each job's child) starts with :func:`python` and
in a folder of its own. And :func:`check_main_guard`: local worker
processes re-import the user's script, which must keep its calls under
``if __name__ == '__main__':``. And how a parent waits for a child it
started, woken by the child's exit or a ring (:class:`ExitWaiter`,
:class:`Bell`), or by a signal (:class:`SignalWaiter`), never by looking
every few milliseconds. Owns those decisions only: it starts nothing.
"""
import ast
import ctypes
import inspect
import os
import select
import signal
import sys
import threading
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


class Bell:
    """A wake-up one thread rings for another that waits in ``select``
    (:class:`ExitWaiter`, ``bell=``): a pipe of its own, so the waiter
    sleeps until the exit or the ring instead of looking every few
    milliseconds. :meth:`ring` is safe from any thread, also once closed
    (it does nothing then); ``close()`` once done."""

    def __init__(self):
        self.fd, self._write = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()

    def ring(self):
        with self._lock:
            if self._write is not None:
                try:
                    os.write(self._write, b'!')
                except BlockingIOError:  # full: it is ringing already
                    pass

    def drain(self):
        with self._lock:
            try:
                while self._write is not None and os.read(self.fd, 4096):
                    pass
            except BlockingIOError:
                pass

    def close(self):
        with self._lock:
            if self._write is not None:
                os.close(self._write)
                os.close(self.fd)
                self._write = None


class ExitWaiter:
    """``waiter(seconds)`` returns once child ``pid`` has exited (it is
    not reaped: the caller's ``poll()`` does it), ``bell`` (a
    :class:`Bell`) rang, or ``seconds`` have passed: through a pidfd
    where Linux has one (woken by the exit itself, not at the caller's
    next look), else by waiting on the bell alone. ``close()`` once
    done (the bell is its owner's to close)."""

    def __init__(self, pid, bell=None):
        self._bell = bell
        try:
            self._fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # not Linux 5.3+, or gone
            self._fd = None

    def __call__(self, seconds):
        fds = [self._fd] if self._fd is not None else []
        if self._bell is not None:
            fds.append(self._bell.fd)
        if fds:
            select.select(fds, [], [], seconds)
        else:
            time.sleep(seconds)
        if self._bell is not None:
            self._bell.drain()

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SignalWaiter:
    """``waiter(seconds)`` returns once one of ``signums`` (default
    SIGCHLD: a child ended), or any signal that has a Python handler
    (SIGTERM, where the caller has one), arrived since its last call, or
    ``seconds`` have passed. A process that waits for its children sleeps
    until something happens instead of looking every few milliseconds:
    the signal's byte on Python's wake-up fd (``signal.set_wakeup_fd``)
    ends the ``select``, also where it arrived just before it. Main
    thread only; a signal of ``signums`` without a handler gets one that
    does nothing (:meth:`close` puts back what was). ``spacing``: seconds
    at least between two returns (a program whose orphans end by the
    thousand a second wakes it no more often). A child forked without
    exec calls :meth:`forget`."""

    def __init__(self, signums=(signal.SIGCHLD,), spacing=0.0):
        self.spacing, self._last = spacing, float('-inf')
        self._bell = Bell()  # rung by the signal's byte, not by ring()
        self._fd = signal.set_wakeup_fd(self._bell._write,
                                        warn_on_full_buffer=False)
        self._handlers = {}  # those it replaced, put back by close()
        for signum in signums:
            if signal.getsignal(signum) in (signal.SIG_DFL, None):
                self._handlers[signum] = signal.signal(signum, _ignore)

    def __call__(self, seconds):
        early = min(seconds, max(0.0, self._last + self.spacing -
                                 time.monotonic()))
        if early > 0:  # a flood of signals: one return per spacing
            time.sleep(early)
        select.select([self._bell.fd], [], [], seconds - early)
        self._bell.drain()
        self._last = time.monotonic()

    def close(self):
        """The wake-up fd and the handlers as they were before."""
        signal.set_wakeup_fd(self._fd)
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        self._bell.close()

    @staticmethod
    def forget():
        """In a forked child: Python's wake-up fd off, SIGCHLD back to
        its default (the pipe is the parent's)."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def _ignore(signum, frame):
    """A handler that does nothing: the signal only wakes a waiter."""
