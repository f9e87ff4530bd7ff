"""A run's output folder (``--out``): checked, locked, cleaned up; the
new folders under ``runs/`` of a ``dasktrain train`` that names none
(:func:`new_run_folder`) and of a launch's rank logs
(:func:`launch_folder`).

:func:`claim` is the first thing a run does, before any data is loaded:
it creates the folder, makes sure it can be written, and takes an
exclusive lock on it for the whole run: ``fcntl.flock`` on ``OUT/run.lock``
(which then names the holder's pid and host; the kernel drops the lock when
the holder exits, however it exits; never opened through a symlink). A
folder someone else could change (:func:`check_own`: another user's, or
one they may write, or below one) is refused in one line. A second run
into the same folder is refused with one line instead of mixing its
files with the first's. A run
that fails before it has written anything worth keeping removes the folder
again if it created it: a failed start leaves no empty folder behind.
:func:`record_args` writes ``OUT/args`` so that a resumed run keeps the
settings the run started with; :func:`record_steering` adds the
hyperparameters a command changed to its history.
"""
import contextlib
import fcntl
import itertools
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from dasktrain.errors import UserError, argument
from dasktrain.files import write_json
from dasktrain.writers import opening, words

LOCK = 'run.lock'


class OutputError(UserError):
    """``--out`` cannot be used: not writable, or in use by another run."""


@contextlib.contextmanager
def claim(out, keep=lambda out: True):
    """Hold ``out`` for the block: created, writable, locked.

    Parameters
    ----------
    out : str or Path
        The output folder; created (with its parents) if missing.
    keep : callable, default: always
        ``keep(out)`` decides, when the block fails in a folder this call
        created, whether what is in it is worth keeping; if not, the folder
        (and the parents created for it) is removed.

    Yields
    ------
    Path
        ``out``.
    """
    out = Path(out)
    top = out  # the highest folder this call creates, if any
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f'cannot create {argument("out")} {out} '
                          f'({e.strerror}); choose '
                          f'another {argument("out")}') from None
    lock = None
    try:
        check_own(out)
        lock = _lock(out)
        yield out
    except BaseException:
        if created and not keep(out):
            shutil.rmtree(out, ignore_errors=True)
            for folder in [out, *out.parents]:
                if folder == top.parent:
                    break
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise
    finally:
        if lock is not None:
            lock.close()  # releases the lock


def check_free(out):
    """Refuse (OutputError, one line) ``out`` where another run holds its
    lock now: what :func:`claim` would say, asked before a command says
    anything else. Takes nothing: the lock is tried and let go."""
    try:
        fd = os.open(Path(out) / LOCK, os.O_RDONLY | os.O_NOFOLLOW |
                     os.O_NONBLOCK | os.O_CLOEXEC)  # no symlink, no FIFO
    except OSError:
        return  # no lock file, or none this process may open: claim says
    with open(fd) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(out, lock) from None
        except OSError:
            return


def _in_use(out, lock):
    holder = lock.read(200).strip() or 'a process that did not say which'
    return OutputError(f'{argument("out")} {out} is in use by another run '
                       f'({holder}); wait for it to end, or choose another '
                       f'{argument("out")}')


def check_own(out):
    """OutputError (one line) where someone other than you and root could
    change what the folder ``out`` holds: it, or a folder above it, is
    another user's or writable by them (:func:`dasktrain.writers.
    opening`). They could plant a file among the run's (a
    ``sitecustomize.py`` its ranks import, a symlink where a log is
    written) or swap the folder for theirs."""
    found = opening(out, {0, os.geteuid()})
    if found is not None:
        raise OutputError(
            f'{argument("out")} {out}: {words(found)}, so another user '
            'could plant files in it or swap it; choose a folder that only '
            f'you can write (e.g. mkdir -m 700), or {argument("out")} '
            'under one')


def _lock(out):
    """The open, locked ``OUT/run.lock``; OutputError if ``out`` cannot be
    written or another run holds it."""
    def unwritable(e):
        return OutputError(f'{argument("out")} {out} is not writable '
                           f'({e.strerror}); choose another {argument("out")}')
    try:  # never through a symlink: truncated below
        lock = open(os.open(out / LOCK, os.O_RDWR | os.O_CREAT |
                            os.O_NOFOLLOW | os.O_CLOEXEC, 0o666), 'r+')
    except OSError as e:
        raise unwritable(e) from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # A file besides the lock: atomic writes create files here.
        tempfile.TemporaryFile(dir=out).close()
    except BlockingIOError:
        error = _in_use(out, lock)
        lock.close()
        raise error from None
    except OSError as e:
        lock.close()
        raise unwritable(e) from None
    except BaseException:
        lock.close()
        raise
    lock.seek(0)
    lock.truncate()
    lock.write(f'pid {os.getpid()} on {socket.gethostname()}\n')
    lock.flush()
    return lock


def _applied(args):
    """``OUT/args``'s settings as they stand now: those the run started
    with, each resume's changes applied."""
    current = {k: v for k, v in args.items()
               if k not in ('resumed', 'steered')}
    for resume in args.get('resumed', ()):
        if isinstance(resume, dict):
            current.update(resume.get('changed', {}))
    return current


def recorded_settings(out):
    """The settings ``OUT/args`` holds as they stand now (those the run
    started with, each resume's changes applied), or None where there is
    no such file or it cannot be read."""
    try:
        args = json.loads((Path(out) / 'args').read_text())
    except (OSError, ValueError):
        return None
    return _applied(args) if isinstance(args, dict) else None


def record_args(out, settings, resumed_at=None, iteration=None):
    """Write ``OUT/args``: the run's ``settings`` (a dict, TrainConfig's
    fields). A run resumed after epoch ``resumed_at`` keeps the settings it
    started with instead, and appends what it changed,
    ``{'epoch': e, 'changed': {field: new value}}``, to their list
    ``resumed`` (with ``iteration``, where it resumed within an epoch)."""
    path = Path(out) / 'args'
    try:
        args = json.loads(path.read_text()) if resumed_at is not None \
            else None
    except (OSError, ValueError):
        args = None
    if isinstance(args, dict):
        current = _applied(args)
        args.setdefault('resumed', []).append({
            'epoch': resumed_at,
            **({'iteration': iteration} if iteration is not None else {}),
            'changed': {k: v for k, v in settings.items()
                        if k != 'resume' and current.get(k) != v}})
        settings = args
    write_json(path, settings)


def record_steering(out, epoch, iteration, changed):
    """Append to ``OUT/args``'s history ``steered`` the hyperparameters a
    command ``changed`` ({name: new value}) after ``epoch`` completed
    epochs, at ``iteration``. They are not settings (a resumed run keeps
    the values in force at its checkpoint, and ``--resume`` does not
    take them as options); where ``OUT/args`` cannot be read or written,
    nothing (the log rows hold them too)."""
    path = Path(out) / 'args'
    try:
        args = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(args, dict):
        return
    if not isinstance(args.get('steered'), list):
        args['steered'] = []
    args['steered'].append({'epoch': epoch, 'iteration': iteration,
                            'changed': dict(changed)})
    try:
        write_json(path, args)
    except OSError:  # a full disk: the run goes on, the log has it
        pass


RUNS = 'runs'  # where runs' outputs go (git-ignored in a checkout)


def _dated(kind, root, now):
    return Path(root) / time.strftime(f'{kind}-%Y%m%d-%H%M%S',
                                      time.localtime(now))


def launch_folder(root=RUNS, now=None):
    """A new ``root/launch-YYYYmmdd-HHMMSS`` for a launch's rank logs
    (``-2``, ``-3``... for another launch of that second): under ``runs/``,
    where runs' outputs go (git-ignored in a checkout), not the cwd."""
    base = _dated('launch', Path(root).absolute(), now)
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        with contextlib.suppress(FileExistsError):
            folder = base.with_name(base.name + (f'-{n}' if n > 1 else ''))
            folder.mkdir()
            return folder


def new_run_folder(root=RUNS, now=None):
    """``root/train-YYYYmmdd-HHMMSS``, the output folder of a ``dasktrain
    train`` that names no ``--out`` (``-2``, ``-3``... where that name is
    taken): each run its own, the newest last in name order. Not created:
    :func:`claim` creates it, and removes it again if the run fails
    before it holds anything worth keeping.

    >>> import tempfile
    >>> root = tempfile.mkdtemp()
    >>> first = new_run_folder(root, now=0.0)
    >>> first.mkdir()
    >>> new_run_folder(root, now=0.0).name == first.name + '-2'
    True
    """
    base = _dated('train', root, now)
    for n in itertools.count(1):
        folder = base.with_name(base.name + (f'-{n}' if n > 1 else ''))
        if not os.path.lexists(folder):
            return folder


def newest_run(root=RUNS):
    """The newest folder :func:`new_run_folder` made under ``root`` that
    holds a run's ``args``, or None."""
    found = [p for p in Path(root).glob('train-*') if (p / 'args').exists()]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)
