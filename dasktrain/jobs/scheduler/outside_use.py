"""GPUs busy outside the queue: the one rule that turns the workers'
heartbeat readings of who uses their GPUs
(:func:`~dasktrain.jobs.worker.gpu_use.worker_use`) into the GPUs no job
may get now, for the queue's dispatcher and ``dasktrain gpus`` alike.

A GPU is busy where processes outside the queue (neither a job's nor the
worker's: :func:`~dasktrain.jobs.worker.gpu_use.job_of`) hold more than
the cluster's threshold (``cluster start --busy-mib``,
``$DASKTRAIN_BUSY_MIB``), or memory NVML cannot tell. Every function here
is pure but :func:`busy_outside` and :func:`cluster_use`, which read the
scheduler's copy of the last heartbeats.
"""
from dasktrain.cluster.settings import BUSY_MIB
from dasktrain.jobs.worker.gpu_use import (
    USE_METRIC,
    describe,
    job_of,
    threshold,
)

BOARD = 'dasktrain-job-board'  # the job board's plugin name


def outside_use(processes, job_sessions, threshold_mib=BUSY_MIB):
    """``{gpu_id: 'user (pid N, M MiB)'}``: the GPUs on which processes
    outside the queue hold more than ``threshold_mib`` MiB (or an amount
    NVML cannot tell: it may be anything), the largest first.

    Parameters
    ----------
    processes : list of dict
        ``gpu`` (the worker's GPU id), ``pid``, ``user``, ``mib`` (None:
        unknown), ``session``, ``ancestors``.
    job_sessions : dict
        ``{pid: label}``: the queue's own processes (jobs' children, the
        worker), matched by :func:`job_of`.
    threshold_mib : float

    >>> procs = [{'gpu': '0', 'pid': 7, 'user': 'bob', 'mib': 9000,
    ...           'session': 7, 'ancestors': [1]},
    ...          {'gpu': '1', 'pid': 8, 'user': 'ann', 'mib': 9000,
    ...           'session': 5, 'ancestors': [5, 1]},
    ...          {'gpu': '1', 'pid': 9, 'user': 'gdm', 'mib': 40,
    ...           'session': 9, 'ancestors': [1]}]
    >>> outside_use(procs, {5: 'job-a'}, threshold_mib=256)
    {'0': 'bob (pid 7, 9000 MiB)'}
    """
    busy = {}
    for p in processes:
        if job_of(p, job_sessions) is not None:
            continue
        if p.get('mib') is None or p['mib'] > threshold_mib:
            busy.setdefault(p['gpu'], []).append(p)
    return {gpu: ', '.join(describe(p) for p in sorted(
        found, key=lambda p: -(p['mib'] if p['mib'] is not None
                               else float('inf'))))
            for gpu, found in busy.items()}


def worker_ids(use, count):
    """A worker's ``count`` GPUs by the ids jobs get, from its last
    reading ``use`` (None: none yet): its ``CUDA_VISIBLE_DEVICES``
    entries, else ``0..count-1``.

    >>> worker_ids({'ids': ['3', '5']}, 2), worker_ids(None, 2)
    (['3', '5'], ['0', '1'])
    """
    ids = (use or {}).get('ids') if isinstance(use, dict) else None
    if not isinstance(ids, (list, tuple)) or len(ids) < count:
        ids = range(count)
    return [str(i) for i in ids][:count]


def busy_from(uses, threshold_mib):
    """:func:`busy_outside` from ``{worker: its last worker_use() or
    None}``.

    >>> busy_from({'w1': {'processes': [{'gpu': '1', 'pid': 9, 'user': 'bob',
    ...                                  'mib': 700.0, 'session': 9,
    ...                                  'ancestors': [1]}],
    ...                   'jobs': [[4, 'job-a']]}, 'w2': None}, 512)
    {'w1': {'1': 'bob (pid 9, 700 MiB)'}, 'w2': {}}
    """
    found = {}
    for address, use in uses.items():
        use = use if isinstance(use, dict) else {}
        jobs = {pid: job for pid, job in use.get('jobs') or ()}
        found[address] = outside_use(use.get('processes') or (), jobs,
                                     threshold_mib)
    return found


def busy_outside(dask_scheduler, threshold_mib=None):
    """``{worker address: {gpu_id: 'user (pid N, M MiB)'}}``: the GPUs no
    job may get now, from each worker's last heartbeat (a worker without
    NVML, or without such processes, has ``{}``).

    Parameters
    ----------
    dask_scheduler : distributed.Scheduler
        In the scheduler's process (the queue's dispatcher; or
        ``client.run_on_scheduler(busy_outside)``, which passes it).
    threshold_mib : float, optional
        Default: ``cluster start --busy-mib`` (``$DASKTRAIN_BUSY_MIB`` of
        the scheduler), else :data:`~dasktrain.cluster.settings.BUSY_MIB`.

    Examples
    --------
    >>> busy_outside(dask_scheduler)  # doctest: +SKIP
    {'tls://10.0.0.5:40001': {'1': 'bob (pid 4242, 9000 MiB)'}}
    """
    return busy_from({address: (ws.metrics or {}).get(USE_METRIC)
                      for address, ws in
                      list(dask_scheduler.workers.items())},
                     threshold() if threshold_mib is None else threshold_mib)


def cluster_use(dask_scheduler):
    """What ``dasktrain gpus`` shows, as the scheduler knows it (run with
    ``client.run_on_scheduler``): per worker its resources and last
    ``worker_use`` (None before its first heartbeat, or without the
    worker's preload, :mod:`~dasktrain.jobs.worker.preload`), the GPUs
    busy outside the queue as the queue's dispatcher sees them
    (:func:`busy_outside`), and the job board's summaries."""
    board = dask_scheduler.plugins.get(BOARD)
    return {'workers': {address: {
        'resources': dict(ws.resources),
        'use': (ws.metrics or {}).get(USE_METRIC)}
        for address, ws in list(dask_scheduler.workers.items())},
        'busy': busy_outside(dask_scheduler),
        'jobs': board.summaries() if board is not None else [],
        'busy_mib': threshold()}
