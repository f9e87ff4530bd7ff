"""Training jobs on a Dask cluster, queued by GPUs: a job's folder and files
(:mod:`~dasktrain.jobs.records`), checking and queueing it on the scheduler
(:mod:`~dasktrain.jobs.submit`), running it on a worker
(:mod:`~dasktrain.jobs.worker`) and the live jobs page
(:mod:`~dasktrain.jobs.page`).

Each name below imports its module on first use (importing the package
loads no dask.distributed). ``submit`` itself is not among them: it would
turn into the submodule of that name once that is imported; it is
``dasktrain.submit`` (or ``dasktrain.jobs.submit.submit``).
"""
from dasktrain._lazy import exports

_EXPORTS = {
    **dict.fromkeys((
        'DONE', 'EVENTS', 'JOBS_ENV', 'KEY_PREFIX', 'PRUNED', 'STATES', 'Job',
        'JobError', 'Pruned', 'jobs_dir', 'list_jobs', 'update_status'),
        'dasktrain.jobs.records'),
    **dict.fromkeys((
        'SchedulerPoller', 'ask_scheduler', 'cancel', 'check_devices',
        'check_resources', 'queue', 'requeue', 'scheduler_states'),
        'dasktrain.jobs.submit'),
    **dict.fromkeys((
        'CHILD', 'announce', 'child_module', 'run_child', 'run_job'),
        'dasktrain.jobs.worker'),
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
