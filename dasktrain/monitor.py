"""The cluster at a glance: Prometheus metrics and a live jobs page, served
by the Dask scheduler's own web server (its dashboard port).

``dask scheduler --preload dasktrain.monitor`` (what ``dasktrain cluster
start`` runs) installs three things in the scheduler process:

* a :class:`JobBoard` scheduler plugin, which keeps the latest
  :meth:`~dasktrain.jobs.records.Job.summary` of every job from the Dask
  events jobs send on :data:`~dasktrain.jobs.records.EVENTS` (queued,
  running, each epoch, the end), after reading the jobs dir once at start
  for the jobs before it;
* a Prometheus collector (:class:`Collector`) on ``prometheus_client``'s
  default registry, which Dask's ``/metrics`` route serves beside Dask's
  own ``dask_scheduler_*`` series: jobs by state; per job (labels
  ``job_id``, ``name``, ``user``) epoch, iterations, losses, accuracies,
  images/s, data-wait and communication shares, GPUs held; per worker its
  process CPU and memory (what Dask's heartbeats carry) and, per GPU, NVML's
  utilisation, memory, temperature and power;
* the read-only jobs page (:mod:`dasktrain.jobs.page`) at ``/dasktrain/jobs``.

On a scheduler it also installs the queue's
:class:`~dasktrain.jobs.dispatch.Dispatcher`, and in a shared cluster
(``cluster start --shared`` set ``$DASKTRAIN_SHARED_SERVE``, as root) its
front door (:class:`~dasktrain.jobs.frontdoor.FrontDoor`), the Unix
socket every local user submits through.

``dask worker --preload dasktrain.monitor`` adds the worker's GPU readings
(:func:`gpu_readings`) to its heartbeats, and its GPUs' ids with who uses
each (:func:`dasktrain.gpuuse.worker_use`): the reading the queue's
dispatcher hands GPUs out by and keeps busy ones off. A worker without
NVML or without GPUs sends an empty list: no GPU series, and no error.

Everything computed here is read-only and binds nowhere new: the page and
``/metrics`` are routes of the dashboard's server, wherever it binds
(127.0.0.1 unless told otherwise). It never writes a job's files (that is
:mod:`dasktrain.jobs`').
"""
import collections
import math
import os

from distributed.diagnostics.plugin import SchedulerPlugin

from dasktrain.cluster.shared import OWNER_ENV, SERVE_ENV
from dasktrain.gpuuse import USE_METRIC, cluster_use, worker_use
from dasktrain.jobs.dispatch import Dispatcher
from dasktrain.jobs.frontdoor import FrontDoor
from dasktrain.jobs.page import PATH, add_routes
from dasktrain.jobs.records import EVENTS, STATES, list_jobs
from dasktrain.parallel.gpus import visible_gpus
from dasktrain.parallel.nvml import (
    driver_view,
    match_cuda_devices,
    nvml_gpu,
    nvml_read,
)

GPU_METRIC = 'dasktrain-gpus'  # the worker heartbeat's key for NVML readings
JOB_LABELS = ('job_id', 'name', 'user')
SUMMARY_KEYS = {'id', 'folder', 'name', 'user', 'gpus', 'workers', 'epochs',
                'submitted', 'state', 'held', 'started', 'ended', 'row',
                'epoch_seconds'}


def links(dashboard):
    """The jobs page's and ``/metrics``' addresses beside ``dashboard``
    (Dask's dashboard link, e.g. ``http://127.0.0.1:8787/status``)."""
    from urllib.parse import urlsplit, urlunsplit
    parts = urlsplit(dashboard)
    root = parts.path.rsplit('/', 1)[0]  # Dask's --dashboard-prefix stays
    return {'jobs page': urlunsplit(parts._replace(path=root + PATH)),
            'metrics': urlunsplit(parts._replace(path=root + '/metrics'))}


# ------------------------------------------------------------ on a worker

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


# --------------------------------------------------------- the scheduler

class JobBoard(SchedulerPlugin):
    """The latest summary of every job the scheduler has heard of.

    Each event on :data:`~dasktrain.jobs.records.EVENTS` replaces the job's
    summary whole (a summary is a job's complete state, so no event depends
    on an earlier one); the jobs dir is read once at start for the jobs
    queued or run before this scheduler.
    """
    name = 'dasktrain-job-board'

    def __init__(self, jobs_dir=None):
        self.jobs = {}
        for job in list_jobs(jobs_dir):
            try:
                self.jobs[job.id] = job.summary()
            except Exception as e:  # damaged: one row that says why
                self.jobs[job.id] = job.damaged(e)

    def log_event(self, topic, msg):
        # Whole summaries only: a scrape must never fail on a stray event.
        if topic == EVENTS and isinstance(msg, dict) and \
                SUMMARY_KEYS <= msg.keys():
            self.jobs[msg['id']] = msg

    def summaries(self):
        """Every job, oldest first."""
        return sorted(self.jobs.values(), key=lambda j: j['submitted'])


def _gauge(name, doc, labels=()):
    from prometheus_client.core import GaugeMetricFamily
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _finite(value):
    return isinstance(value, (int, float)) and math.isfinite(value)


# Per job: name -> (help, the label beside the job's, if any) ...
_JOB_FAMILIES = {
    'dasktrain_job_epoch': ('Epochs the job has completed', None),
    'dasktrain_job_max_epochs': ('Epochs the job was asked to train', None),
    'dasktrain_job_loss': ('Mean loss of the last epoch', 'split'),
    'dasktrain_job_accuracy_ratio': ('Accuracy of the last epoch (0-1)',
                                     'split'),
    'dasktrain_job_images_per_second': ('Training images per second in the '
                                        'last epoch', None),
    'dasktrain_job_epoch_seconds': ('Wall time of the last epoch, its '
                                    'evaluation included', None),
    'dasktrain_job_data_wait_ratio': ('Share of the last epoch spent '
                                      'waiting for augmented data', None),
    'dasktrain_job_communication_ratio': ('Share of the last epoch spent '
                                          'communicating between replicas '
                                          'and workers', None),
    'dasktrain_job_gpus': ('GPUs the job holds now', None),
    'dasktrain_job_start_timestamp_seconds': ('When the job first started',
                                              None),
    'dasktrain_job_end_timestamp_seconds': ('When the job ended', None),
}
# ... and its samples: (name, that label's value, value of (summary, row)).
_JOB_SAMPLES = (
    ('dasktrain_job_epoch', None, lambda j, r: r['epoch'] if r else 0),
    ('dasktrain_job_max_epochs', None, lambda j, r: j['epochs']),
    ('dasktrain_job_loss', 'train', lambda j, r: r and r.get('main/loss')),
    ('dasktrain_job_loss', 'validation',
     lambda j, r: r and r.get('validation/main/loss')),
    ('dasktrain_job_accuracy_ratio', 'train',
     lambda j, r: r and r.get('main/accuracy')),
    ('dasktrain_job_accuracy_ratio', 'validation',
     lambda j, r: r and r.get('validation/main/accuracy')),
    ('dasktrain_job_images_per_second', None,
     lambda j, r: r and r.get('images_per_sec')),
    ('dasktrain_job_epoch_seconds', None, lambda j, r: j['epoch_seconds']),
    ('dasktrain_job_data_wait_ratio', None,
     lambda j, r: _share(j, r and r.get('data_wait_time'))),
    ('dasktrain_job_communication_ratio', None,
     lambda j, r: _share(j, r and r.get('comm_time'))),
    ('dasktrain_job_gpus', None, lambda j, r: _gpus_held(j)),
    ('dasktrain_job_start_timestamp_seconds', None, lambda j, r: j['started']),
    ('dasktrain_job_end_timestamp_seconds', None, lambda j, r: j['ended']),
)


def _share(job, seconds):
    epoch = job['epoch_seconds']
    if not _finite(seconds) or not _finite(epoch) or epoch <= 0:
        return None
    return min(seconds / epoch, 1.0)


def _gpus_held(job):
    if job['state'] != 'running':
        return 0
    if job.get('workers'):  # scale-out: its ranks hold gpus on each worker
        return job['gpus'] * job['workers']
    return len(job['held'])


class Collector:
    """dasktrain's series for ``prometheus_client``, built at each scrape
    from the :class:`JobBoard` and the workers' last heartbeats."""

    def __init__(self, scheduler, board):
        self.scheduler, self.board = scheduler, board

    def collect(self):
        from prometheus_client.core import CounterMetricFamily
        jobs = self.board.summaries()
        by_state = _gauge('dasktrain_jobs', 'Jobs by state', ['state'])
        counts = collections.Counter(j['state'] for j in jobs)
        for state in STATES + tuple(sorted(set(counts) - set(STATES))):
            by_state.add_metric([state], counts[state])
        yield by_state
        state = _gauge('dasktrain_job_state', 'The state of each job '
                       '(1 for its current state)', JOB_LABELS + ('state',))
        iterations = CounterMetricFamily(
            'dasktrain_job_iterations', 'Training iterations the job has '
            'done', labels=JOB_LABELS)
        families = {name: _gauge(name, doc, JOB_LABELS + ((extra,) if extra
                                                         else ()))
                    for name, (doc, extra) in _JOB_FAMILIES.items()}
        for job in jobs:
            labels = [job['id'], job['name'], job['user']]
            row = job['row']
            state.add_metric(labels + [job['state']], 1)
            if row:
                iterations.add_metric(labels, row['iteration'])
            for name, extra, value in _JOB_SAMPLES:
                v = value(job, row)
                if _finite(v):
                    families[name].add_metric(
                        labels + ([extra] if extra else []), v)
        yield state
        yield iterations
        yield from families.values()
        yield from self._workers()

    def _workers(self):
        worker = ('worker',)
        cpu = _gauge('dasktrain_worker_busy_cpu_cores', 'CPU cores the '
                     'worker process keeps busy (Dask\'s heartbeat)', worker)
        memory = _gauge('dasktrain_worker_memory_bytes', 'Memory (RSS) of '
                        'the worker process (Dask\'s heartbeat)', worker)
        limit = _gauge('dasktrain_worker_memory_limit_bytes', 'The worker\'s '
                       'memory limit', worker)
        gpus = _gauge('dasktrain_worker_gpus', 'GPUs the worker advertises '
                      '(its GPU resource)', worker)
        labels = worker + ('gpu', 'uuid')
        gpu = {key: _gauge(name, doc, labels) for key, name, doc in (
            ('utilization', 'dasktrain_gpu_utilization_ratio',
             'Share of the last sample period a kernel ran (NVML)'),
            ('memory_used', 'dasktrain_gpu_memory_used_bytes',
             'GPU memory in use (NVML)'),
            ('memory_total', 'dasktrain_gpu_memory_total_bytes',
             'GPU memory in all (NVML)'),
            ('temperature', 'dasktrain_gpu_temperature_celsius',
             'GPU core temperature (NVML)'),
            ('power', 'dasktrain_gpu_power_watts', 'GPU power draw (NVML)'))}
        for ws in list(self.scheduler.workers.values()):
            address, metrics = [ws.address], ws.metrics or {}
            if _finite(metrics.get('cpu')):
                cpu.add_metric(address, metrics['cpu'] / 100)
            if _finite(metrics.get('memory')):
                memory.add_metric(address, metrics['memory'])
            if ws.memory_limit:
                limit.add_metric(address, ws.memory_limit)
            gpus.add_metric(address, ws.resources.get('GPU', 0))
            for reading in metrics.get(GPU_METRIC) or ():
                for key, family in gpu.items():
                    if _finite(reading.get(key)):
                        family.add_metric(address + [
                            str(reading['index']), reading['uuid']],
                            reading[key])
        yield from (cpu, memory, limit, gpus, *gpu.values())


_installed = {}  # the collector on prometheus_client's registry, if any


def dask_setup(server):
    """Dask's preload hook, for a scheduler or a worker."""
    from distributed import Scheduler
    if not isinstance(server, Scheduler):
        server.metrics[GPU_METRIC] = gpu_readings
        # Its GPUs' ids and who uses them: what the queue's dispatcher
        # hands out and keeps off (GPUs busy outside the queue).
        server.metrics[USE_METRIC] = worker_use
        return
    from prometheus_client import REGISTRY
    board = JobBoard()
    server.add_plugin(board)
    queue = Dispatcher()  # the queue's order (its jobs come back by recover)
    server.add_plugin(queue, name=queue.name)
    if os.environ.get(SERVE_ENV) and os.geteuid() == 0:  # a shared cluster
        owner = os.environ.get(OWNER_ENV, '')
        server.add_plugin(FrontDoor(
            os.environ[SERVE_ENV], int(owner) if owner.isdigit() else None,
            gpu_use=cluster_use))
    collector = _installed.get('collector')
    if collector is None:
        collector = _installed['collector'] = Collector(server, board)
        REGISTRY.register(collector)
    # One registry per process: a later scheduler here takes it over.
    collector.scheduler, collector.board = server, board
    add_routes(server.http_application, board, queue)


def dask_teardown(server):
    from distributed import Scheduler
    collector = _installed.get('collector')
    if isinstance(server, Scheduler) and collector is not None and \
            collector.scheduler is server:
        from prometheus_client import REGISTRY
        REGISTRY.unregister(collector)
        _installed.clear()
