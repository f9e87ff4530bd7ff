"""ChainerUI's commands file of a run, read and written: what a writer
(ChainerUI's server, ``dasktrain ctl``) adds and what the run answers.

The format is ChainerUI 0.11's (its ``CommandItem`` and
``CommandsState``):

* ``OUT/.chainerui_commands`` holds ``{"job_status": "running"}`` while the
  run trains and ``"stopped"`` once it ended; ChainerUI's server takes
  commands for a running run only.
* ``OUT/commands`` is a JSON list of commands, each ``{"name", "request",
  "response"}``. A request is ``{"created_at", "status": "OPEN", "body",
  "schedule"}``, its schedule None (at once) or ``{"key": "epoch" |
  "iteration", "value": N}``; the run answers each with ``{"executed_at",
  "epoch", "iteration", "elapsed_time", "status": "SUCCESS" | "FAILURE",
  "body"}``. Writers replace the whole file (a temp file renamed).

The file is the user's (ChainerUI's server writes it as them): it is read
with bounds (:data:`MAX_BYTES`, :data:`MAX_DEPTH`, a regular file only),
and what cannot be read is said, never raised into the run. dasktrain's
writers lock it with a file of the user's alone, waited for a bounded
time (:func:`writing`).

Owns the files' format; when a command acts is
:mod:`~dasktrain.training.steering`'s.
"""
import contextlib
import datetime
import fcntl
import json
import os
import time
import uuid
from pathlib import Path

from dasktrain.files import nests_within, read_regular, write_json

COMMANDS = 'commands'           # ChainerUI's CommandItem.DEFAULT_FILE_NAME
STATE = '.chainerui_commands'   # ChainerUI's CommandsState file
SUCCESS, FAILURE = 'SUCCESS', 'FAILURE'
MAX_BYTES = 1 << 20   # a commands file larger than this is not read
MAX_DEPTH = 16        # nor one nested deeper (a command is 5 deep)
LOCK = '.commands.lock'  # dasktrain's writers' lock (not ChainerUI's)
LOCK_WAIT = 5.0       # s a writer waits for another's lock, at most


class Refused(Exception):
    """A command the run answers FAILURE, with the reason."""


def snapshot_name(iteration):
    """ChainerUI's name of a snapshot (it lists files named so).

    >>> snapshot_name(120)
    'snapshot_iter_120'
    """
    return f'snapshot_iter_{iteration}'


def entry_key(entry):
    """What identifies a command in the file however often it is rewritten:
    its name and request (which holds its creation time).

    >>> entry_key({'name': 'stop', 'request': {'created_at': 't'},
    ...            'response': None})
    '{"name": "stop", "request": {"created_at": "t"}}'
    """
    return json.dumps({'name': entry.get('name'),
                       'request': entry.get('request')}, sort_keys=True)


# ------------------------------------------------------------ the files

def read_commands(out):
    """``(entries, problem)``: the list ``OUT/commands`` holds (``[]``
    when there is none), or ``(None, why)`` when the file is not ChainerUI's
    list of commands (not JSON, not a list, larger than
    :data:`MAX_BYTES`, not a regular file)."""
    path = Path(out) / COMMANDS
    try:
        data = read_regular(path, limit=MAX_BYTES + 1)
    except FileNotFoundError:
        return [], None
    except OSError as e:
        return None, f'cannot be read ({e.strerror or e})'
    if len(data) > MAX_BYTES:
        return None, f'is larger than {MAX_BYTES // 2 ** 20} MiB'
    if not data.strip():
        return [], None
    if not nests_within(data, MAX_DEPTH):  # json's RecursionError
        return None, (f'nests more than {MAX_DEPTH} deep (a list of '
                      'commands nests 5)')
    try:
        entries = json.loads(data)
    except ValueError as e:
        return None, f'is not JSON ({e})'
    if not isinstance(entries, list):
        return None, (f'holds a {type(entries).__name__}, not a list of '
                      'commands')
    return entries, None


def signature(out):
    """What changes whenever ``OUT/commands`` is replaced or written (None
    while there is none): the run reads the file again only then."""
    try:
        st = os.stat(Path(out) / COMMANDS)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


@contextlib.contextmanager
def writing(out, wait=LOCK_WAIT):
    """Hold the lock dasktrain's writers of ``OUT/commands`` take, a
    ``flock`` on ``OUT/.commands.lock``: ``dasktrain ctl`` and the run
    never lose each other's changes. The file is the run's user's alone
    (0600, never opened through a symlink, not used where another user
    owns it): no one else can open it to hold the lock. Nor can a writer
    of theirs that hangs hang the others: the lock is waited for
    ``wait`` seconds at most, then the writer goes on without it.
    ChainerUI's server takes none; the run keeps what it did in memory,
    so a command is never done twice however the file is rewritten.
    Where the lock cannot be had (a filesystem that cannot lock, a
    folder one may not write), no lock."""
    try:
        fd = os.open(Path(out) / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
    except OSError:
        yield
        return
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break  # a writer that hangs: on without it
                    time.sleep(0.05)
                except OSError:
                    break
        yield
    finally:
        os.close(fd)


def write_state(out, status):
    """``OUT/.chainerui_commands`` saying the run is ``status``
    ('running' or 'stopped'), as ChainerUI's CommandsState writes it."""
    write_json(Path(out) / STATE, {'job_status': status})


def run_status(out):
    """'running', 'stopped', or None (no run of this folder has said)."""
    try:
        state = json.loads(read_regular(Path(out) / STATE, limit=4096))
    except (OSError, ValueError):
        return None
    status = state.get('job_status') if isinstance(state, dict) else None
    return status if isinstance(status, str) else None


def request(out, name, body=None, schedule=None):
    """Append a command to ``OUT/commands`` as ChainerUI's server does
    (with an ``id`` of its own in the request, to find its answer); its
    :func:`entry_key`. ValueError if the file is not a list of commands."""
    now = datetime.datetime.now().isoformat()
    entry = {'name': name,
             'request': {'created_at': now, 'status': 'OPEN', 'body': body,
                         'schedule': schedule, 'id': uuid.uuid4().hex},
             'response': None}
    with writing(out):
        entries, problem = read_commands(out)
        if entries is None:
            raise ValueError(f'{Path(out) / COMMANDS} {problem}')
        write_json(Path(out) / COMMANDS, entries + [entry])
    return entry_key(entry)


def wait(out, key, timeout, gone=lambda: None, poll=0.2):
    """The response to the command ``key`` once the run wrote it; None
    after ``timeout`` seconds, or as soon as ``gone()`` says why the run
    can no longer answer (it returns the reason, else None)."""
    deadline = time.monotonic() + timeout
    while True:
        answer = response(out, key)
        if answer is not None or time.monotonic() > deadline or gone():
            return answer
        time.sleep(poll)


def response(out, key):
    """The response to the command ``key`` (:func:`request`'s), or None
    while it has none (or the file cannot be read now)."""
    entries, _ = read_commands(out)
    for entry in entries or ():
        if isinstance(entry, dict) and entry_key(entry) == key:
            answer = entry.get('response')
            return answer if isinstance(answer, dict) else None
    return None


def new_response(status, body, epoch, iteration, elapsed):
    """A response as ChainerUI's ``CommandItem.set_response`` writes it."""
    return {'executed_at': datetime.datetime.now().isoformat(),
            'epoch': epoch, 'iteration': iteration,
            'elapsed_time': float(elapsed), 'status': status, 'body': body}
