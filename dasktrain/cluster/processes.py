"""The background processes of a recorded cluster: each started under a
keeper of its own (:func:`spawn`, :mod:`dasktrain.keeper`: the scheduler,
the worker with its nanny's worker process, nothing of theirs left
behind), waited for (:func:`wait_for`), told from a later process the
system gives the same pid (:func:`is_process`, :func:`running`), and
ended, only while still the ones recorded (:func:`kill`). Which
processes a cluster runs, and its record, are
:mod:`~dasktrain.cluster.local`'s.
"""
import contextlib
import os
import signal
import time

from dasktrain import keeper
from dasktrain.errors import UserError

GRACE = 5.0  # s between a stop's SIGTERM and its SIGKILL


def spawn(argv, log_path, env=None, umask=-1, grace=GRACE):
    """Start ``argv`` in the background under its keeper, their output
    appended to ``log_path``, in the folder above that log's folder, with
    ``env`` (None: this process's) and ``umask`` (-1: this one's), given
    ``grace`` seconds to stop. The keeper's ``Popen``, with ``created``,
    its start time."""
    import psutil
    with open(log_path, 'ab') as log:
        # The cluster outlives the command that started it, and a Ctrl-C
        # there does not reach it (a session of its own). In the
        # cluster's own folder: nothing where `cluster start` ran is
        # importable (dasktrain.spawn).
        process = keeper.start(
            argv, dict(os.environ) if env is None else env, grace,
            stdout=log, cwd=str(log_path.parent.parent), outlives=True,
            umask=umask).process
    # With the pid, what tells this process from a later one that the
    # system gives the same pid.
    process.created = psutil.Process(process.pid).create_time()
    return process


def wait_for(probe, timeout, what, processes, logs, error=UserError):
    """``probe()``'s first true value within ``timeout`` seconds; ``error``
    naming ``what`` and the ``logs`` folder when one of ``processes``
    exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise error(f'{what} exited at start (code '
                            f'{process.returncode}); see the logs in {logs}')
        with contextlib.suppress(OSError, ValueError, KeyError):
            if value := probe():
                return value
        time.sleep(0.2)
    raise error(f'{what} did not come up within {timeout:.0f} s; see the '
                f'logs in {logs}')


def is_process(pid, created):
    """Whether ``pid`` is still the process that started at ``created``
    (and has not exited)."""
    import psutil
    try:
        process = psutil.Process(pid)
        return abs(process.create_time() - created) < 0.01 and \
            process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def running(state):
    """The recorded (pid, start time) pairs that are still those
    processes; a state without start times matches none."""
    return [(pid, created) for pid, created in
            zip(state.get('pids', ()), state.get('created', ()))
            if is_process(pid, created)]


def kill(pid, created, grace=GRACE + 5):
    """Stop the recorded process ``pid`` and what it started: SIGTERM to
    it (a keeper passes it on to every process of its program, and
    SIGKILLs what is left after its grace), then SIGKILL to its group if
    it lingers ``grace`` seconds; only while it is the process recorded."""
    for sig, send in ((signal.SIGTERM, os.kill), (signal.SIGKILL, os.killpg)):
        if not _alive(pid, created):
            return
        try:
            send(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not _alive(pid, created):
                return
            time.sleep(0.1)


def _alive(pid, created):
    """:func:`is_process`; once the recorded process has exited, reaps it
    if it is a child of this one (a zombie keeps its pid taken)."""
    import psutil
    if is_process(pid, created):
        return True
    try:
        if abs(psutil.Process(pid).create_time() - created) < 0.01:
            # A leader shown as a zombie while its other threads still
            # run is not reapable yet: still exiting.
            return os.waitpid(pid, os.WNOHANG)[0] == 0
    except (psutil.Error, ChildProcessError):
        pass
    return False
