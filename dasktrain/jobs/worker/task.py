"""A job on its worker: the one task body, :func:`run_job`. Every job is a
program run under its keeper (:mod:`dasktrain.keeper`): a command job's
is its command, a training job's ``python -m dasktrain.jobs.worker.train_job
FOLDER`` (:mod:`~dasktrain.jobs.worker.train_job`, or a search's trial
module), always resuming from its last checkpoint.

The task takes the GPUs the queue planned for it (no other job on its
worker holds them), records the attempt, starts the program in its
folder (a training job's: the job folder) with its environment
(:func:`~dasktrain.jobs.worker.environment.job_environment`: its
submitter's, never the worker's), as its submitter in a shared cluster
(:mod:`~dasktrain.jobs.worker.runas`), its output into ``output.log``,
in a cgroup of its own (:mod:`dasktrain.containment`: ``job-ID-N``
under this worker's folder of the cluster's subtree, with its
``--mem`` and the cluster's ``--pids-per-job``; else found by its
marker) with its submitter's resource limits; stops it when its
``cancel`` flag appears (SIGTERM to every process of it, SIGKILL after
its grace, at most the cluster's ``--max-grace``), waits until no
process of it is left (only then are its GPUs free), and records the
end and what really ended it, as its record maps it
(:meth:`~dasktrain.jobs.record.JobRecord.end`, the one mapping of
:mod:`~dasktrain.jobs.ending`). A job
whose worker died under it runs again where it resumes by itself (a
training job; a command with ``requeue``), else ends ``lost``. Every
change is announced to the scheduler
(:meth:`~dasktrain.jobs.job.Job.announce`).
"""
import logging
import os
import time
from pathlib import Path

from dasktrain import containment, keeper
from dasktrain.cluster.settings import job_pids, max_grace
from dasktrain.errors import plural
from dasktrain.jobs.ending import DONE, JobEnd, JobState
from dasktrain.jobs.job import Job, JobError, update_status
from dasktrain.jobs.worker.environment import (
    job_environment,
    job_threads,
    submitted_env,
)
from dasktrain.jobs.worker.program import (
    EpochAnnouncer,
    contained,
    finish,
    kept_for,
)
from dasktrain.jobs.worker.runas import job_user, last_line, open_output
from dasktrain.parallel.gpus import GpuPool

logger = logging.getLogger(__name__)
POLL = 0.2  # s between two looks at a job's program and its cancel flag


def run_job(folder, placed):
    """The task body: one attempt of the job in ``folder``; the state it
    ended in. ``placed``: where the queue placed it, ``[(worker, [GPU
    ids])]``: this worker's GPUs it holds (see
    :class:`~dasktrain.parallel.gpus.GpuPool`), or where a gang's ranks
    go (:mod:`~dasktrain.jobs.worker.gang`)."""
    from distributed import get_worker
    folder = Path(folder)
    job = Job(folder.name, folder)
    try:
        spec, status = job.spec(), job.recorded()
    except JobError as e:  # its files are damaged: nothing runs
        logger.warning('dasktrain job %s not run: %s', folder.name, e)
        return 'unreadable'
    if (folder / 'cancel').exists() or status['state'] in DONE:
        return status['state']
    if status['state'] == 'running' and not spec.requeue:
        # The attempt before never ended: its worker died under it.
        return _record(job, JobEnd(
            JobState.LOST, f'its worker ({status["worker"]}) died while it '
            'ran; submit it again, or with --requeue if it resumes by '
            'itself'))
    try:
        user = job_user(spec)  # a shared cluster's: its submitter
        program = spec.program(folder, user)
    except JobError as e:
        return _failed(job, str(e))
    worker = get_worker()
    # A training job across workers holds no GPU here: its ranks do.
    held = GpuPool.acquire(spec.gpus_here, want=placed[0][1]) \
        if spec.gpus_here else []
    try:
        return _attempt(job, spec, status, program, user, held, worker,
                        placed)
    finally:
        GpuPool.release(held)


def _attempt(job, spec, status, program, user, held, worker, placed):
    folder = job.folder
    ids = [g.id for g in held]  # the worker's CUDA_VISIBLE_DEVICES entries
    attempt = status.get('attempts', 0) + 1
    update_status(folder, state='running', attempts=attempt, gpus=ids,
                  worker=worker.address,
                  started=status.get('started') or time.time())
    job.announce()
    try:
        recorded = submitted_env(folder)
    except JobError as e:
        return _failed(job, str(e))
    env = job_environment(recorded, held, job_threads(
        os.sched_getaffinity(0), len(held), worker.state.total_resources),
        user)
    rows = job.log_rows()
    begins = f'resuming after epoch {rows[-1]["epoch"]}' if rows else \
        program.said
    asked = spec.grace  # None: the cluster's longest
    grace = max_grace() if asked is None else min(float(asked), max_grace())
    kept_in = containment.in_force()
    where = containment.jobs_folder()
    problem = kept_in.limit_problem(mem=spec.mem) if where else \
        None if spec.mem is None else \
        "this worker cannot cap a job's memory: it has no cgroup"
    if problem:
        return _failed(job, f'--mem: {problem}')
    if spec.gang:
        # A training job across workers: its ranks are its program, each
        # under its keeper, as its submitter (jobs.worker.gang).
        return _gang(job, spec, placed, grace, attempt, user)
    contain = contained(job.id, attempt, spec, where,
                        containment.cluster_mark(), job_pids(),
                        kept_in.controllers if where else ())
    with open_output(folder, user) as log:
        log.write(f'=== attempt {attempt} on {worker.address}, GPUs '
                  f'{",".join(ids) or "none"} (CUDA_VISIBLE_DEVICES='
                  f'{env["CUDA_VISIBLE_DEVICES"]!r}), {begins} ===\n'
                  .encode())
        if asked is not None and grace < asked:
            log.write(f'=== grace {asked:g} s asked; this cluster stops a '
                      f'job within {grace:g} s (--max-grace) ===\n'.encode())
        log.flush()
        # Under its keeper: nothing the program starts outlives it.
        kept = keeper.start(program.argv, env, grace, stdout=log,
                            user=user, cwd=program.cwd,
                            stdin=program.stdin, contain=contain)
        try:
            with kept_for(kept, job.id):
                ended = kept.watch((folder / 'cancel').exists, grace,
                                   every=EpochAnnouncer(job).tell,
                                   poll=POLL)
        finally:
            left = finish(contain)  # only then are its GPUs free
        if ended.stopped is not None:
            log.write(f'=== cancelled: {ended.stopped} ===\n'.encode())
        for note in kept.notes():
            log.write(f'=== {note} ===\n'.encode())
        if left:
            left = plural(left, 'process', 'processes')
            log.write(f'=== {left} the job left were killed '
                      'after its keeper ended ===\n'.encode())
        elif ended.report.get('left') and ended.stopped is None:
            left = plural(ended.report['left'], 'process', 'processes')
            log.write(f'=== it ended; the {left} it left running were '
                      'killed by SIGKILL after its grace ===\n'.encode())
        if ended.report.get('outlived'):
            log.write(outlived_words(ended.report['outlived']).encode())
        oom = ended.report.get('oom')
        if oom:
            oom = plural(oom, 'process', 'processes')
            log.write(f"=== {oom} killed for memory (--mem "
                      f"{spec.mem} bytes) ===\n".encode())
        if ended.error is not None:  # no such program; its cwd not enterable
            return _failed(job, ended.error, log)
    # Recorded before the GPUs are free: the next job starts after it.
    return _record(job, spec.end(
        ended.code, ended.stopped, job.cancel_reason(), oom=bool(oom),
        last=lambda: last_line(folder, user)))


def outlived_words(pids):
    """The job's log line for what its keeper gave up on: the ``pids``
    still found (or not ended by SIGKILL) the grace after it.

    >>> print(outlived_words([4242, 4343]), end='')
    === 2 processes outlived its SIGKILL (pids 4242, 4343): not waited for ===
    """
    return (f'=== {plural(len(pids), "process", "processes")} outlived its '
            f'SIGKILL (pids {", ".join(map(str, pids))}): not waited for '
            '===\n')


def _gang(job, spec, placed, grace, attempt, user):
    """Run the gang ``job`` on its ranks ``placed`` and record how it
    ended."""
    from dasktrain.jobs.worker.gang import run_gang
    folder = job.folder
    with open_output(folder, user) as log:
        log.write(f'=== attempt {attempt}: {len(placed)} ranks on '
                  f'{", ".join(w for w, _ in placed)}; rank 0 writes here, '
                  'rank r to rank{r}.log ===\n'.encode())

    def say(line):
        with open_output(folder, user) as log:
            log.write(f'=== {line} ===\n'.encode())
    return _record(job, run_gang(job, spec, placed, grace, attempt, say))


def _record(job, end):
    """Record ``end`` (a :class:`~dasktrain.jobs.ending.JobEnd`) in the
    job's ``status.json`` and tell the job's watchers; its state."""
    update_status(job.folder, ended=time.time(), **end.changes())
    job.announce()
    return end.state.value


def _failed(job, error, log=None):
    """Record that ``job`` failed before its program ran, with ``error``
    (also written to its output ``log``, when given); 'failed'."""
    if log is not None:
        log.write(f'error: {error}\n'.encode())
    return _record(job, JobEnd(JobState.FAILED, error))
