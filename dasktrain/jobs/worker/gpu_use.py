"""A worker's GPUs and who uses them: what its heartbeats carry, read on
the worker (installed by :mod:`~dasktrain.jobs.worker.preload`).

Two readings per heartbeat (and, under :data:`UNUSABLE_METRIC`, the line
of :func:`~dasktrain.parallel.cuda_check.unusable_gpus_here` where CuPy cannot
use the machine's GPUs: the preload asks once). :func:`gpu_readings`:
NVML's utilisation,
memory, temperature and power of the worker's GPUs (its
``CUDA_VISIBLE_DEVICES``, else all), for the metrics. :func:`worker_use`:
the worker's GPUs by the ids jobs get (their ``CUDA_VISIBLE_DEVICES``
entries), the processes NVML sees on them, and for each its OS user, its
memory and the queue job it belongs to
(:func:`~dasktrain.parallel.outside.job_of`: a job's keeper
is the process, an ancestor, or its session leader; the worker process
itself is the queue's too); the scheduler judges from it which GPUs are
busy outside the queue (:mod:`~dasktrain.jobs.scheduler.outside_use`).

NVML's process lists are read as :mod:`dasktrain.parallel.nvml` reads
them (:func:`~dasktrain.parallel.nvml.nvml_processes`). A pid is the
host's (NVML's namespace): in a container's namespace ``/proc`` does not
know it (``seen`` False), and its user reads ``?``; whose it is then is
decided from what the worker knows, the GPUs its jobs and ranks hold and
those its own process has a context on
(:func:`~dasktrain.parallel.outside.owners`). Every decision is a pure
function of those entries and of ``/proc`` texts, tested with scripted
entries; only :func:`read_process`, :func:`gpu_readings` and
:func:`worker_use` touch NVML, ``/proc`` and the driver.
"""
import os

from dasktrain.cluster.settings import BUSY_ENV, BUSY_MIB
from dasktrain.jobs.job import user_name
from dasktrain.jobs.worker.program import job_children
from dasktrain.parallel.gpus import GpuPool, visible_gpus
from dasktrain.parallel.nvml import (
    driver_view,
    match_cuda_devices,
    nvml_gpu,
    nvml_processes,
    nvml_read,
    worker_devices,
)
from dasktrain.parallel.outside import WORKER, owners

USE_METRIC = 'dasktrain-gpu-use'  # the heartbeat's key of worker_use()
GPU_METRIC = 'dasktrain-gpus'     # the heartbeat's key of gpu_readings()
#: the heartbeat's key of the line where CuPy cannot use the GPUs here
UNUSABLE_METRIC = 'dasktrain-gpus-unusable'

MIB = 1024 * 1024



def threshold(env=None):
    """The busy threshold in MiB: ``$DASKTRAIN_BUSY_MIB`` (``cluster
    start --busy-mib``), else :data:`~dasktrain.cluster.settings.BUSY_MIB`.

    >>> threshold({'DASKTRAIN_BUSY_MIB': '1024'}), threshold({})
    (1024.0, 256.0)
    """
    env = os.environ if env is None else env
    try:
        return float(env[BUSY_ENV])
    except (KeyError, ValueError):
        return float(BUSY_MIB)


# ------------------------------------------------- /proc: user, lineage

def parse_status(text):
    """(real uid, parent pid) from ``/proc/PID/status``' text.

    >>> parse_status('Name:\\tpython\\nPPid:\\t41\\nUid:\\t1000\\t1000\\t1000'
    ...              '\\t1000\\n')
    (1000, 41)
    """
    uid = ppid = None
    for line in text.splitlines():
        key, _, value = line.partition(':')
        if key == 'Uid' and value.split():
            uid = int(value.split()[0])
        elif key == 'PPid' and value.strip():
            ppid = int(value)
    return uid, ppid


def parse_stat(text):
    """The session id from ``/proc/PID/stat``' text (after the command,
    which may hold spaces and parentheses: ``pid (comm) state ppid pgrp
    session ...``).

    >>> parse_stat('4242 (my (odd) prog) S 1 4242 4240 0 -1')
    4240
    """
    fields = text[text.rindex(')') + 1:].split()
    return int(fields[3])


def read_process(pid, proc='/proc'):
    """``{'uid', 'ppid', 'session'}`` of ``pid`` from ``/proc``; None for
    each that cannot be read (a pid of another namespace, gone, hidden)."""
    found = {'uid': None, 'ppid': None, 'session': None}
    try:
        with open(f'{proc}/{pid}/status') as f:
            found['uid'], found['ppid'] = parse_status(f.read())
        with open(f'{proc}/{pid}/stat') as f:
            found['session'] = parse_stat(f.read())
    except (OSError, ValueError, IndexError):
        pass
    return found


def lineage(pid, read=read_process, depth=64):
    """``(uid, session, [parent, grandparent, ...])`` of ``pid``."""
    first = read(pid)
    ancestors, ppid = [], first['ppid']
    while ppid and ppid not in ancestors and len(ancestors) < depth:
        ancestors.append(ppid)
        ppid = read(ppid)['ppid']
    return first['uid'], first['session'], ancestors


# ------------------------------------------------------ on a worker

def worker_use(worker=None, env=None, read=read_process, nvml=None,
               held=None, own=None):
    """What this worker's heartbeats carry: ``ids`` (its GPUs, the ids jobs
    hold, and the queue hands out), ``nvml`` (whether NVML could list their
    processes),
    ``processes`` (each with ``gpu``, ``pid``, ``user``, ``mib``,
    ``session``, ``ancestors``, ``seen`` (whether ``/proc`` shows the pid)
    and ``job``: the queue job's id, :data:`WORKER`,
    :data:`~dasktrain.parallel.outside.HELD`, or None outside the queue:
    :func:`~dasktrain.parallel.outside.owners`), ``jobs`` (``[[pid,
    job id]]`` of its jobs' children), ``held`` (its GPUs a job or rank
    holds now), ``own`` (those its own process has a CUDA context on) and
    ``busy_mib``.

    ``read`` (a pid's ``/proc`` facts, as :func:`read_process`), ``nvml``
    (``nvml(ids, env)`` -> ``{gpu id: [{'pid', 'bytes'}] or None}``, as
    NVML lists them), ``held`` and ``own`` (GPU ids) stand in for
    ``/proc``, NVML, the worker's pool and the CUDA driver where a test
    scripts them."""
    env = os.environ if env is None else env
    total = int(worker.state.total_resources.get('GPU', 0)) \
        if worker is not None else None
    ids = visible_gpus(env, count=total)
    jobs = dict(job_children())
    jobs[os.getpid()] = WORKER
    held = sorted(GpuPool.held() & set(ids)) if held is None \
        else list(held)
    own = _own_contexts(ids, env) if own is None else list(own)
    processes, listed = [], False
    for entry, pids in (nvml or _nvml_use)(ids, env).items():
        if pids is None:
            continue
        listed = True
        for p in pids:
            uid, session, ancestors = lineage(p['pid'], read)
            processes.append({
                'gpu': entry, 'pid': p['pid'],
                'user': '?' if uid is None else user_name(uid),
                'mib': None if p['bytes'] is None else p['bytes'] / MIB,
                'session': session, 'ancestors': ancestors,
                'seen': uid is not None})
    for process, owner in zip(processes, owners(processes, jobs, held, own)):
        process['job'] = owner
    return {'ids': ids, 'nvml': listed, 'processes': processes,
            'jobs': [[pid, job] for pid, job in jobs.items()],
            'held': held, 'own': own, 'busy_mib': threshold(env)}


def _own_contexts(ids, env):
    """The worker's GPU ids (its CUDA ordinals' entries) on which its own
    process has a CUDA context; none where the driver cannot say, or for
    another process's environment."""
    if env is not os.environ or not ids:
        return []
    from dasktrain.parallel.cuda_driver import primary_contexts
    active = primary_contexts() or []
    return [entry for entry, on in zip(ids, active) if on]


def _nvml_use(ids, env):
    """``{gpu id: NVML's processes on it (None: not listed)}``; empty
    without NVML."""
    from distributed.diagnostics import nvml
    try:
        count = nvml.device_get_count()  # Dask's per-process NVML init
    except Exception:  # a broken driver reads as no GPU, never an error
        return {}
    if not count or not ids:
        return {}
    import pynvml
    gpus = [nvml_gpu(pynvml, index) for index in range(count)]
    uuids = driver_view() if env is os.environ else None
    matched = worker_devices(
        gpus, ids, uuids=uuids,
        pci_order=env.get('CUDA_DEVICE_ORDER') == 'PCI_BUS_ID')
    return {entry: nvml_processes(pynvml, gpu['handle'])
            for entry, gpu in matched.items()}


def gpu_readings(worker=None, env=None):
    """NVML's readings of the GPUs this worker owns: its
    ``CUDA_VISIBLE_DEVICES`` (ids or ``GPU-`` UUIDs), else all of them.

    Returns
    -------
    list of dict
        ``index``, ``uuid``, ``utilization`` (0-1), ``memory_used`` and
        ``memory_total`` (bytes), ``temperature`` (Celsius), ``power``
        (watts); a value NVML does not support on that GPU is None. Empty
        without NVML or GPUs.
    """
    from distributed.diagnostics import nvml
    try:
        count = nvml.device_get_count()  # Dask's per-process NVML init
    except Exception:  # a broken driver reads as no GPU, never an error
        return []
    if not count:
        return []
    import pynvml
    own = env is None  # this process's: the CUDA driver can say which
    env = os.environ if env is None else env
    gpus = [nvml_gpu(pynvml, index) for index in range(count)]
    if own and driver_view() is not None:
        chosen = match_cuda_devices(gpus, uuids=driver_view())
    elif 'CUDA_VISIBLE_DEVICES' in env:
        chosen = match_cuda_devices(
            gpus, entries=visible_gpus(env),
            pci_order=env.get('CUDA_DEVICE_ORDER') == 'PCI_BUS_ID')
    else:
        chosen = gpus
    readings = []
    for gpu in chosen:
        index, uuid, handle = gpu['index'], gpu['uuid'], gpu['handle']
        util = nvml_read(pynvml.nvmlDeviceGetUtilizationRates, handle)
        memory = nvml_read(pynvml.nvmlDeviceGetMemoryInfo, handle)
        power = nvml_read(pynvml.nvmlDeviceGetPowerUsage, handle)  # mW
        readings.append({
            'index': index, 'uuid': uuid or '',
            'utilization': None if util is None else util.gpu / 100,
            'memory_used': None if memory is None else memory.used,
            'memory_total': None if memory is None else memory.total,
            'temperature': nvml_read(pynvml.nvmlDeviceGetTemperature, handle,
                                 pynvml.NVML_TEMPERATURE_GPU),
            'power': None if power is None else power / 1000})
    return readings
