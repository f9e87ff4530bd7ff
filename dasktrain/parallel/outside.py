"""GPUs used outside the queue, the rules: which queue job a process on a
GPU belongs to (:func:`job_of`: a job's keeper is the process, an
ancestor, or its session leader), a process in words (:func:`describe`),
the GPUs on which processes outside the queue hold more than a threshold
or memory NVML cannot tell (:func:`outside_use`, :func:`busy_from`), and
a worker's GPUs by the ids jobs get (:func:`worker_ids`).

Pure functions of process entries as a worker reads them
(:mod:`dasktrain.jobs.worker.gpu_use`: NVML's lists, ``/proc``, the
worker's job keepers); the scheduler judges its workers' readings with
them (:mod:`dasktrain.jobs.scheduler.outside_use`), and ``dasktrain
gpus`` shows them.
"""

WORKER = 'dask worker'  # the owner of the worker's own process


def job_of(process, jobs):
    """The queue job (a label from ``jobs``: ``{child pid: job id}``)
    ``process`` belongs to: its own pid, its nearest ancestor among
    ``jobs``, else its session leader's; None outside the queue.

    >>> p = {'pid': 12, 'session': 10, 'ancestors': [11, 10, 5, 1]}
    >>> job_of(p, {10: 'job-a', 5: WORKER})
    'job-a'
    >>> job_of(dict(p, ancestors=[1]), {10: 'job-a'})  # its parent died
    'job-a'
    >>> job_of(dict(p, session=12, ancestors=[1]), {10: 'job-a'}) is None
    True
    """
    for pid in [process['pid']] + list(process.get('ancestors') or ()):
        if pid in jobs:
            return jobs[pid]
    return jobs.get(process.get('session'))


def describe(process):
    """``'user (pid N, M MiB)'``.

    >>> describe({'user': 'ann', 'pid': 7, 'mib': 5120.4})
    'ann (pid 7, 5120 MiB)'
    >>> describe({'user': '?', 'pid': 7, 'mib': None})
    '? (pid 7, memory unknown)'
    """
    mib = 'memory unknown' if process.get('mib') is None else \
        f"{process['mib']:.0f} MiB"
    return f"{process['user']} (pid {process['pid']}, {mib})"


def outside_use(processes, job_sessions, threshold_mib):
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
    """``{worker: {gpu_id: 'user (pid N, M MiB)'}}`` (:func:`outside_use`
    of each) from ``{worker: its last reading or None}`` (a reading:
    ``{'processes': [...], 'jobs': [[pid, label], ...]}``).

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
