"""A job's program on its worker (what it runs is its record's,
:meth:`~dasktrain.jobs.record.JobRecord.program`): how its keeper holds
it (:func:`contained`: its cgroup, its marker, its limits;
:func:`finish`: nothing of it left), which keepers of jobs run in this
worker process (:func:`kept_for`, :func:`job_children`: who uses a GPU
is told by them), and its epochs told to the scheduler
(:class:`EpochAnnouncer`). What :mod:`~dasktrain.jobs.worker.task` (a
job's one attempt) and :mod:`~dasktrain.jobs.worker.gang` (each rank of
a job across workers) both start.
"""
import contextlib
import logging
import os
import secrets
import time
from pathlib import Path  # noqa: F401  (doctests)

from dasktrain import containment
from dasktrain.sweep import sweep

logger = logging.getLogger(__name__)
ANNOUNCE = 2.0  # s between two announcements of a job's epochs, at least

_children = {}  # {pid: job id} of the jobs' keepers running here


def job_children():
    """``{pid: job id}`` of the jobs' keepers running in this worker
    process now (each its job's session leader): who uses a GPU is told
    by them (:mod:`~dasktrain.jobs.worker.gpu_use`)."""
    return dict(_children)


@contextlib.contextmanager
def kept_for(kept, job_id):
    """Within: the keeper ``kept`` is known as the job ``job_id``'s to
    :func:`job_children`."""
    _children[kept.pid] = job_id
    try:
        yield
    finally:
        _children.pop(kept.pid, None)


def contained(job_id, attempt, spec, where=None, mark=None, pids=None,
              controllers=()):
    """How the attempt ``attempt`` of the job ``job_id`` (its record is
    ``spec``, a :class:`~dasktrain.jobs.record.JobRecord`) is kept
    (:func:`dasktrain.keeper.start`'s ``contain``): its cgroup in
    ``where`` (this worker's folder of the cluster's subtree; None: no
    cgroup), its marker under the cluster's ``mark``,
    its ``--mem`` and the cluster's ``pids`` limit where those
    ``controllers`` are enabled, its submitter's rlimits.

    >>> from dasktrain.jobs.record import JobRecord
    >>> spec = JobRecord.of({'version': 1, 'submitted': 0.0, 'gpus': 0,
    ...                      'command': ['true'], 'mem': 2 ** 30})
    >>> c = contained('j-1', 2, spec, Path('/cg/worker-7'), mark='c1',
    ...               pids=512, controllers=('memory',))
    >>> c['cgroup'], c['mark'][:9], c['mem'], c['pids']
    ('/cg/worker-7/job-j-1-2', 'c1/j-1/2/', 1073741824, None)

    The marker ends in a secret of the attempt's (no one else can read a
    process's environment): a stranger who puts the job's public id in
    an environment of theirs marks nothing of the job's, and holds no
    keeper waiting for their processes to end.
    """
    return {'cgroup': str(where / f'job-{job_id}-{attempt}')
            if where is not None else None,
            'mark': f'{mark or "dasktrain"}/{job_id}/{attempt}/'
                    f'{secrets.token_hex(16)}',
            'mem': spec.mem if 'memory' in controllers else None,
            'pids': pids if 'pids' in controllers else None,
            'rlimits': spec.rlimits}


def finish(contain):
    """Make sure no process of the job ``contain`` describes is left
    (its keeper ends them; a keeper that was killed does not): its cgroup
    killed and removed, else a sweep by its marker. How many were left."""
    if contain.get('cgroup'):
        box = containment.Cgroup(contain['cgroup'])
        left = len(box.pids())
        try:
            box.end()
        except OSError as e:
            logger.warning('dasktrain job: %s', e)
        return left
    return sweep(contain.get('mark'))


class EpochAnnouncer:
    """Tells the scheduler each epoch the job ``job`` ends (its log
    changed), at most every :data:`ANNOUNCE` seconds, at each
    :meth:`tell`: the monitor and the jobs page follow it."""

    def __init__(self, job):
        self.job, self.log = job, job.folder / 'out' / 'log'
        self.seen, self.told = _mtime(self.log), time.monotonic()

    def tell(self):
        if _mtime(self.log) != self.seen and \
                time.monotonic() - self.told > ANNOUNCE:
            self.seen, self.told = _mtime(self.log), time.monotonic()
            self.job.announce()


def _mtime(path):
    try:  # a symlink's own time: its target may be anyone's
        return os.lstat(path).st_mtime_ns
    except OSError:
        return None
