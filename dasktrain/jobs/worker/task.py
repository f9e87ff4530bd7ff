"""A job on its worker: the one task body, :func:`run_job`. Every job is a
program run under its keeper (:mod:`dasktrain.keeper`): a command job's
is its command, a training job's ``python -m dasktrain.jobs.worker.child
FOLDER`` (:mod:`~dasktrain.jobs.worker.child`, or a search's trial
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
end and what really ended it: ``finished`` (exit
0; a training program's :data:`~dasktrain.jobs.job.STOPPED` too, its
``ending`` 'stopped by request'), ``pruned`` (a training program's
:data:`~dasktrain.jobs.job.PRUNED`), else ``failed``, with the training
program's last line (its one-line error) or the exit in words. A job
whose worker died under it runs again where it resumes by itself (a
training job; a command with ``requeue``), else ends ``lost``. Every
change is announced to the scheduler
(:meth:`~dasktrain.jobs.job.Job.announce`).
"""
import logging
import os
import signal
import time
from pathlib import Path

from dasktrain import containment, keeper
from dasktrain.cluster.settings import job_pids, max_grace
from dasktrain.errors import plural
from dasktrain.files import read_regular
from dasktrain.jobs.job import (
    DONE,
    PRUNED,
    STOPPED,
    Job,
    JobError,
    update_status,
)
from dasktrain.jobs.worker.environment import (
    job_environment,
    job_threads,
    submitted_env,
)
from dasktrain.jobs.worker.program import (
    Epochs,
    contained,
    finish,
    job_program,
    kept_for,
)
from dasktrain.jobs.worker.runas import job_user, last_line, open_output
from dasktrain.parallel.gpus import GpuPool

logger = logging.getLogger(__name__)



def run_job(folder, gpus=None, ranks=None):
    """The task body: one attempt of the job in ``folder``; the state it
    ended in. ``gpus``: the ids of this worker's GPUs the queue planned
    for it (see :class:`~dasktrain.parallel.gpus.GpuPool`); ``ranks``: a
    training job across workers, ``[(worker, [GPU ids])]`` where the
    queue placed its ranks: its gang (:mod:`~dasktrain.jobs.worker.gang`)."""
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
    # (A folder of an earlier version without `requeue` is a training
    # job's: it resumed from its checkpoint.)
    if status['state'] == 'running' and not spec.get('requeue', True):
        # The attempt before never ended: its worker died under it.
        update_status(folder, state='lost', ended=time.time(),
                      error=f'its worker ({status["worker"]}) died while it '
                            'ran; submit it again, or with --requeue if it '
                            'resumes by itself')
        job.announce()
        return 'lost'
    try:
        user = job_user(spec)  # a shared cluster's: its submitter
        program = job_program(spec, folder, user)
    except JobError as e:
        return _failed(folder, str(e), job)
    worker = get_worker()
    # A training job across workers holds no GPU here: its ranks do.
    held = GpuPool.acquire(spec['gpus'], want=gpus) \
        if spec['gpus'] and not spec.get('workers') else []
    try:
        return _attempt(job, spec, status, program, user, held, worker,
                        ranks)
    finally:
        GpuPool.release(held)


def _attempt(job, spec, status, program, user, held, worker, ranks):
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
        return _failed(folder, str(e), job)
    env = job_environment(recorded, held, job_threads(
        os.sched_getaffinity(0), len(held), worker.state.total_resources),
        user)
    rows = job.log_rows()
    begins = f'resuming after epoch {rows[-1]["epoch"]}' if rows else \
        f'in {program.cwd}: {" ".join(program.argv)}' \
        if not program.ours else 'starting'
    asked = spec.get('grace')  # None: the cluster's longest
    grace = max_grace() if asked is None else min(float(asked), max_grace())
    cancelled = None
    kept_in = containment.in_force()
    where = containment.jobs_folder()
    problem = kept_in.limit_problem(mem=spec.get('mem')) if where else \
        None if spec.get('mem') is None else \
        "this worker cannot cap a job's memory: it has no cgroup"
    if problem:
        return _failed(folder, f'--mem: {problem}', job)
    if ranks and program.ours:
        # A training job across workers: its ranks are its program, each
        # under its keeper, as its submitter (jobs.worker.gang).
        return _gang(job, spec, ranks, grace, attempt, user)
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
                epochs = Epochs(job)
                while kept.poll() is None:
                    if cancelled is None and (folder / 'cancel').exists():
                        cancelled = kept.stop(grace)
                        log.write(f'=== cancelled: {cancelled} ===\n'
                                  .encode())
                    epochs.tell()
                    time.sleep(0.2)
        finally:
            left = finish(contain)  # only then are its GPUs free
        for note in kept.notes():
            log.write(f'=== {note} ===\n'.encode())
        end = kept.ending() or {}
        if left:
            left = plural(left, 'process', 'processes')
            log.write(f'=== {left} the job left were killed '
                      'after its keeper ended ===\n'.encode())
        elif end.get('left') and cancelled is None:
            left = plural(end['left'], 'process', 'processes')
            log.write(f'=== it ended; the {left} it left running were '
                      'killed by SIGKILL after its grace ===\n'.encode())
        if end.get('oom'):
            oom = plural(end['oom'], 'process', 'processes')
            log.write(f"=== {oom} killed for memory (--mem "
                      f"{spec.get('mem')} bytes) ===\n".encode())
        error = kept.start_error()
        if error is not None:  # no such program; its folder not enterable
            return _failed(folder, error, job, log)
    code = kept.returncode
    more = {}
    if cancelled is not None:
        state, error = stopped_state(folder, cancelled)
    elif code == 0:
        state, error = 'finished', None
    elif program.ours and code == PRUNED:
        state, error = 'pruned', None
    elif program.ours and code == STOPPED:  # a stop command's end
        state, error, more = 'finished', None, {'ending': 'stopped by request'}
    else:
        words = exit_words(code)[len('failed ('):-1]
        if end.get('oom') and code == -signal.SIGKILL:
            words = f'out of memory (--mem): {words}'
        state = 'failed'
        error = (last_line(folder, user) if program.ours else None) or words
    # Recorded before the GPUs are free: the next job starts after it.
    update_status(folder, state=state, error=error, ended=time.time(),
                  exit_code=code, **more)
    job.announce()
    return state


def _gang(job, spec, ranks, grace, attempt, user):
    """Run the gang ``job`` on ``ranks`` and record how it ended."""
    from dasktrain.jobs.worker.gang import run_gang
    folder = job.folder
    with open_output(folder, user) as log:
        log.write(f'=== attempt {attempt}: {len(ranks)} ranks on '
                  f'{", ".join(w for w, _ in ranks)}; rank 0 writes here, '
                  'rank r to rank{r}.log ===\n'.encode())
    def say(line):
        with open_output(folder, user) as log:
            log.write(f'=== {line} ===\n'.encode())
    code, how, rank = run_gang(job, spec, ranks, grace, attempt, say)
    more = {}
    if code is None:
        state, error = stopped_state(folder, how)
    elif code == 0:
        state, error = 'finished', None
    elif code == PRUNED:
        state, error = 'pruned', None
    elif code == STOPPED:
        state, error, more = 'finished', None, {
            'ending': 'stopped by request'}
    else:
        state, error = 'failed', f'rank {rank}: {how}'
    update_status(folder, state=state, error=error, ended=time.time(),
                  exit_code=code, **more)
    job.announce()
    return state


def _failed(folder, error, job, log=None):
    """Record that the job in ``folder`` failed before its program ran,
    with ``error`` (also written to its output ``log``, when given), and
    tell the job's watchers; 'failed'."""
    if log is not None:
        log.write(f'error: {error}\n'.encode())
    update_status(folder, state='failed', error=error, ended=time.time())
    job.announce()
    return 'failed'


def exit_words(returncode):
    """The end of a program in words, from ``Popen.returncode``.

    >>> exit_words(0), exit_words(3), exit_words(-9)
    ('finished', 'failed (exit 3)', 'failed (killed by SIGKILL)')
    """
    if returncode == 0:
        return 'finished'
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f'signal {-returncode}'
        return f'failed (killed by {name})'
    return f'failed (exit {returncode})'


def stopped_state(folder, how):
    """(state, error) of a job its ``cancel`` flag stopped: ``cancelled``
    (an empty flag: someone cancelled it), or ``failed`` with the reason
    the queue wrote into the flag (its time limit passed); ``how`` it
    was stopped, in words, if known."""
    try:
        reason = read_regular(Path(folder) / 'cancel', limit=4096).decode(
            'utf-8', 'replace').strip()
    except OSError:
        reason = ''
    if not reason:
        return 'cancelled', how
    return 'failed', f'{reason}: {how}' if how else reason
