"""A command job's keeper: the process between the worker and the program,
so that nothing the program started outlives its job.

The worker starts ``python -I -m dasktrain.jobs.leash`` in a session of
its own, as the worker's user (root in a shared cluster), dying with the
worker's thread by SIGTERM (``PR_SET_PDEATHSIG``), with an empty
environment, and writes the job to its standard input (JSON: the
program, its environment, the grace, the user to run as, the folder, the
report pipe's fd). So the job's environment, which may hold a user's
``LD_PRELOAD`` or ``PYTHONPATH``, never reaches the keeper's own process
(root's, in a shared cluster), and its secrets never show in the
keeper's command line. The keeper:

* becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``): whatever the
  program starts and leaves orphaned is re-parented to the keeper, not
  to init, so the job's processes are always its descendants, also
  those that left its session (``setsid``, a daemon's double fork);
* starts the program in its session and process group (as the job's
  user where asked, which enters the job's folder as that user), the
  program dying with the keeper by SIGKILL;
* on SIGTERM (a cancel, a time limit, or its worker gone): SIGTERM to
  every descendant, SIGKILL to what is left after the grace (and then it
  ends as killed by SIGKILL: the grace was not enough);
* when the program ends: the same to whatever it left running (a
  ``cmd &`` of a shell), then it ends as the program did: its exit code,
  or killed by the same signal, so the worker reads the program's end.

A program that could not start is reported through the report pipe (one
line of JSON, ``{"error": ...}``) and the keeper exits 127.

The worker's side is here too: :func:`start` a keeper, :func:`stop` it (a
cancel: SIGTERM to the keeper alone, which passes it on once to every
process of the job), :func:`start_error`. Owns the keeping; what the
worker does with the end is :mod:`~dasktrain.jobs.worker`'s, who the
program runs as :mod:`~dasktrain.jobs.runas`'.
"""
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import time

from dasktrain.jobs.runas import User, cannot_start, popen_options
from dasktrain.spawn import die_with_parent

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
CANNOT_START = 127
POLL = 0.05  # s between looks at the job's processes


def _prctl(option, value):
    ctypes.CDLL('libc.so.6', use_errno=True).prctl(option, value, 0, 0, 0)


ARGV = [sys.executable, '-I', '-m', 'dasktrain.jobs.leash']  # the keeper


def job_text(program, env, grace, user=None, cwd=None, report=None):
    """What the worker writes to the keeper's standard input: run
    ``program`` (a list) with ``env`` as ``user`` (a
    :class:`~dasktrain.jobs.runas.User`; None: as the keeper) in ``cwd``,
    stopping its processes with a ``grace`` of seconds; ``report``: the
    fd of the pipe for a start-up error."""
    spec = {'program': list(program), 'env': dict(env),
            'grace': float(grace), 'cwd': cwd, 'report': report}
    if user is not None:
        spec.update(uid=user.uid, gid=user.gid, groups=list(user.groups),
                    user=user.name)
    return json.dumps(spec).encode()


def start(program, env, grace, stdout, user=None, cwd=None):
    """A keeper (a ``Popen``) running ``program`` (see :func:`job_text`),
    its output and the program's to ``stdout``; and the read end of its
    report pipe, for :func:`start_error`."""
    read, write = os.pipe()
    try:
        keeper = subprocess.Popen(
            ARGV, stdin=subprocess.PIPE, stdout=stdout,
            stderr=subprocess.STDOUT, env={}, start_new_session=True,
            pass_fds=(write,),
            # SIGTERM when the worker's thread ends: the keeper then
            # stops the job's processes itself.
            preexec_fn=functools.partial(die_with_parent, signal.SIGTERM))
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    with keeper.stdin:
        keeper.stdin.write(job_text(program, env, grace, user, cwd, write))
    return keeper, read


def start_error(report):
    """The start-up error a keeper reported on ``report`` (then closed), or
    None."""
    with os.fdopen(report, 'rb') as f:
        line = f.read()
    return json.loads(line)['error'] if line else None


def stop(keeper, grace):
    """Stop a keeper's job: SIGTERM to the keeper, which passes it on to
    every process of the job and SIGKILLs what is left after ``grace``
    seconds; SIGKILL to the keeper's group if it has not ended a few
    seconds after that. Returns what it took, in words."""
    try:
        keeper.send_signal(signal.SIGTERM)
        keeper.wait(grace + 10)
    except subprocess.TimeoutExpired:  # a keeper that hangs: all of it
        os.killpg(keeper.pid, signal.SIGKILL)
        keeper.wait()
    if keeper.returncode == -signal.SIGKILL:
        return f'SIGTERM ignored for {grace:g} s: killed by SIGKILL'
    return 'stopped by SIGTERM'


def processes(root):
    """``{pid: parent pid}`` of every descendant of ``root`` and every
    process of its session, from ``/proc`` (the keeper's own pid is not
    among them).

    >>> os.getpid() in processes(os.getppid()) or True
    True
    """
    table = {}
    for entry in os.listdir('/proc'):
        if not entry.isdigit():
            continue
        try:
            with open(f'/proc/{entry}/stat', 'rb') as f:
                fields = f.read().rsplit(b')', 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != b'Z':  # a zombie is gone, only not reaped yet
            table[int(entry)] = (int(fields[1]), int(fields[3]))
    children = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = {}, [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            if pid not in found:
                found[pid] = table[pid][0]
                todo.append(pid)
    found.update({pid: parent for pid, (parent, session) in table.items()
                  if session == root and pid != root})
    return found


def signal_all(root, signum):
    """``signum`` to every process :func:`processes` finds; how many."""
    pids = processes(root)
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    return len(pids)


def _start(spec):
    """The program, as asked (as :func:`~dasktrain.jobs.runas.popen_options`
    starts a job's child, dying with the keeper by SIGKILL); the error in
    words if it cannot start."""
    program, cwd = spec['program'], spec.get('cwd')
    user = None if spec.get('uid') is None else User(
        spec['uid'], spec['gid'], spec.get('user'), None, None,
        spec['groups'])
    try:
        return subprocess.Popen(program, stdin=subprocess.DEVNULL,
                                env=spec['env'],
                                **popen_options(user, cwd)), None
    except (OSError, subprocess.SubprocessError) as e:
        return None, cannot_start(program[0], user, e, cwd)


def keep(spec):
    """Run the program of ``spec`` (:func:`job_text`'s, decoded) under the
    keeper's rules (see the module); returns its wait status
    (``os.waitpid``'s), None if it never started."""
    me = os.getpid()
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    child, error = _start(spec)
    if child is None:
        report = spec.get('report')
        if report is not None:
            os.write(report, json.dumps({'error': error}).encode() + b'\n')
        return None
    status, deadline, killed = None, None, False
    while True:
        while True:  # reap: the program, and orphans handed to us
            try:
                pid, got = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == child.pid:
                status = got
        if deadline is None and (stop or status is not None):
            # stopped, or the program ended: its processes get the grace
            signal_all(me, signal.SIGTERM)
            deadline = time.monotonic() + float(spec.get('grace', 30))
        if deadline is not None:
            if status is not None and not processes(me):
                # Stopped, and the grace was not enough for all: the job
                # ended by SIGKILL, whatever its first process did.
                return signal.SIGKILL if stop and killed else status
            if killed is False and time.monotonic() > deadline:
                killed = signal_all(me, signal.SIGKILL) > 0
        time.sleep(POLL)


def end_as(status):
    """Exit as a process of wait status ``status`` ended: its exit code,
    or killed by its signal (None: :data:`CANNOT_START`)."""
    if status is None:
        sys.exit(CANNOT_START)
    if not os.WIFSIGNALED(status):
        sys.exit(os.waitstatus_to_exitcode(status))
    signum = os.WTERMSIG(status)
    if signum != signal.SIGKILL:
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    time.sleep(1)  # a signal whose default is to be ignored: exit instead
    sys.exit(128 + signum)


if __name__ == '__main__':
    end_as(keep(json.loads(sys.stdin.buffer.read())))
