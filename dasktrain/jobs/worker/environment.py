"""A job's environment: an allowlist of the queue's own (:data:`BASE`),
its submitter's, then the queue's own variables; nothing of its worker's.

A job starts from :data:`BASE` (a ``PATH`` and a locale: no process's,
so no secret of anyone's) and what its submitter sent (``env.json``:
their environment when they submitted, ``--env`` additions included;
read with bounds and checked: :func:`submitted_env`), never from the worker
process's: not the Dask nanny's pre-spawn settings
(``OMP_NUM_THREADS=1``, ``MALLOC_TRIM_THRESHOLD_``), not the variables
of whoever started the cluster (its ``--notify`` URL, its state folder,
a shared cluster's root shell with its ``AWS_SECRET_ACCESS_KEY`` or
``SSH_AUTH_SOCK``). The queue then sets its own:
``CUDA_VISIBLE_DEVICES`` to exactly the job's GPUs (none: ``''``), the
BLAS thread counts to the job's share of the worker's cores
(:func:`job_threads`) where the submitter chose none, unbuffered Python
output (``output.log`` is read live), and in a shared cluster the user's
``HOME``, ``USER`` and ``LOGNAME``.
"""
import re

from dasktrain.jobs.job import ENV_LIMIT, JobError, read_file
from dasktrain.parallel.gpus import with_visible_gpus

THREADS = ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS')
# What every job's environment starts from, before its submitter's.
BASE = {'PATH': '/usr/local/bin:/usr/bin:/bin', 'LANG': 'C.UTF-8'}
_NAME = re.compile(r'[A-Za-z_][A-Za-z0-9_]{0,199}')


def submitted_env(folder):
    """The environment the submitter of the job in ``folder`` sent
    (``env.json``, bounded, never through a symlink): a dict of variable
    names to strings; JobError in one line for anything else."""
    env = read_file(folder, 'env.json', ENV_LIMIT, cached=False)
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and _NAME.fullmatch(k) and
            isinstance(v, str) and '\0' not in v for k, v in env.items()):
        raise JobError(f'job {folder.name}: env.json is not variable names '
                       'to strings')
    return env


def job_threads(cores, gpus, resources):
    """BLAS threads for a job holding ``gpus`` GPUs (0: a CPU slot) on a
    worker with ``cores`` (the CPUs it may run on, a count or a set) and
    ``resources`` (``{'GPU': n, 'CPU': m}``, what it offers): the job's
    share of the cores, its GPUs or slot among all the worker offers, at
    least one; every core on a worker that offers nothing.

    >>> job_threads(16, 1, {'GPU': 2, 'CPU': 2}), job_threads(16, 0, {})
    (4, 16)
    >>> job_threads(2, 0, {'CPU': 1}), job_threads(2, 1, {'GPU': 2, 'CPU': 1})
    (2, 1)
    """
    cores = cores if isinstance(cores, int) else len(cores)
    units = int(resources.get('GPU', 0)) + int(resources.get('CPU', 0))
    return max(1, cores * max(gpus, 1) // max(units, 1))


def job_environment(recorded, gpus, threads, user=None):
    """The environment of a job's program: ``recorded`` (its submitter's)
    with ``gpus`` (the :class:`~dasktrain.parallel.gpus.Gpu` it holds)
    visible, ``threads`` BLAS threads unless the submitter chose, and
    ``user``'s ``HOME``, ``USER`` and ``LOGNAME`` (a shared cluster's
    job; None: as recorded).

    >>> from dasktrain.jobs.worker.runas import User
    >>> u = User(1001, 1001, 'ann', '/home/ann', '/bin/sh', [1001])
    >>> env = job_environment({'PATH': '/bin', 'USER': 'root',
    ...                        'OMP_NUM_THREADS': '3'}, [], 2, u)
    >>> env['USER'], env['HOME'], env['CUDA_VISIBLE_DEVICES']
    ('ann', '/home/ann', '')
    >>> env['OMP_NUM_THREADS'], env['MKL_NUM_THREADS'], env['LANG']
    ('3', '2', 'C.UTF-8')
    """
    env = dict(BASE, **recorded)
    env['PYTHONUNBUFFERED'] = '1'
    for name in THREADS:
        env.setdefault(name, str(threads))
    if user is not None:
        env.update(USER=user.name, HOME=user.home, LOGNAME=user.name)
    return with_visible_gpus(env, gpus)
