"""The job queue, cut by where its code runs, around one checked request.

Every process reads the same few modules: a job (:mod:`~dasktrain.jobs.job`),
its states and how it comes to one (:mod:`~dasktrain.jobs.ending`), its
``job.json`` read back typed (:mod:`~dasktrain.jobs.record`), the request
that makes one (:mod:`~dasktrain.jobs.request`) and the checks of its
fields (:mod:`~dasktrain.jobs.fields`), its folder
(:mod:`~dasktrain.jobs.folder`),
a shared cluster's socket lines (:mod:`~dasktrain.jobs.wire`), what the
scheduler knows in the jobs table's words (:mod:`~dasktrain.jobs.status`)
and what a job's end tells (:mod:`~dasktrain.jobs.end_notice`). Then:

* :mod:`~dasktrain.jobs.worker`: a job on its worker, one task body for
  every job (a program under its keeper), as whom, with what environment,
  who uses the worker's GPUs;
* :mod:`~dasktrain.jobs.scheduler`: the queue in the scheduler process:
  its policy, the dispatcher, GPUs busy outside the queue, a shared
  cluster's socket server, recovery, the job board, metrics and page, the
  preload that installs them;
* :mod:`~dasktrain.jobs.client`: the submitter's side: which queue,
  submitting, the socket's client.

Imports run one way: client -> scheduler -> worker -> the common modules.
Each name below imports its module on first use (importing the package
loads no dask.distributed).
"""
from dasktrain._lazy import exports

_EXPORTS = {
    **dict.fromkeys((
        'EVENTS', 'JOBS_ENV', 'KEY_PREFIX', 'Job', 'Pruned', 'current_user',
        'jobs_dir', 'list_jobs', 'update_status', 'user_name'),
        'dasktrain.jobs.job'),
    **dict.fromkeys(('DONE', 'PRUNED', 'STATES', 'STOPPED', 'JobEnd',
                     'JobState'), 'dasktrain.jobs.ending'),
    **dict.fromkeys(('JobError', 'parse_size', 'parse_time'),
                    'dasktrain.jobs.fields'),
    **dict.fromkeys(('TRAIN_JOB', 'JobRecord'), 'dasktrain.jobs.record'),
    **dict.fromkeys(('JobRequest', 'Program', 'Training'),
                    'dasktrain.jobs.request'),
    **dict.fromkeys(('submit', 'submit_command', 'queue_request'),
                    'dasktrain.jobs.client.submit'),
    **dict.fromkeys(('find', 'shared_queue'), 'dasktrain.jobs.client.route'),
    **dict.fromkeys(('Dispatcher', 'set_user_limit'),
                    'dasktrain.jobs.scheduler.dispatch'),
    **dict.fromkeys(('Plan', 'plan'), 'dasktrain.jobs.scheduler.policy'),
    **dict.fromkeys(('ask_scheduler', 'SchedulerPoller'),
                    'dasktrain.jobs.scheduler.query'),
    'run_job': 'dasktrain.jobs.worker.task',
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
