"""Finding a job's processes without a cgroup, from ``/proc``, and
ending them: a sweep.

Every process that descends from the job's keeper (a child subreaper:
orphans come back to it) or carries the job's marker in its environment
(:data:`MARK_ENV`, read from ``/proc/PID/environ``, so not by session
nor parent), and every process in a session one of those started, gets
SIGKILL (and its process group too), again and again, until
:data:`SCANS` scans in a row find none (:func:`sweep`). What a cgroup
holds is :mod:`dasktrain.containment`'s.

Owns reading ``/proc`` for a job's processes and signalling them.
"""
import os
import signal
import time

MARK_ENV = 'DASKTRAIN_JOB_MARK'  # in a job's environment: its marker
SCANS = 5          # scans in a row that find nothing: a sweep is done
PAUSE = 0.01       # s between two scans of a sweep


def process_table():
    """``{pid: (parent, state, group, session)}`` of every process, from
    ``/proc``."""
    table = {}
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            found = _stat(int(entry))
            if found is not None:
                table[int(entry)] = found
    return table


def _stat(pid):
    """``(parent, state, group, session)`` of ``pid`` now; None if gone."""
    try:
        with open(f'/proc/{pid}/stat', 'rb') as f:
            fields = f.read().rsplit(b')', 1)[1].split()
    except OSError:  # gone meanwhile
        return None
    return int(fields[1]), fields[0], int(fields[2]), int(fields[3])


def descendants(root, table=None):
    """The pids of every live (not zombie) descendant of ``root``."""
    table = process_table() if table is None else table
    children = {}
    for pid, (parent, *_) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            todo.append(pid)
            if table[pid][1] != b'Z':
                found.append(pid)
    return found


def marked(mark, table=None):
    """The pids of the live processes whose environment holds
    :data:`MARK_ENV` = ``mark`` (``mark`` ending in ``/``: any marker
    that starts with it, a whole cluster's)."""
    table = process_table() if table is None else table
    want = f'{MARK_ENV}={mark}'.encode()
    prefix = mark.endswith('/')
    found = []
    for pid, (_, state, *_) in table.items():
        if state == b'Z' or pid == os.getpid():
            continue
        try:
            with open(f'/proc/{pid}/environ', 'rb') as f:
                env = f.read(1 << 20)
        except OSError:  # gone, or not ours to read
            continue
        for entry in env.split(b'\0'):
            if entry == want or prefix and entry.startswith(want):
                found.append(pid)
                # Its group and session read again, now that its marked
                # environment shows it has exec'd: the table may have
                # seen it just forked, still in its parent's session
                # (which a job's sweep would then end with it).
                now = _stat(pid)
                if now is not None:
                    table[pid] = now
                break
    return found


def job_processes(mark=None, keeper=None, table=None):
    """Every live process of a job: its ``keeper``'s descendants, the
    processes marked ``mark``, and every process in a session one of
    those started (a session holds only processes its first one
    started: a fork loop's new pids are found by it, even those that
    were born after the scan saw the loop's last one)."""
    table = process_table() if table is None else table
    found = set(marked(mark, table)) if mark else set()
    if keeper is not None:
        found.update(descendants(keeper, table))
    own = table.get(keeper or os.getpid(), (0, b'', 0, 0))[3]
    sessions = {table[p][3] for p in found if p in table} - {own, 0}
    found.update(p for p, (_, state, _, session) in table.items()
                 if session in sessions and state != b'Z')
    return found


def signal_job(signum, mark=None, keeper=None):
    """``signum`` to every process of the job (:func:`job_processes`),
    and to the whole process group of each (a group's signal reaches
    every member at once, also one forked meanwhile), but the keeper's
    own; their pids."""
    table = process_table()
    found = job_processes(mark, keeper, table)
    own = os.getpgid(0)
    groups = {table[p][2] for p in found if p in table} - {own, 0, 1}
    for group in groups:
        try:
            os.killpg(group, signum)
        except (ProcessLookupError, PermissionError):
            pass
    return send(found, signum)


def send(pids, signum):
    """``signum`` to each of ``pids`` (those gone meanwhile passed
    over); ``pids``."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    return pids


def sweep(mark=None, keeper=None, timeout=30.0, reap=None):
    """SIGKILL every process of the job until :data:`SCANS` scans in a row
    find none (``timeout`` seconds at most); how many were signalled.
    ``reap``: called between scans (a keeper reaps its children)."""
    deadline, quiet, killed = time.monotonic() + timeout, 0, 0
    while quiet < SCANS and time.monotonic() < deadline:
        found = signal_job(signal.SIGKILL, mark, keeper)
        killed += len(found)
        quiet = 0 if found else quiet + 1
        if reap is not None:
            reap()
        time.sleep(PAUSE)
    return killed
