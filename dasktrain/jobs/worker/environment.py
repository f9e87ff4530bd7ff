"""A job's environment: its submitter's, plus the queue's own variables,
and nothing of its worker's.

A job starts from what its submitter sent (``env.json``: their
environment when they submitted, ``--env`` additions included), never
from the worker process's: not the Dask nanny's pre-spawn settings
(``OMP_NUM_THREADS=1``, ``MALLOC_TRIM_THRESHOLD_``), not the variables
of whoever started the cluster (its ``--notify`` URL, its state folder,
a shared cluster's root shell). The queue then sets its own:
``CUDA_VISIBLE_DEVICES`` to exactly the job's GPUs (none: ``''``), the
BLAS thread counts to the job's share of the worker's cores
(:func:`job_threads`) where the submitter chose none, unbuffered Python
output (``output.log`` is read live), and in a shared cluster the user's
``HOME``, ``USER`` and ``LOGNAME``.
"""
from dasktrain.parallel.gpus import job_environment as with_gpus

THREADS = ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS')


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
    >>> env['OMP_NUM_THREADS'], env['MKL_NUM_THREADS']
    ('3', '2')
    """
    env = dict(recorded, PYTHONUNBUFFERED='1')
    for name in THREADS:
        env.setdefault(name, str(threads))
    if user is not None:
        env.update(USER=user.name, HOME=user.home, LOGNAME=user.name)
    return with_gpus(env, gpus)
