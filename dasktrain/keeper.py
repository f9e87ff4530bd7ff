"""The one supervisor: a keeper process between whoever starts a program and
the program, so that nothing the program starts outlives it.

Every process dasktrain runs for someone goes through it: each job of the
queue (a command, or a training job's own ``python -m`` program), each
rank of ``dasktrain launch``, and a recorded cluster's scheduler and
worker. :func:`start` runs ``python -I -m dasktrain.keeper`` in a session
of its own (dying with the starting thread by SIGTERM, unless the program
is to outlive its starter, as a cluster does), with an empty environment,
and writes the program to its standard input as JSON: so a job's
environment (a user's ``LD_PRELOAD``, ``PYTHONPATH``, secrets) never
reaches the keeper's own process, root's in a shared cluster, nor its
command line. The keeper:

* becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``): what the program
  starts and leaves orphaned is re-parented to the keeper, so the
  program's processes stay its descendants, also those that left its
  session (``setsid``, a daemon's double fork);
* starts the program (as another user where asked: :func:`popen_options`)
  in its own session and process group, dying with the keeper by SIGKILL,
  with the given standard input, output and error;
* on SIGTERM (a cancel, a time limit, its starter gone): SIGTERM to every
  descendant, SIGKILL to what is left after the grace (the program then
  reads as killed by SIGKILL: the grace was not enough);
* when the program ends: the same to whatever it left running, then it
  ends as the program did (its exit code, or killed by the same signal).

A program that cannot start is reported through a pipe (one line of JSON)
and the keeper exits :data:`CANNOT_START`. Who the program runs as is the
caller's decision; this module only applies it.
"""
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time

from dasktrain.spawn import die_with_parent

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
CANNOT_START = 127
POLL = 0.05  # s between looks at the program's processes
ARGV = [sys.executable, '-I', '-m', 'dasktrain.keeper']


def popen_options(user, cwd=None):
    """``subprocess.Popen`` keywords that start a program in ``cwd`` as
    ``user`` (anything with ``uid``, ``gid``, ``groups``; None: as this
    process), dying with the thread that started it.

    As another user: its groups, umask 077, and a ``preexec_fn`` that runs
    after CPython's ``setgroups``/``setregid``/``setreuid``: the kernel
    clears ``PR_SET_PDEATHSIG`` when credentials change, so it is set
    after them; and ``cwd`` is entered as the user (a folder they cannot
    enter is refused by the kernel, not entered by root).
    """
    if user is None:
        return {'cwd': cwd, 'preexec_fn': die_with_parent}
    return {'user': user.uid, 'group': user.gid,
            'extra_groups': list(user.groups), 'umask': 0o077,
            'preexec_fn': functools.partial(_enter, cwd)}


def _enter(cwd):
    die_with_parent()
    if cwd is not None:
        os.chdir(cwd)


def cannot_start(program, user, error, cwd=None):
    """Why ``program`` did not start (``error`` from ``Popen``), in
    words; as ``user`` (None: this process's)."""
    if isinstance(error, OSError):
        who = f' as {user.name}' if user else ''
        return f'cannot start {program}{who}: {error.strerror}'
    return f'cannot start {program}: {user.name} cannot enter {cwd}'


def program_text(program, env, grace, user=None, cwd=None, stdin=None,
                 report=None):
    """What a keeper reads on its standard input: run ``program`` (a list)
    with ``env`` as ``user`` in ``cwd``, given ``stdin`` (text) on its
    standard input, stopping its processes with a ``grace`` of seconds;
    ``report``: the fd of the pipe for a start-up error."""
    spec = {'program': list(program), 'env': dict(env),
            'grace': float(grace), 'cwd': cwd, 'stdin': stdin,
            'report': report}
    if user is not None:
        spec.update(uid=user.uid, gid=user.gid, groups=list(user.groups),
                    user=user.name)
    return json.dumps(spec).encode()


class Kept:
    """A program under its keeper, as its starter holds it: the keeper's
    ``process`` (a ``Popen``: ``pid``, ``poll``, ``wait``, ``returncode``,
    its ``stdout`` and ``stderr`` where they are pipes), :meth:`stop`,
    :meth:`start_error`."""

    def __init__(self, process, report):
        self.process, self._report = process, report

    def __getattr__(self, name):
        return getattr(self.process, name)

    def stop(self, grace):
        """SIGTERM to the keeper, which passes it on to every process of
        the program and SIGKILLs what is left after ``grace`` seconds;
        SIGKILL to the keeper's group if it has not ended a few seconds
        after that. What it took, in words."""
        keeper = self.process
        try:
            keeper.send_signal(signal.SIGTERM)
            keeper.wait(grace + 10)
        except subprocess.TimeoutExpired:  # a keeper that hangs: all of it
            os.killpg(keeper.pid, signal.SIGKILL)
            keeper.wait()
        if keeper.returncode == -signal.SIGKILL:
            return f'SIGTERM ignored for {grace:g} s: killed by SIGKILL'
        return 'stopped by SIGTERM'

    def start_error(self):
        """Why the program could not start, or None; once it has ended."""
        if self._report is None:
            return None
        report, self._report = self._report, None
        with os.fdopen(report, 'rb') as f:
            line = f.read()
        return json.loads(line)['error'] if line else None


def start(program, env, grace, stdout=None, stderr=subprocess.STDOUT,
          user=None, cwd=None, stdin=None, outlives=False, umask=-1):
    """Start ``program`` (a list) under a keeper; a :class:`Kept`.

    Parameters
    ----------
    program : list of str
    env : dict
        The program's whole environment.
    grace : float
        Seconds between the SIGTERM and the SIGKILL of a stop.
    stdout, stderr : optional
        As ``Popen``'s (the program's output goes where the keeper's does).
    user : optional
        Whom it runs as (``uid``, ``gid``, ``groups``, ``name``); None: as
        this process.
    cwd : str, optional
        Where it runs.
    stdin : str, optional
        Text for its standard input (else it reads nothing).
    outlives : bool, default False
        Keep running when the starting thread ends (a cluster's
        processes); by default the keeper gets SIGTERM then.
    umask : int, default -1
        The umask it starts with (-1: this process's).
    """
    read, write = os.pipe()
    try:
        keeper = subprocess.Popen(
            ARGV, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr,
            env={}, start_new_session=True, pass_fds=(write,), umask=umask,
            preexec_fn=None if outlives else
            functools.partial(die_with_parent, signal.SIGTERM))
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    with keeper.stdin:
        keeper.stdin.write(program_text(program, env, grace, user, cwd,
                                        stdin, write))
    return Kept(keeper, read)


def processes(root):
    """``{pid: parent pid}`` of every descendant of ``root`` and every
    process of its session, from ``/proc`` (``root`` itself not among
    them).

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


class _User:
    def __init__(self, spec):
        self.uid, self.gid = spec['uid'], spec['gid']
        self.groups, self.name = spec['groups'], spec.get('user')


def _start(spec):
    """The program, as asked, dying with the keeper by SIGKILL; the error
    in words if it cannot start."""
    program, cwd = spec['program'], spec.get('cwd')
    user = None if spec.get('uid') is None else _User(spec)
    text = spec.get('stdin')
    try:
        child = subprocess.Popen(
            program, env=spec['env'],
            stdin=subprocess.DEVNULL if text is None else subprocess.PIPE,
            **popen_options(user, cwd))
    except (OSError, subprocess.SubprocessError) as e:
        return None, cannot_start(program[0], user, e, cwd)
    if text is not None:  # never blocks the keeper on a full pipe
        threading.Thread(target=_hand, args=(child.stdin, text),
                         daemon=True).start()
    return child, None


def _hand(pipe, text):
    try:
        with pipe:
            pipe.write(text.encode())
    except OSError:  # it died at once: its exit tells
        pass


def keep(spec):
    """Run the program of ``spec`` (:func:`program_text`'s, decoded) under
    the keeper's rules (see the module); its wait status
    (``os.waitpid``'s), None if it never started."""
    me = os.getpid()
    ctypes.CDLL('libc.so.6', use_errno=True).prctl(
        PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
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
