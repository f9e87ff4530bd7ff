"""Dask clusters: the recorded cluster on this machine, its state and
clients (:mod:`~dasktrain.cluster.local`, TLS by ``tls``), and throwaway
local workers for one run (``workers``), and a notebook's cluster
(``notebook``: the one given or running, else a new one it stops again).
A run across workers is :mod:`dasktrain.run.train`'s, the job queue
:mod:`dasktrain.jobs`, the scheduler's metrics
:mod:`dasktrain.jobs.scheduler.metrics`.

Each name below imports its module on first use (importing the package
loads no dask.distributed).
"""
from dasktrain._lazy import exports

_EXPORTS = {
    **dict.fromkeys((
        'ClusterError', 'HOME_ENV', 'SCHEDULER_PRELOAD', 'WORKER_PRELOAD',
        'cluster_status', 'connect', 'default_security', 'detect_gpus',
        'exposure_warning', 'home', 'read_state', 'restore_default_scheduler',
        'security_from', 'start_cluster', 'state_path', 'stop_cluster',
        'tls_dir', 'worker_info'), 'dasktrain.cluster.local'),
    **dict.fromkeys(('local_device_workers', 'local_workers'),
                    'dasktrain.cluster.workers'),
    **dict.fromkeys(('ensure_cluster', 'release_cluster'),
                    'dasktrain.cluster.notebook'),
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
