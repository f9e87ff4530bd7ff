"""One ``cluster start`` at a time, and none that leaves processes behind.

:func:`starting` wraps a start: it holds an exclusive lock on
``HOME/start.lock`` (a second start, say two ``cluster start --port 0`` at
once, is refused with one line instead of mixing both clusters' pids and
addresses in ``cluster.json``), and turns SIGTERM and SIGHUP into an
exception for its duration, so that the start's own clean-up (ending the
processes it spawned) runs instead of Python dying on the spot.

Owns the lock and the signals only; starting is
:func:`dasktrain.cluster.local.start_cluster`'s.
"""
import contextlib
import fcntl
import os
import signal
import threading
from pathlib import Path

from dasktrain.errors import UserError


class Stopped(KeyboardInterrupt):
    """A signal ended the start (raised where the start was; a command
    reports it as it reports Ctrl-C)."""

    def __init__(self, signum):
        super().__init__(f'stopped by signal {signum}')
        self.signum = signum


@contextlib.contextmanager
def starting(home):
    """Hold ``home``'s start lock; SIGTERM/SIGHUP raise :class:`Stopped`.

    Examples
    --------
    >>> with starting(home()):  # doctest: +SKIP
    ...     spawn_everything()
    """
    Path(home).mkdir(parents=True, exist_ok=True)
    path = Path(home) / 'start.lock'
    lock = open(path, 'a+')
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or 'another process'
            raise UserError(f'another `dasktrain cluster start` ({holder}) '
                            f'is starting a cluster in {home}; wait for it, '
                            'then see `dasktrain cluster status`') from None
        lock.seek(0)
        lock.truncate()
        lock.write(f'pid {os.getpid()}')
        lock.flush()
        with signals_raise():
            yield
    finally:
        lock.close()  # and the kernel drops the lock


@contextlib.contextmanager
def signals_raise():
    """SIGTERM and SIGHUP raise :class:`Stopped` in the main thread while
    the block runs (a cancelled queue job's SIGTERM, a closed terminal):
    the block's own clean-up runs instead of Python dying on the spot."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can take signals
        return

    def stop(signum, frame):
        raise Stopped(signum)
    saved = {s: signal.signal(s, stop) for s in (signal.SIGTERM,
                                                 signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
