"""The one supervisor: a keeper process between whoever starts a program and
the program, so that nothing the program starts outlives it.

Every process dasktrain runs for someone goes through it: each job of the
queue (a command, or a training job's own ``python -m`` program), each
rank of ``dasktrain launch`` or of a gang, a recorded cluster's scheduler
and worker, and root's notifications, sent as ``nobody`` (:func:`call`:
a function of dasktrain's as the program). :func:`start` runs ``python
-I -m dasktrain.keeper`` in a session of its own (dying with the starting
thread by SIGTERM, unless the program is to outlive its starter, as a
cluster does), with an empty environment, and writes the program to its
standard input as JSON: so a job's environment (a user's ``LD_PRELOAD``,
``PYTHONPATH``, secrets) never reaches the keeper's own process, root's
in a shared cluster, nor its command line. The keeper:

* becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``): what the program
  starts and leaves orphaned is re-parented to the keeper, so the
  program's processes stay its descendants, also those that left its
  session (``setsid``, a daemon's double fork);
* starts the program (as another user where asked:
  :func:`~dasktrain.as_user.popen_options`) in its own session and
  process group, dying with the keeper by SIGKILL, with the given
  standard input, output and error, and sleeps while it runs, until a
  child ends or a SIGTERM comes (:class:`~dasktrain.spawn.SignalWaiter`);
* on SIGTERM (a cancel, a time limit, its starter gone): SIGTERM to every
  descendant, SIGKILL to what is left after the grace (the program then
  reads as killed by SIGKILL: the grace was not enough);
* when the program ends: the same to whatever it left running, then it
  ends as the program did (its exit code, or killed by the same signal);
  what SIGKILL has not ended (or what is still found, again and again)
  the grace after (at least :data:`GIVE_UP` seconds) is reported as
  having outlived it (``outlived``: its pids), not waited for.

A program that cannot start is reported through a pipe (one line of JSON)
and the keeper exits :data:`CANNOT_START`. Who the program runs as is the
caller's decision; this module only applies it.

Its starter holds the program as a :class:`KeptProgram` and watches it with
:meth:`KeptProgram.watch`, the one loop that waits for a program and stops
it when told (a job's cancel or time limit, a driver's stop); how it ended
is an :class:`Ended`. The module is named for that process: a keeper keeps
a program, and all the program starts, in hand.
"""
import ctypes
import dataclasses
import errno
import functools
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

from dasktrain.as_user import become, cannot_start, popen_options
from dasktrain.containment import Cgroup, own_folder
from dasktrain.spawn import ExitWaiter, SignalWaiter, die_with_parent
from dasktrain.sweep import MARK_ENV, PAUSE, SCANS, job_processes, signal_job

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
CANNOT_START = 127
POLL = 0.05  # s between looks at the program's processes while it stops
IDLE = 1.0  # s at most between looks while it runs (an exit wakes it)
WATCH = 0.1  # s between a starter's looks at its program (KeptProgram.watch)
# s after the SIGKILL (the grace, at least this) that a keeper goes on killing
# what it finds of a program that ended before it gives up and reports what
# outlived it: it never waits without bound.
GIVE_UP = 5.0
ARGV = [sys.executable, '-I', '-m', 'dasktrain.keeper']


def program_text(program, env, grace, user=None, cwd=None, stdin=None,
                 report=None, contain=None, call=None):
    """What a keeper reads on its standard input: run ``program`` (a list)
    with ``env`` as ``user`` in ``cwd``, given ``stdin`` (text) on its
    standard input, stopping its processes with a ``grace`` of seconds;
    ``report``: the fd of the pipe for a start-up error and the end;
    ``contain``: where its processes are kept (see :func:`start`);
    ``call``: ``(function, args)``, a function as the program (see
    :func:`call`)."""
    spec = {'program': list(program), 'env': dict(env),
            'grace': float(grace), 'cwd': cwd, 'stdin': stdin,
            'report': report, 'contain': dict(contain or {})}
    if call is not None:
        spec.update(call=call[0], args=call[1])
    if user is not None:
        spec.update(uid=user.uid, gid=user.gid, groups=list(user.groups),
                    user=user.name)
    return json.dumps(spec).encode()


def ending_words(end):
    """How a stopped program ended, in words, from the keeper's report
    (``{'status': its wait status, 'after': seconds from the SIGTERM to
    its end, 'killed': whether the keeper's SIGKILL ended it, 'left':
    processes it started that the SIGKILL ended, 'grace': seconds
    given}``): what ended the job, all of its processes.

    >>> ending_words({'status': 15, 'after': 0.1, 'killed': False})
    'stopped by SIGTERM'
    >>> ending_words({'status': 9, 'after': 30.0, 'killed': True,
    ...               'grace': 30.0})
    'SIGTERM ignored for 30 s: killed by SIGKILL'
    >>> ending_words({'status': 0, 'after': 40.2, 'killed': False})
    'ended by itself (exit 0) 40 s after SIGTERM'
    >>> ending_words({'status': 143 << 8, 'after': 0.1, 'killed': False})
    'stopped by SIGTERM'
    """
    status = end.get('status')
    if end.get('killed') or end.get('left'):
        return (f"SIGTERM ignored for {end.get('grace', 0):g} s: killed by "
                'SIGKILL')
    if status is None:
        return 'ended'
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        verb = 'stopped' if signum == signal.SIGTERM else 'killed'
        return f'{verb} by {_signame(signum)}'
    if os.WEXITSTATUS(status) == 128 + signal.SIGTERM:
        # A shell's word for its program stopped by SIGTERM (`sh -c`
        # waits for it, then exits so): the SIGTERM reached the program
        # before the shell.
        return f'stopped by {_signame(signal.SIGTERM)}'
    after = end.get('after')
    when = f' {after:.0f} s after SIGTERM' if after is not None else ''
    return f'ended by itself (exit {os.WEXITSTATUS(status)}){when}'


def _signame(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f'signal {signum}'


def exit_words(code):
    """A program's exit code (``Popen.returncode``: negative for a
    signal) in words.

    >>> exit_words(3), exit_words(-9), exit_words(-15)
    ('exit 3', 'killed by SIGKILL', 'killed by SIGTERM')
    """
    if code is not None and code < 0:
        return f'killed by {_signame(-code)}'
    return f'exit {code}'


@dataclasses.dataclass(frozen=True)
class Ended:
    """How a program under its keeper ended, as its starter saw it:
    ``code``, its exit code as ``Popen.returncode`` gives it (negative: the
    signal that killed it; :data:`CANNOT_START` where it never started);
    ``stopped``, how its starter's stop ended it, in words
    (:func:`ending_words`; None: it ended by itself); ``error``, why it
    could not start; ``report``, its keeper's end report (see
    :func:`ending_words`; empty where the keeper itself was killed);
    ``at``, when (``time.time()``).

    >>> Ended(-9).words(), Ended(0, stopped='stopped by SIGTERM').words()
    ('killed by SIGKILL', 'stopped by SIGTERM')
    """
    code: int
    stopped: str | None = None
    error: str | None = None
    report: dict = dataclasses.field(default_factory=dict)
    at: float = 0.0

    def words(self):
        """Its end in words: the start error, the stop, else the exit."""
        return self.error or self.stopped or exit_words(self.code)


class KeptProgram:
    """A program under its keeper, as its starter holds it: the keeper's
    ``process`` (a ``Popen``: ``pid``, ``poll``, ``wait``, ``returncode``,
    its ``stdout`` and ``stderr`` where they are pipes), :meth:`watch`,
    :meth:`stop`, :meth:`start_error`, :meth:`ending`."""

    def __init__(self, process, report):
        self.process, self._report = process, report
        self._lines = None

    def __getattr__(self, name):
        return getattr(self.process, name)

    def watch(self, stop=None, grace=30.0, every=None, poll=WATCH, bell=None):
        """Wait until the program ends; stop it (:meth:`stop`, with
        ``grace``) once ``stop()`` says so; look ``poll`` seconds apart,
        or when ``bell`` (:class:`~dasktrain.spawn.Bell`) rings, calling
        ``every()``. How it ended, an :class:`Ended`."""
        stopped = None
        exited = ExitWaiter(self.process.pid, bell)
        try:
            while self.process.poll() is None:
                if stopped is None and stop is not None and stop():
                    stopped = self.stop(grace)
                    continue
                if every is not None:
                    every()
                exited(poll)
        finally:
            exited.close()
        return Ended(self.process.returncode, stopped, self.start_error(),
                     self.ending() or {}, time.time())

    def stop(self, grace):
        """SIGTERM to the keeper, which passes it on to every process of
        the program and SIGKILLs what is left after ``grace`` seconds;
        SIGKILL to the keeper's group if it has not ended a few seconds
        after that. How it ended, in words (:func:`ending_words`)."""
        keeper = self.process
        try:
            keeper.send_signal(signal.SIGTERM)
            keeper.wait(grace + 10)
        except subprocess.TimeoutExpired:  # a keeper that hangs: all of it
            os.killpg(keeper.pid, signal.SIGKILL)
            keeper.wait()
        end = self.ending()
        if end is None:  # the keeper itself was killed
            return 'SIGTERM ignored: its keeper was killed by SIGKILL'
        return ending_words(dict(end, grace=grace))

    def _read(self):
        """The keeper's reports (decoded lines), once it has ended."""
        if self._lines is None:
            self._lines = []
            if self._report is not None:
                report, self._report = self._report, None
                with os.fdopen(report, 'rb') as f:
                    data = f.read(1 << 16)
                for line in data.splitlines():
                    try:
                        self._lines.append(json.loads(line))
                    except ValueError:
                        pass
        return self._lines

    def start_error(self):
        """Why the program could not start, or None; once it has ended."""
        return next((r['error'] for r in self._read() if 'error' in r),
                    None)

    def ending(self):
        """How the program ended, as its keeper reports it (see
        :func:`ending_words`), or None (a keeper killed before its end)."""
        return next((r['end'] for r in self._read() if 'end' in r), None)

    def notes(self):
        """What the keeper noted (a cgroup it could not make), in words."""
        return [r['note'] for r in self._read() if 'note' in r]


def start(program, env, grace, stdout=None, stderr=subprocess.STDOUT,
          user=None, cwd=None, stdin=None, outlives=False, umask=-1,
          contain=None, call=None):
    """Start ``program`` (a list) under a keeper; a :class:`KeptProgram`.

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
    contain : dict, optional
        Where its processes are kept and what they may use: ``cgroup``
        (the folder of its own cgroup, made here: see
        :mod:`dasktrain.containment`), ``mark`` (its marker, in its
        environment), ``mem`` (bytes, ``memory.max``), ``pids``
        (``pids.max``), ``rlimits`` (``{name: [soft, hard]}``).
    call : tuple, optional
        ``(function, args)``: run that function instead (:func:`call`).
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
                                        stdin, write, contain, call))
    return KeptProgram(keeper, read)


def call(function, args, grace, env=None, **options):
    """Run ``function`` (``'dasktrain.module:name'``) as a program under a
    keeper: ``function(args, drop)`` in a child the keeper forks from
    itself, which calls ``drop()`` to become ``user`` once it has loaded
    all it needs; what it returns is its exit code. For a program that
    must run as a user who may not read this interpreter's files
    (``nobody``, where they lie under ``/root``): no interpreter of its
    own to start. ``args``: JSON; ``env``: its environment (default
    none); ``options``: :func:`start`'s. A :class:`KeptProgram`."""
    return start([function], env or {}, grace, call=(function, args),
                 **options)


class _User:
    def __init__(self, spec):
        self.uid, self.gid = spec['uid'], spec['gid']
        self.groups, self.name = spec['groups'], spec.get('user')


class _Processes:
    """Every process of the program, where they are kept: its cgroup
    (``cgroup``), else found by descent from the keeper, by its marker
    (``mark``), and by the process groups of the orphans the keeper
    reaps: a fork loop's
    processes end as the keeper's children (it is their subreaper), each
    a zombie it reads before it reaps it, so the loop's group is known
    and signalled whole, however fast its pids change."""

    def __init__(self, contain):
        self.mark = contain.get('mark')
        self.cgroup, self.note = None, None
        self.groups, self.reaps, self.seen = set(), 0, 0
        if contain.get('cgroup'):
            try:
                self.cgroup = Cgroup(contain['cgroup']).create(
                    contain.get('mem'), contain.get('pids'))
                self.home = own_folder()
                if self.home is None:
                    raise OSError(errno.ENOENT, 'no cgroup of its own')
            except OSError as e:
                if self.cgroup is not None:
                    self.cgroup.remove()
                self.cgroup = None
                self.note = (f'no cgroup for this job ({e}): its processes '
                             'are found by their marker')

    def reaped(self, pid):
        """An orphan of the program about to be reaped (a zombie): its
        process group, and that the job still had processes."""
        self.reaps += 1
        try:
            with open(f'/proc/{pid}/stat', 'rb') as f:
                group = int(f.read().rsplit(b')', 1)[1].split()[2])
        except (OSError, ValueError, IndexError):
            return
        if group not in (os.getpgid(0), 0, 1):
            self.groups.add(group)

    def _groups(self, signum):
        """``signum`` to each group seen; ``{-group}`` of those that still
        had a process (a group counts as one of its processes at least)."""
        hit = set()
        for group in self.groups:
            try:
                os.killpg(group, signum)
                hit.add(-group)
            except (ProcessLookupError, PermissionError):
                pass
        return hit

    def signal(self, signum):
        """``signum`` to every process of the program; their pids."""
        if self.cgroup is not None:
            return self.cgroup.signal(signum)
        self._groups(signum)
        return signal_job(signum, self.mark, os.getpid())

    def kill(self):
        """SIGKILL to all of them: ``cgroup.kill`` (at once), else each
        found now and each group seen; the pids still there."""
        if self.cgroup is not None:
            left = set(self.cgroup.pids())
            self.cgroup.kill()
            return left
        hit = self._groups(signal.SIGKILL)
        found = signal_job(signal.SIGKILL, self.mark, os.getpid())
        return found | hit if not found else found

    def empty(self):
        """Whether none is left (a sweep: none found now, and no orphan
        reaped since the last look)."""
        if self.cgroup is not None:
            return not self.cgroup.populated()
        quiet, self.seen = self.reaps == self.seen, self.reaps
        return quiet and not job_processes(self.mark, os.getpid())


def _start(spec, box):
    """The program, as asked, dying with the keeper by SIGKILL, born in
    its cgroup where it has one; the error in words if it cannot start."""
    program, cwd = spec['program'], spec.get('cwd')
    user = None if spec.get('uid') is None else _User(spec)
    text = spec.get('stdin')
    env = dict(spec['env'])
    if box.mark:
        env[MARK_ENV] = box.mark
    rlimits = (spec.get('contain') or {}).get('rlimits')
    function = _function(spec['call']) if spec.get('call') else None
    if isinstance(function, str):
        return None, function
    entered = False
    try:
        if box.cgroup is not None:
            box.cgroup.enter()  # the program is born inside: no race
            entered = True
        if function is not None:
            return _fork(function, spec.get('args'), env, user, cwd,
                         spec.get('report')), None
        child = subprocess.Popen(
            program, env=env,
            stdin=subprocess.DEVNULL if text is None else subprocess.PIPE,
            **popen_options(user, cwd, rlimits))
    except (OSError, subprocess.SubprocessError) as e:
        return None, cannot_start(program[0], user, e, cwd)
    finally:
        if entered:  # and the keeper is not: its cgroup.kill spares it
            _write(box.home / 'cgroup.procs', str(os.getpid()))
    if text is not None:  # never blocks the keeper on a full pipe
        threading.Thread(target=_hand, args=(child.stdin, text),
                         daemon=True).start()
    return child, None


def _function(name):
    """The function ``'dasktrain.module:name'`` (imported here, as the
    keeper's user), or why not in words."""
    module, _, attribute = name.partition(':')
    if not module.startswith('dasktrain.'):
        return f"cannot start {name}: not dasktrain's"
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        return f'cannot start {name}: {e}'


class _Forked:
    """A function's process the keeper forked, as :func:`keep` holds a
    program's ``Popen``."""

    def __init__(self, pid):
        self.pid = pid


def _fork(function, args, env, user, cwd, report=None):
    """``function(args, drop)`` in a child of the keeper with ``env``,
    dying with it by SIGKILL, ended by SIGTERM (not the keeper's
    handler), without the keeper's ``report`` pipe; ``drop()`` makes the
    child ``user``'s (:func:`~dasktrain.as_user.become`)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into the keeper's code
        code = 1
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            SignalWaiter.forget()
            os.environ.clear()
            os.environ.update(env)
            if report is not None:
                os.close(report)
            die_with_parent()
            code = function(args, functools.partial(become, user, cwd))
        except BaseException:
            pass
        finally:
            os._exit(code if isinstance(code, int) else 1)
    return _Forked(pid)


def _write(path, text):
    with open(path, 'w') as f:
        f.write(text)


def _hand(pipe, text):
    try:
        with pipe:
            pipe.write(text.encode())
    except OSError:  # it died at once: its exit tells
        pass


def _report(spec, message):
    report = spec.get('report')
    if report is not None:
        try:
            os.write(report, json.dumps(message).encode() + b'\n')
        except OSError:  # its starter is gone
            pass


def keep(spec):
    """Run the program of ``spec`` (:func:`program_text`'s, decoded) under
    the keeper's rules (see the module); its wait status
    (``os.waitpid``'s), None if it never started. Its end is reported on
    the report pipe (see :func:`ending_words`)."""
    ctypes.CDLL('libc.so.6', use_errno=True).prctl(
        PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(time.monotonic()))
    woken = SignalWaiter(spacing=POLL)  # by a child's end or the SIGTERM
    box = _Processes(spec.get('contain') or {})
    if box.note:
        _report(spec, {'note': box.note})
    child, error = _start(spec, box)
    if child is None:
        _report(spec, {'error': error})
        if box.cgroup is not None:
            box.cgroup.remove()
        return None
    grace = float(spec.get('grace', 30))
    status = ended = deadline = None
    killed, left = False, set()  # the program by SIGKILL; what it left
    outlived = []  # what was still found when the keeper gave up
    quiet = 0  # a sweep: scans in a row that found none
    while True:
        while True:  # reap: the program, and orphans handed to us
            try:  # each looked at first, while a zombie
                found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG |
                                  os.WNOWAIT)
            except ChildProcessError:
                break
            if found is None or not found.si_pid:
                break
            if found.si_pid != child.pid:
                box.reaped(found.si_pid)
            pid, got = os.waitpid(found.si_pid, 0)
            if pid == child.pid:
                status, ended = got, time.monotonic()
        if deadline is None and (stop or status is not None):
            # stopped, or the program ended: its processes get the grace
            box.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
        if deadline is not None:
            if status is not None:
                quiet = quiet + 1 if box.empty() else 0
                if quiet >= (1 if box.cgroup is not None else SCANS):
                    break
            if time.monotonic() > deadline:
                found = box.kill()
                if status is None:
                    killed = True
                else:
                    left |= found - {child.pid}
                    if time.monotonic() > deadline + max(grace, GIVE_UP):
                        # Bounded: what SIGKILL does not end, or what
                        # keeps being found, is reported, not waited for.
                        outlived = sorted(found)
                        break
        if deadline is None:  # it runs: nothing to do until a signal
            woken(IDLE)
        else:  # stopping: the grace's end; ended: the sweep
            time.sleep(POLL if status is None else PAUSE)
    if box.cgroup is not None:
        oom = box.cgroup.oom_kills()
        box.cgroup.remove()
    else:
        oom = 0
    program_killed = killed and os.WIFSIGNALED(status) and \
        os.WTERMSIG(status) == signal.SIGKILL
    _report(spec, {'end': {
        'status': status, 'stopped': bool(stop),
        'after': None if not stop or ended is None or ended < stop[0]
        else ended - stop[0], 'killed': program_killed, 'left': len(left),
        'grace': grace, 'oom': oom, 'outlived': outlived[:100]}})
    return status


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
