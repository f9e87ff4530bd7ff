"""Prometheus metrics of the cluster, served by the Dask scheduler's own
web server beside Dask's ``dask_scheduler_*`` series (its ``/metrics``):
jobs by state; per job (labels ``job_id``, ``name``, ``user``) epoch,
iterations, losses, accuracies, images/s, data-wait and communication
shares, GPUs held; per worker its process CPU and memory (what Dask's
heartbeats carry) and, per GPU, NVML's utilisation, memory, temperature
and power (:func:`~dasktrain.jobs.worker.gpu_use.gpu_readings`, on the
workers' heartbeats). A ``private`` collector (a shared cluster's: the
metrics are anyone's who reaches the port) leaves out every series
made of a job's output (epoch, iterations, losses, accuracies, rates):
:data:`PRIVATE_FAMILIES` only. Whatever a job's files held, a scrape
answers: a job that cannot be measured is left out of the series it
breaks, never the scrape.

:class:`Collector` builds them at each scrape from the
:class:`~dasktrain.jobs.scheduler.board.JobBoard` and the workers' last
heartbeats, on ``prometheus_client``'s default registry
(:func:`register`). A worker without NVML or without GPUs sends an empty
list: no GPU series, and no error. Read-only, and binds nowhere new.
"""
import collections
import math

from dasktrain.jobs.job import STATES
from dasktrain.jobs.scheduler.page import PATH
from dasktrain.jobs.worker.gpu_use import GPU_METRIC

JOB_LABELS = ('job_id', 'name', 'user')


def links(dashboard):
    """The jobs page's and ``/metrics``' addresses beside ``dashboard``
    (Dask's dashboard link, e.g. ``http://127.0.0.1:8787/status``)."""
    from urllib.parse import urlsplit, urlunsplit
    parts = urlsplit(dashboard)
    root = parts.path.rsplit('/', 1)[0]  # Dask's --dashboard-prefix stays
    return {'jobs page': urlunsplit(parts._replace(path=root + PATH)),
            'metrics': urlunsplit(parts._replace(path=root + '/metrics'))}


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


# What a private collector says of each job: the queue's, not the job's.
PRIVATE_FAMILIES = ('dasktrain_job_gpus',
                    'dasktrain_job_start_timestamp_seconds',
                    'dasktrain_job_end_timestamp_seconds')


def _share(job, seconds):
    epoch = job['epoch_seconds']
    if not _finite(seconds) or not _finite(epoch) or epoch <= 0:
        return None
    return min(seconds / epoch, 1.0)


def _gpus_held(job):
    return job['gpus_in_all'] if job['state'] == 'running' else 0


class Collector:
    """dasktrain's series for ``prometheus_client``, built at each scrape
    from the :class:`JobBoard` and the workers' last heartbeats."""

    def __init__(self, scheduler, board, private=False):
        self.scheduler, self.board, self.private = scheduler, board, private

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
            labels = [str(job.get(k)) for k in ('id', 'name', 'user')]
            row = None if self.private else job.get('row')
            state.add_metric(labels + [str(job.get('state'))], 1)
            if row and _finite(row.get('iteration')):
                iterations.add_metric(labels, row['iteration'])
            for name, extra, value in _JOB_SAMPLES:
                if self.private and name not in PRIVATE_FAMILIES:
                    continue
                try:
                    v = value(job, row)
                except (KeyError, TypeError, ValueError):  # not measured
                    continue
                if _finite(v):
                    families[name].add_metric(
                        labels + ([extra] if extra else []), v)
        yield state
        if not self.private:
            yield iterations
        yield from (f for name, f in families.items()
                    if not self.private or name in PRIVATE_FAMILIES)
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


def register(scheduler, board, private=False):
    """The :class:`Collector` of ``scheduler``'s ``board`` on
    ``prometheus_client``'s registry (``private``: see the module). One
    registry per process: a later scheduler here takes it over."""
    from prometheus_client import REGISTRY
    collector = _installed.get('collector')
    if collector is None:
        collector = _installed['collector'] = Collector(scheduler, board)
        REGISTRY.register(collector)
    collector.scheduler, collector.board = scheduler, board
    collector.private = private
    return collector


def unregister(scheduler):
    """Take ``scheduler``'s collector off the registry, if it is there."""
    collector = _installed.get('collector')
    if collector is not None and collector.scheduler is scheduler:
        from prometheus_client import REGISTRY
        REGISTRY.unregister(collector)
        _installed.clear()
