"""GPUs used outside the queue, the rules: which queue job a process on a
GPU belongs to (:func:`job_of`: a job's keeper is the process, an
ancestor, or its session leader), whose each process NVML lists is
(:func:`owners`: also those ``/proc`` cannot show, as a worker in a
container sees the host's pids), a process in words (:func:`describe`),
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
HELD = 'the job holding the GPU'  # unseen processes on a GPU held now


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


def _size(process):
    """A process's MiB for ordering, unknown as the largest."""
    mib = process.get('mib')
    return float('inf') if mib is None else mib


def owners(processes, jobs, held=None, own=()):
    """Whose each of ``processes`` is, in their order: a queue job's id,
    :data:`WORKER`, :data:`HELD`, or None: outside the queue.

    A process ``/proc`` shows (``seen``, the default) is judged by its
    lineage (:func:`job_of`), and as a job's only on a GPU this worker
    holds for a job or rank now (``held``: GPU ids); a job sees no other
    GPU (its ``CUDA_VISIBLE_DEVICES``), so one there is a pid of another
    namespace that happens to be a job's here, or a job that stepped
    outside its GPUs. The worker's own (:data:`WORKER`: its process and
    ranks of ``dasktrain launch`` under it) may be on any GPU.

    A process ``/proc`` does not show (``seen`` False) is in another PID
    namespace (NVML gives the host's pids; a worker in a container has
    its own), or hidden from this user, or gone: nothing traces it. It is
    the queue's only where the worker knows its own are there unseen:

    * on a GPU held now (``held``), the holder's (:data:`HELD`): that GPU
      goes to no other job while held, so what this hides is never beside
      a job handed that GPU; once released, such a process is outside;
    * on a GPU where the worker's own process has a CUDA context (``own``:
      GPU ids; a rank run in it leaves one) while no process of the
      worker is seen there: one of them is the worker, taken as the
      smallest (unknown memory: the largest), so that beside an outsider
      the larger figure stays outside, to be judged by the threshold.

    Every other process is outside the queue. ``held`` None (a reading
    that does not say) leaves the job processes seen to their lineage and
    no unseen one the queue's.

    Examples
    --------
    A worker in a container: its job's child holds GPU 0 under a host pid
    ``/proc`` does not know; on GPU 1, held by no one, an unseen process
    is someone else's:

    >>> seen = {'pid': 7, 'session': 7, 'ancestors': [5, 1]}
    >>> hidden = {'session': None, 'ancestors': [], 'seen': False}
    >>> procs = [dict(hidden, gpu='0', pid=41234, mib=900.0),
    ...          dict(hidden, gpu='1', pid=41300, mib=700.0),
    ...          dict(seen, gpu='0')]
    >>> owners(procs, {5: 'job-a'}, held=['0'])
    ['the job holding the GPU', None, 'job-a']
    >>> owners(procs, {5: 'job-a'}, held=[])
    [None, None, None]

    The worker's own context on GPU 1 accounts for one unseen process
    there, the smaller:

    >>> procs.append(dict(hidden, gpu='1', pid=41301, mib=300.0))
    >>> owners(procs, {5: 'job-a'}, held=['0'], own=['1'])
    ['the job holding the GPU', None, 'job-a', 'dask worker']
    """
    labels = [job_of(p, jobs) for p in processes]
    if held is None:
        return labels
    held, own = set(held), set(own or ())
    unseen = {}
    for i, p in enumerate(processes):
        if not p.get('seen', True):
            labels[i] = None
            unseen.setdefault(p['gpu'], []).append(i)
        elif labels[i] not in (None, WORKER) and p['gpu'] not in held:
            labels[i] = None  # a job's pid, but not on a GPU it holds
    for gpu, found in unseen.items():
        if gpu in held:
            for i in found:
                labels[i] = HELD
        elif gpu in own and not any(
                label == WORKER and processes[i]['gpu'] == gpu
                for i, label in enumerate(labels)):
            labels[min(found, key=lambda i: _size(processes[i]))] = WORKER
    return labels


def outside_use(processes, job_sessions, threshold_mib, held=None, own=()):
    """``{gpu_id: 'user (pid N, M MiB)'}``: the GPUs on which processes
    outside the queue (:func:`owners`) hold more than ``threshold_mib``
    MiB (or an amount NVML cannot tell: it may be anything), the largest
    first.

    Parameters
    ----------
    processes : list of dict
        ``gpu`` (the worker's GPU id), ``pid``, ``user``, ``mib`` (None:
        unknown), ``session``, ``ancestors``, ``seen`` (whether ``/proc``
        shows the pid; default True).
    job_sessions : dict
        ``{pid: label}``: the queue's own processes (jobs' children, the
        worker), matched by :func:`job_of`.
    threshold_mib : float
    held, own : list of str, optional
        The worker's GPUs held by a job or rank now, and those its own
        process has a CUDA context on (see :func:`owners`).

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
    for p, owner in zip(processes, owners(processes, job_sessions, held,
                                          own)):
        if owner is not None:
            continue
        if p.get('mib') is None or p['mib'] > threshold_mib:
            busy.setdefault(p['gpu'], []).append(p)
    return {gpu: ', '.join(describe(p) for p in sorted(
        found, key=lambda p: -_size(p)))
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
    ``{'processes': [...], 'jobs': [[pid, label], ...], 'held': [GPU
    ids], 'own': [GPU ids]}``; a reading without ``held``, of an earlier
    worker, is judged by lineage alone).

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
        held = use.get('held')
        found[address] = outside_use(
            use.get('processes') or (), jobs, threshold_mib,
            list(held) if isinstance(held, (list, tuple)) else None,
            use.get('own') if isinstance(use.get('own'), (list, tuple))
            else ())
    return found
