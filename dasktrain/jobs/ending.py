"""How a job ends: its states (:class:`JobState`, as Ray's ``JobStatus``),
an end as its ``status.json`` records it (:class:`JobEnd`, as Ray's
``JobInfo``), and the one mapping from how its program ended to that
end (:func:`job_end`), for a job of one process and a gang alike.

What can end a job's program, and the state each gives:

* its exit: 0 ``finished``; any other code ``failed`` (with its last
  line where it is dasktrain's training program, else the exit in
  words); a training program's :data:`PRUNED` ``pruned`` and its
  :data:`STOPPED` (a ``stop`` command) ``finished``, ending ``stopped by
  request``;
* a signal: ``failed``, killed by it (``out of memory`` where its
  cgroup's memory limit killed it);
* its ``cancel`` flag, as the queue stops it: empty (someone cancelled
  it) ``cancelled``; holding a reason (its time limit passed) ``failed``
  with that reason.
"""
import dataclasses
import enum
import signal

from dasktrain.keeper import exit_words

PRUNED = 3  # exit code of a training program whose training was pruned
STOPPED = 4  # exit code of a training program a `stop` command ended


class JobState(str, enum.Enum):
    """A job's state, as ``status.json`` and the jobs table say it."""
    QUEUED = 'queued'
    RUNNING = 'running'
    FINISHED = 'finished'
    FAILED = 'failed'
    CANCELLED = 'cancelled'
    PRUNED = 'pruned'
    LOST = 'lost'  # its worker died under it, and it does not resume

    def __str__(self):
        return self.value


STATES = tuple(s.value for s in JobState)
DONE = tuple(s.value for s in JobState
             if s not in (JobState.QUEUED, JobState.RUNNING))


@dataclasses.dataclass(frozen=True)
class JobEnd:
    """A job's end as ``status.json`` records it: its ``state``, the
    ``error`` that says why (None where it finished), its program's
    ``exit_code`` (None where it never ran) and its ``ending`` where a
    finished job did not run to its end (``stopped by request``)."""
    state: JobState
    error: str | None = None
    exit_code: int | None = None
    ending: str | None = None

    def changes(self):
        """Its keys of ``status.json``
        (:func:`~dasktrain.jobs.job.update_status`'s changes).

        >>> JobEnd(JobState.FAILED, 'exit 2', 2).changes()
        {'state': 'failed', 'error': 'exit 2', 'exit_code': 2}
        """
        more = {} if self.exit_code is None else {
            'exit_code': self.exit_code}
        if self.ending is not None:
            more['ending'] = self.ending
        return {'state': self.state.value, 'error': self.error, **more}


def job_end(code, training, stopped=None, reason=None, failure=None,
            oom=False):
    """The end of a job whose program ended with ``code`` (as
    ``Popen.returncode`` says it); ``training``: dasktrain's own training
    program (its :data:`PRUNED` and :data:`STOPPED` mean what the module
    says); ``stopped``: how the queue's stop ended it, in words, where
    its ``cancel`` flag stopped it (None: it ended by itself);
    ``reason``: that flag's text (empty: a cancel); ``failure``: what
    failed, in words, where known (a training program's last line, a
    gang's rank); ``oom``: its cgroup killed a process of it for memory.

    >>> job_end(0, False)
    JobEnd(state=<JobState.FINISHED: 'finished'>, error=None, \
exit_code=0, ending=None)
    >>> job_end(3, True).state, job_end(3, False).error
    (<JobState.PRUNED: 'pruned'>, 'exit 3')
    >>> job_end(4, True).ending
    'stopped by request'
    >>> job_end(-9, False, oom=True).error
    'out of memory (--mem): killed by SIGKILL'
    >>> job_end(-15, True, stopped='stopped by SIGTERM').state
    <JobState.CANCELLED: 'cancelled'>
    >>> job_end(-15, True, 'stopped by SIGTERM', 'its time limit (60 s) '
    ...         'passed').error
    'its time limit (60 s) passed: stopped by SIGTERM'
    """
    if stopped is not None:
        if not reason:
            return JobEnd(JobState.CANCELLED, stopped, code)
        return JobEnd(JobState.FAILED, f'{reason}: {stopped}' if stopped
                      else reason, code)
    if code == 0:
        return JobEnd(JobState.FINISHED, None, code)
    if training and code == PRUNED:
        return JobEnd(JobState.PRUNED, None, code)
    if training and code == STOPPED:
        return JobEnd(JobState.FINISHED, None, code, 'stopped by request')
    words = exit_words(code)
    if oom and code == -signal.SIGKILL:
        words = f'out of memory (--mem): {words}'
    return JobEnd(JobState.FAILED, failure or words, code)
