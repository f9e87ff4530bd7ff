"""A job: its folder and files (:class:`Job`, :func:`jobs_dir`,
:func:`list_jobs`), the states it goes through, atomic status updates.

A job folder (under the jobs dir, which must be on storage every worker
sees, as a lab NAS is) holds ``job.json`` (the TrainConfig and request),
``status.json`` (state, times, GPUs, attempts), ``output.log`` (what the
training printed, across attempts) and ``out/`` (its log, checkpoint and
models). Everything about a job is read back from these files, by anyone:
the submitter, its worker, ``dasktrain jobs``, a notebook.

A job ends in one of :data:`DONE`: ``finished``, ``failed``, ``cancelled``
or ``pruned`` (its training was stopped by an epoch callback raising
:class:`Pruned`: a hyperparameter search's pruner, see
:mod:`dasktrain.tuning.trials`). A job a ``stop`` command ended
(:mod:`dasktrain.training.steering`) is ``finished``, its
``status.json``'s ``ending`` saying ``stopped by request``.

Anyone holding a job may ask two things of the scheduler,
:meth:`Job.cancel` and :meth:`Job.announce`. A job folder is made whole
(in a hidden temp folder, then renamed: :mod:`~dasktrain.jobs.folder`):
a folder without both files, or one whose name starts with a dot, is not
a job yet. What a job's user controls (``out/log``, ``output.log``) is read
with :func:`dasktrain.files.read_regular`: never through a symlink they
planted, only a regular file of theirs (a shared cluster's root reads
them).
"""
import dataclasses
import os
import pwd
import re
import socket
import stat
import time
import uuid
from pathlib import Path

from dasktrain.cluster.local import connect, home
from dasktrain.errors import UserError
from dasktrain.files import decode_upto, read_json, read_regular, write_json
from dasktrain.jobs import end_notice
from dasktrain.jobs.ending import DONE, STATES
from dasktrain.jobs.fields import NUMBER, JobError, checked, is_a, short
from dasktrain.jobs.record import JobRecord

KEY_PREFIX = 'dasktrain-job-'  # + the job's id: its Dask task's key
JOBS_ENV = 'DASKTRAIN_JOBS_DIR'
EVENTS = 'dasktrain-jobs'  # the Dask event topic of jobs' summaries


class Pruned(Exception):
    """Raised by an epoch callback of a job: stop its training now; the job
    ends ``pruned``, not failed."""


def user_name(uid):
    """The name of the OS user ``uid`` (from the password database); the
    uid itself where it has no entry (containers)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def current_user():
    """The OS user this process runs as (not ``$USER``, which anyone can
    set)."""
    return user_name(os.getuid())


def current_host():
    """The machine a job is submitted from, as the OS names it."""
    return socket.gethostname()


def new_job_id(label):
    """A new job's id: ``label`` made safe for a folder name (40
    characters at most), the time and a random suffix.

    >>> new_job_id('my run!')[:7]
    'my-run-'
    """
    slug = re.sub(r'[^A-Za-z0-9_.-]+', '-', label).strip('-')[:40] or 'job'
    return f'{slug}-{time.strftime("%Y%m%d-%H%M%S")}-{uuid.uuid4().hex[:6]}'


def jobs_dir(path=None):
    """``path``, else ``$DASKTRAIN_JOBS_DIR``, else ``$DASKTRAIN_HOME/jobs``.

    Examples
    --------
    >>> jobs_dir('/nas/jobs')
    PosixPath('/nas/jobs')
    """
    return Path(path or os.environ.get(JOBS_ENV) or home() / 'jobs')


# A new job's status.json.
NEW_STATUS = {'state': 'queued', 'attempts': 0, 'gpus': None,
              'worker': None, 'started': None, 'ended': None, 'error': None}


def update_status(folder, **changes):
    """Change keys of a job's ``status.json`` (atomically: a reader sees
    the old file or the new one); returns the new status. A change to an
    end is told to the job's ``notify`` target
    (:func:`~dasktrain.jobs.end_notice.ended`, in the background).

    Examples
    --------
    >>> update_status(job.folder, state='cancelled')  # doctest: +SKIP
    {'state': 'cancelled', 'attempts': 0, ...}
    """
    path = Path(folder) / 'status.json'
    try:
        status = _read(folder, 'status.json')
    except JobError:  # damaged: written whole again, with these changes
        status = dict(NEW_STATUS)
    before = status.get('state')
    status.update(changes)
    try:  # as private as it was (0600 in a shared cluster's 0711 folder)
        found = os.lstat(path)
        mode = stat.S_IMODE(found.st_mode) if stat.S_ISREG(found.st_mode) \
            else 0o600
    except FileNotFoundError:
        mode = 0o600
    write_json(path, status, mode=mode)
    end_notice.ended(folder, before, status)  # --notify: in the background
    return status


# Bounds of the job files every reader holds to: whoever wrote them (a
# damaged disk, a user's own cluster, a user's out/ in a shared one), a
# reader gets a dict it can use or one line saying why not.
SPEC_LIMIT = 16 * 2 ** 20  # job.json: a request is at most 4 MiB, escaped
STATUS_LIMIT = 2 ** 20     # status.json
ENV_LIMIT = 4 * 2 ** 20    # env.json
LOG_LIMIT = 8 * 2 ** 20    # out/log: ~20,000 rows of ChainerUI's format
DEPTH = 16                 # nesting of any of them

_STATUS = {'state': (str, True), 'attempts': (int, False),
           'gpus': (list, False), 'worker': (str, False),
           'started': (NUMBER, False), 'ended': (NUMBER, False),
           'error': (str, False), 'exit_code': (int, False),
           'ending': (str, False)}


def check_status(data, where='status.json'):
    """``data`` if it is a ``status.json`` every reader can use (see
    :data:`_STATUS`); JobError in one line otherwise.

    >>> check_status({'state': 'queued', 'attempts': 0})['state']
    'queued'
    """
    checked(data, _STATUS, where)
    if data['state'] not in STATES:
        raise JobError(f'{where} has state={short(data["state"])}, not '
                       f'one of {", ".join(STATES)}')
    if not all(isinstance(g, str) for g in data.get('gpus') or ()):
        raise JobError(f'{where} has gpus that are not GPU ids')
    return data


def log_rows_of(rows):
    """The rows of a log (``out/log``: ChainerUI's list of dicts) every
    reader can use: each a dict of scalars (finite numbers, strings of at
    most 1,000 characters, booleans; anything else left out) with an
    ``epoch`` (an int >= 0); ``[]`` for anything else.

    >>> log_rows_of([{'epoch': 1, 'main/loss': 0.5, 'x': [1]}])
    [{'epoch': 1, 'main/loss': 0.5}]
    >>> log_rows_of([{'epoch': '1'}]), log_rows_of({'epoch': 1})
    ([], [])
    """
    if not isinstance(rows, list):
        return []
    clean = []
    for row in rows:
        if not isinstance(row, dict) or type(row.get('epoch')) is not int \
                or row['epoch'] < 0:
            return []
        clean.append({k: v for k, v in row.items() if isinstance(k, str) and (
            is_a(v, NUMBER) or type(v) is bool or
            isinstance(v, str) and len(v) <= 1000)})
    return clean


def row_number(row, key):
    """``row[key]`` if it is a finite number (not a bool), else None.

    >>> row_number({'a': 1.5, 'b': True}, 'a'), row_number({'b': True}, 'b')
    (1.5, None)
    """
    value = (row or {}).get(key)
    return value if is_a(value, NUMBER) else None


def read_file(folder, name, limit=STATUS_LIMIT, owner=None, cached=True):
    """The JSON in a job's file ``name`` (bounded, never through a symlink,
    never a FIFO: :func:`dasktrain.files.read_json`); JobError in one
    line naming the job and what is wrong."""
    try:
        return read_json(Path(folder) / name, owner, limit, DEPTH,
                         cached=cached)
    except OSError as e:
        raise JobError(f'job {Path(folder).name}: cannot read {name} '
                       f'({e.strerror or e})') from None
    except ValueError as e:
        raise JobError(f'job {Path(folder).name}: {e}') from None


def _read(folder, name):
    """A job's ``job.json`` (a :class:`~dasktrain.jobs.record.JobRecord`)
    or ``status.json`` (a dict, a copy), checked; JobError saying what is
    wrong with it in one line."""
    folder = Path(folder)
    data = read_file(folder, name, SPEC_LIMIT if name == 'job.json'
                     else STATUS_LIMIT)
    try:
        if name == 'job.json':
            return JobRecord.of(data, name)
        return dict(check_status(data, name))
    except JobError as e:
        raise JobError(f'job {folder.name}: {e}') from None


@dataclasses.dataclass
class Job:
    """A submitted job; everything about it is read from its folder.

    Examples
    --------
    >>> job = dasktrain.submit(TrainConfig(epochs=5), gpus=2)  # doctest: +SKIP
    >>> job.status()['state']  # doctest: +SKIP
    'queued'
    >>> job.result()['final']['validation/main/accuracy']  # doctest: +SKIP
    """
    id: str
    folder: Path

    @classmethod
    def find(cls, job_id, path=None):
        folder = jobs_dir(path) / job_id
        if not ((folder / 'job.json').exists() or
                (folder / 'status.json').exists()):
            raise JobError(f'no job {job_id!r} in {jobs_dir(path)}; '
                           '`dasktrain jobs` lists them')
        return cls(job_id, folder)

    @property
    def key(self):
        return KEY_PREFIX + self.id

    def spec(self):
        """``job.json`` read back typed (a
        :class:`~dasktrain.jobs.record.JobRecord`, its version checked);
        JobError if it cannot be read."""
        return _read(self.folder, 'job.json')

    def owner(self):
        """The uid the job runs as (a shared cluster's ``job.json``), or
        None (a cluster of your own: yours; a ``job.json`` that cannot be
        read: nobody's)."""
        try:
            return self.spec().uid
        except JobError:
            return None

    def log_rows(self, stale=0.0):
        """The rows of ``out/log`` (:func:`log_rows_of`: none while it is
        missing or damaged, over :data:`LOG_LIMIT`, or not a regular file
        of the job's user)."""
        try:
            rows = read_json(self.folder / 'out' / 'log', self.owner(),
                             LOG_LIMIT, DEPTH, cached=True, stale=stale)
        except (OSError, ValueError):
            return []
        return log_rows_of(rows)

    def recorded(self):
        """``status.json`` as the queue recorded it (nothing of the job's
        own files read); JobError if it cannot be read."""
        return _read(self.folder, 'status.json')

    def status(self):
        """State, GPUs, times, attempts, and progress from the job's log;
        JobError if its files cannot be read."""
        status = _read(self.folder, 'status.json')
        spec = self.spec()
        rows = self.log_rows()
        status['epoch'] = rows[-1]['epoch'] if rows else 0
        status['epochs'] = spec.epochs
        # a log someone edited by hand: no number, no accuracy
        status['accuracy'] = row_number(rows[-1] if rows else None,
                                        'validation/main/accuracy')
        return status

    def summary(self, rows=True):
        """What the monitor keeps of a job: its request, its status and
        the last row of its log (all msgpack-able, for a Dask event; with
        ``rows`` False, no log read: no row); JobError if its files cannot
        be read."""
        spec = self.spec()
        status = _read(self.folder, 'status.json')
        rows = self.log_rows() if rows else []
        # The last epoch's wall time: elapsed_time runs on across resumes.
        last = row_number(rows[-1], 'elapsed_time') if rows else None
        before = row_number(rows[-2], 'elapsed_time') if len(rows) > 1 \
            else 0.0
        epoch_seconds = last - before if last is not None and \
            before is not None else None
        return {'id': self.id, 'folder': str(self.folder),
                'name': spec.name or self.id, 'user': spec.user or '',
                'gpus': spec.gpus, 'workers': spec.workers,
                'gpus_in_all': spec.gpus_in_all(status.get('gpus') or []),
                'gpus_asked': spec.gpus_asked(),
                'epochs': spec.epochs, 'submitted': spec.submitted,
                'state': status['state'],
                'held': status.get('gpus') or [],
                'worker': status.get('worker'),
                'started': status.get('started'),
                'ended': status.get('ended'), 'error': status.get('error'),
                'attempts': status.get('attempts') or 0,
                'ending': status.get('ending'), 'uid': spec.uid,
                'row': rows[-1] if rows else None,
                'epoch_seconds': epoch_seconds}

    def damaged(self, reason):
        """A :meth:`summary` for a job whose files cannot be read: state
        ``unreadable``, ``reason`` as its error (one row in the monitor
        and the jobs page, beside every other job)."""
        try:
            when = self.folder.stat().st_mtime
        except OSError:
            when = 0.0
        return {'id': self.id, 'folder': str(self.folder), 'name': self.id,
                'user': '', 'gpus': 0, 'workers': None, 'gpus_in_all': 0,
                'gpus_asked': '0',
                'epochs': 0,
                'submitted': when, 'state': 'unreadable', 'held': [],
                'worker': None, 'started': None, 'ended': None,
                'error': str(reason), 'attempts': 0, 'ending': None,
                'uid': None, 'row': None, 'epoch_seconds': None}

    def announce(self, client=None):
        """Send :meth:`summary` to the scheduler as an event (for the
        monitor): from the worker this runs on, else through ``client``,
        else not at all. Never raises: monitoring never stops a job."""
        try:
            summary = self.summary()
            try:
                from distributed import get_worker
                get_worker().log_event(EVENTS, summary)
            except ValueError:  # not on a worker
                if client is not None:
                    client.log_event(EVENTS, summary)
        except Exception:
            pass

    def cancel(self, client=None):
        """Cancel the job: dropped from the queue, or its training stopped
        (within a second or so); nothing if it has ended. Only its
        submitter may (JobError otherwise).

        Parameters
        ----------
        client : distributed.Client, optional
            Default: connect to the scheduler the job was submitted to; a
            scheduler that is gone is no error (the job's flag file stops
            it on its next run).

        Examples
        --------
        >>> dasktrain.submit(config).cancel()  # doctest: +SKIP
        """
        if self.status()['state'] in DONE:
            return
        owner, me = self.spec().user, current_user()
        if owner not in (None, me):
            raise JobError(f'job {self.id} was submitted by {owner}; only '
                           f'{owner} can cancel it (you are {me})')
        (self.folder / 'cancel').touch()
        queued = self.status()['state'] == 'queued'
        if queued:
            update_status(self.folder, state='cancelled', ended=time.time())
        try:
            from distributed import Future
            owned = client is None
            client = client or connect(self.spec().scheduler)
            try:
                client.cancel([Future(self.key, client)], force=True)
                if queued:  # a running job's task announces its own end
                    self.announce(client)
            finally:
                if owned:
                    client.close()
        except UserError:
            pass  # scheduler gone: the flag file stops it on its next run

    def cancel_reason(self):
        """Why the queue stops it, from its ``cancel`` flag: '' where
        someone cancelled it (an empty flag), else the reason the queue
        wrote there (its time limit passed)."""
        try:
            return read_regular(self.folder / 'cancel', limit=4096).decode(
                'utf-8', 'replace').strip()
        except OSError:
            return ''

    def logs(self):
        """The whole ``output.log`` ('' while there is none)."""
        text, offset = '', 0
        while True:
            more, offset = self.read_log(offset)
            if not more:
                return text
            text += more

    def read_log(self, offset=0, limit=2 ** 20):
        """``(text, next offset)``: ``output.log`` from byte ``offset``, at
        most ``limit`` bytes of it, cut before a character split at the
        end (``logs --follow`` asks again from the next offset)."""
        try:
            data = read_regular(self.folder / 'output.log', self.owner(),
                                offset, limit)
        except OSError:
            return '', offset
        return decode_upto(data, offset)

    def lost_reason(self, ask):
        """Why this job (queued or running) can no longer finish, or None
        while its scheduler still holds it; ``ask(keys, address)`` as
        :func:`dasktrain.jobs.scheduler.query.ask_scheduler`."""
        address = self.spec().scheduler
        known = ask([self.key], address) if address else None
        if known is not None and self.key in known:
            return None
        return (f'job {self.id} can no longer finish: its scheduler '
                f'({address}) is gone or no longer holds it; `dasktrain '
                f'requeue {self.id}` hands it to the running cluster')

    def result(self, timeout=None, poll=0.5):
        """Wait until the job ends; its summary, or JobError if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status()
            if status['state'] in DONE:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f'job {self.id} still {status["state"]}')
            time.sleep(poll)
        if status['state'] != 'finished':
            raise JobError(f"job {self.id} {status['state']}: "
                           f"{status.get('error') or ''}".rstrip(': '))
        rows = self.log_rows()
        return {'id': self.id, 'final': rows[-1] if rows else None,
                'log': rows, 'out': str(self.folder / 'out'),
                'gpus': status.get('gpus')}


def list_jobs(path=None):
    """Every job in the jobs dir, oldest first (by submission, else by its
    folder's time when ``job.json`` cannot be read).

    Examples
    --------
    >>> [job.id for job in list_jobs()]  # doctest: +SKIP
    ['tiny-20250101-120000-1a2b3c', ...]
    """
    root = jobs_dir(path)
    if not root.is_dir():
        return []
    # A dot folder is one still being made (submit renames it whole).
    jobs = [Job(p.name, p) for p in root.iterdir()
            if not p.name.startswith('.') and (
                (p / 'status.json').exists() or (p / 'job.json').exists())]

    def submitted(job):
        try:
            return float(job.spec().submitted)
        except (JobError, TypeError, ValueError):
            pass
        try:
            return job.folder.stat().st_mtime
        except OSError:  # purged while the folder was read: left out
            return None
    when = {job.id: submitted(job) for job in jobs}
    return sorted((job for job in jobs if when[job.id] is not None),
                  key=lambda job: when[job.id])


def purge_ended(path, keep, now=None):
    """Remove the folder of every job in the jobs dir ``path`` that ended
    more than ``keep`` seconds before ``now`` (``cluster start
    --keep-finished``: its outputs too); the ids removed. A job whose
    files cannot be read is left for its owners to look at. Never
    through a symlink a user planted (``shutil.rmtree`` works on the
    folders' descriptors)."""
    import shutil
    now = time.time() if now is None else now
    purged = []
    for job in list_jobs(path):
        try:
            status = job.recorded()
        except JobError:
            continue
        ended = status.get('ended')
        if status['state'] in DONE and ended is not None and \
                ended < now - keep:
            shutil.rmtree(job.folder, ignore_errors=True)
            if not job.folder.exists():
                purged.append(job.id)
    return purged
