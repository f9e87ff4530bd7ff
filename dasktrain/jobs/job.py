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
import json
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
from dasktrain.files import decode_upto, read_regular, write_json
from dasktrain.jobs import end_notice

KEY_PREFIX = 'dasktrain-job-'  # + the job's id: its Dask task's key
JOBS_ENV = 'DASKTRAIN_JOBS_DIR'
STATES = ('queued', 'running', 'finished', 'failed', 'cancelled', 'pruned',
          'lost')
DONE = ('finished', 'failed', 'cancelled', 'pruned', 'lost')
PRUNED = 3  # exit code of a job child whose training was pruned
STOPPED = 4  # exit code of a job child a `stop` command ended: finished
EVENTS = 'dasktrain-jobs'  # the Dask event topic of jobs' summaries
# The program a training job runs: ``python -m CHILD FOLDER``.
CHILD = 'dasktrain.jobs.worker.child'
# Where the queue placed a job's ranks, for its program: JSON [[worker
# address, [GPU ids]], ...] (a job across workers).
RANKS_ENV = 'DASKTRAIN_RANKS'


class Pruned(Exception):
    """Raised by an epoch callback of a job: stop its training now; the job
    ends ``pruned``, not failed."""


class JobError(UserError):
    pass


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
    status = json.loads(path.read_text())
    before = status.get('state')
    status.update(changes)
    # As private as it was (0600 in a shared cluster's 0711 folder).
    write_json(path, status, mode=stat.S_IMODE(os.stat(path).st_mode))
    end_notice.ended(folder, before, status)  # --notify: in the background
    return status


# What every reader of a job's files needs from them.
_NEEDS = {'job.json': ('submitted',), 'status.json': ('state',)}


def _read(folder, name):
    """A job file as a dict; JobError saying what is wrong with it (a
    truncated file, an empty one, ``{}``) in one line."""
    path = folder / name
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise JobError(f'job {folder.name}: cannot read {name} '
                       f'({e.strerror})') from None
    except ValueError as e:
        raise JobError(f'job {folder.name}: {name} is not valid JSON '
                       f'({e})') from None
    needs = _NEEDS[name]
    missing = [k for k in needs
               if not isinstance(data, dict) or k not in data]
    if name == 'job.json' and isinstance(data, dict) and \
            not {'command', 'config'} & set(data):  # nothing to run
        missing.append('config')
    if not missing and name == 'job.json' and 'config' in data and not (
            isinstance(data['config'], dict) and 'epochs' in data['config']):
        missing = ['config.epochs']
    if missing:
        raise JobError(f'job {folder.name}: {name} lacks '
                       f'{", ".join(missing)}')
    if name == 'job.json' and (isinstance(data['submitted'], bool) or
                               not isinstance(data['submitted'],
                                              (int, float))):
        raise JobError(f'job {folder.name}: {name} has submitted='
                       f'{data["submitted"]!r}, not a time in seconds')
    if name == 'status.json' and data['state'] not in STATES:
        raise JobError(f'job {folder.name}: {name} has state='
                       f'{data["state"]!r}, not one of {", ".join(STATES)}')
    return data


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
        """``job.json``; JobError if it cannot be read."""
        return _read(self.folder, 'job.json')

    def owner(self):
        """The uid the job runs as (a shared cluster's ``job.json``), or
        None (a cluster of your own: yours)."""
        try:
            uid = json.loads((self.folder / 'job.json').read_text()).get('uid')
        except (OSError, ValueError, AttributeError):
            return None
        return uid if type(uid) is int else None

    def log_rows(self):
        """The rows of ``out/log`` (none while it is missing or damaged,
        or not a regular file of the job's user)."""
        try:
            rows = json.loads(read_regular(self.folder / 'out' / 'log',
                                           self.owner(), limit=2 ** 26))
        except (OSError, ValueError):
            return []
        ok = isinstance(rows, list) and all(
            isinstance(r, dict) and 'epoch' in r for r in rows)
        return rows if ok else []

    def status(self):
        """State, GPUs, times, attempts, and progress from the job's log;
        JobError if its files cannot be read."""
        status = _read(self.folder, 'status.json')
        rows = self.log_rows()
        status['epoch'] = rows[-1]['epoch'] if rows else 0
        status['epochs'] = self.spec().get('config', {}).get('epochs')
        accuracy = rows[-1].get('validation/main/accuracy') if rows else None
        # a log someone edited by hand: no number, no accuracy
        status['accuracy'] = accuracy if isinstance(accuracy, (int, float)) \
            and not isinstance(accuracy, bool) else None
        return status

    def summary(self):
        """What the monitor keeps of a job: its request, its status and
        the last row of its log (all msgpack-able, for a Dask event);
        JobError if its files cannot be read."""
        spec = self.spec()
        status = _read(self.folder, 'status.json')
        rows = self.log_rows()
        # The last epoch's wall time: elapsed_time runs on across resumes.
        epoch_seconds = rows[-1]['elapsed_time'] - (
            rows[-2]['elapsed_time'] if len(rows) > 1 else 0.0) \
            if rows else None
        return {'id': self.id, 'folder': str(self.folder),
                'name': spec['name'], 'user': spec.get('user', ''),
                'gpus': spec['gpus'], 'workers': spec.get('workers'),
                'epochs': spec.get('config', {}).get('epochs'),
                'submitted': spec['submitted'], 'state': status['state'],
                'held': status['gpus'] or [], 'worker': status['worker'],
                'started': status['started'], 'ended': status['ended'],
                'error': status['error'], 'attempts': status['attempts'],
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
                'user': '', 'gpus': 0, 'workers': None, 'epochs': 0,
                'submitted': when, 'state': 'unreadable', 'held': [],
                'worker': None, 'started': None, 'ended': None,
                'error': str(reason), 'attempts': 0, 'row': None,
                'epoch_seconds': None}

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
        owner, me = self.spec().get('user'), current_user()
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
            client = client or connect(self.spec().get('scheduler'))
            try:
                client.cancel([Future(self.key, client)], force=True)
                if queued:  # a running job's task announces its own end
                    self.announce(client)
            finally:
                if owned:
                    client.close()
        except UserError:
            pass  # scheduler gone: the flag file stops it on its next run

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
        address = self.spec().get('scheduler')
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
            return float(job.spec()['submitted'])
        except (JobError, TypeError, ValueError):
            return job.folder.stat().st_mtime
    return sorted(jobs, key=submitted)
