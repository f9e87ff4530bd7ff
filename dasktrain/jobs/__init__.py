"""Training jobs on a Dask cluster, queued by GPUs: a job's folder and files
(:mod:`~dasktrain.jobs.records`), checking and queueing it on the scheduler
(:mod:`~dasktrain.jobs.submit`), its order (:mod:`~dasktrain.jobs.queue`,
:mod:`~dasktrain.jobs.dispatch`), asking the scheduler about it
(:mod:`~dasktrain.jobs.asking`), requeueing what a scheduler lost
(:mod:`~dasktrain.jobs.recover`), running it on a worker
(:mod:`~dasktrain.jobs.worker`, as its submitter in a shared cluster:
:mod:`~dasktrain.jobs.runas`) and the live jobs page
(:mod:`~dasktrain.jobs.page`); a shared cluster's front door
(:mod:`~dasktrain.jobs.frontdoor`, its wire
:mod:`~dasktrain.jobs.protocol`) and the choice of queue a client talks
to (:mod:`~dasktrain.jobs.door`).

Each name below imports its module on first use (importing the package
loads no dask.distributed). ``submit``, ``recover`` and ``queue`` are
not among them: each would turn into the submodule of that name once that
is imported; they are ``dasktrain.submit`` (or
``dasktrain.jobs.submit.submit``), ``dasktrain.jobs.recover.recover`` and
``dasktrain.jobs.submit.queue``.
"""
from dasktrain._lazy import exports

_EXPORTS = {
    **dict.fromkeys((
        'DONE', 'EVENTS', 'JOBS_ENV', 'KEY_PREFIX', 'PRUNED', 'STATES',
        'STOPPED', 'Job',
        'JobError', 'Pruned', 'current_user', 'jobs_dir', 'list_jobs',
        'update_status', 'user_name'),
        'dasktrain.jobs.records'),
    **dict.fromkeys((
        'check_devices', 'check_owner', 'check_resources',
        'queue_options'),
        'dasktrain.jobs.submit'),
    **dict.fromkeys((
        'SchedulerPoller', 'ask_scheduler', 'scheduler_answer',
        'scheduler_states', 'scheduler_view'),
        'dasktrain.jobs.asking'),
    **dict.fromkeys(('Plan', 'parse_time', 'plan'), 'dasktrain.jobs.queue'),
    **dict.fromkeys(('Dispatcher', 'set_user_limit'),
                    'dasktrain.jobs.dispatch'),
    **dict.fromkeys((
        'STOP_POLICIES', 'live_jobs', 'lost_reason', 'orphans', 'requeue',
        'settle'), 'dasktrain.jobs.recover'),
    **dict.fromkeys((
        'CHILD', 'child_module', 'run_child', 'run_job'),
        'dasktrain.jobs.worker'),
    **dict.fromkeys(('DoorJob', 'FrontDoor', 'find', 'front_door'),
                    'dasktrain.jobs.door'),
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
