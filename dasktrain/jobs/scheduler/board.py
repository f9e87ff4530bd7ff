"""The job board: the latest summary of every job the scheduler has heard
of, kept from the Dask events jobs send on
:data:`~dasktrain.jobs.job.EVENTS` (queued, running, each epoch, the
end); what the jobs page, the metrics and ``dasktrain gpus`` read.
"""
from distributed.diagnostics.plugin import SchedulerPlugin

from dasktrain.jobs.job import EVENTS, list_jobs
from dasktrain.jobs.scheduler.outside_use import BOARD

SUMMARY_KEYS = {'id', 'folder', 'name', 'user', 'gpus', 'workers', 'epochs',
                'submitted', 'state', 'held', 'started', 'ended', 'row',
                'epoch_seconds'}


class JobBoard(SchedulerPlugin):
    """The latest summary of every job the scheduler has heard of.

    Each event on :data:`~dasktrain.jobs.job.EVENTS` replaces the job's
    summary whole (a summary is a job's complete state, so no event depends
    on an earlier one); the jobs dir is read once at start for the jobs
    queued or run before this scheduler.
    """
    name = BOARD

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
