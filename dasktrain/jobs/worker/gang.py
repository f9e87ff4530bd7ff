"""A training job across workers on a shared cluster (a gang): its ranks
are its training program, one per worker the queue placed them on, each
started as the job's submitter under its keeper, as every job is.

The ranks never reach the cluster's Dask (only root does): they join as
the ranks of ``dasktrain launch`` do
(:mod:`dasktrain.parallel.comm.rendezvous`), through a scheduler of their
own, started for the attempt as the submitter (never root: whoever holds
its key may run code in it) on the gang's first worker, with a CA and
certificate made for it alone (each copy written 0600 for the
submitter, removed when its rank ends), and then talk to each other
peer to peer. Rank 0 writes the job's ``out/`` and
``output.log``; rank r > 0 its ``rank{r}.log``.

The gang's task (:func:`run_gang`, root's, holding nothing) starts one
task per rank (:func:`gang_rank`, holding the rank's GPUs or CPU slot
on its worker) with :class:`~dasktrain.run.driver.Driver`, the driver
of every job of ranks, and watches them: the job ends when every rank
has (its end is rank 0's), when a rank fails (the others are stopped;
the job's error is that rank's last line), or when it is cancelled
(every rank stopped within its grace). When a rank's worker dies, the
ranks left go on from the last checkpoint on their workers and GPUs
(the config's ``on_worker_loss`` 'continue', the default), else the job
ends, to be requeued.
"""
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from dasktrain import containment, keeper
from dasktrain.cluster.local import worker_info
from dasktrain.cluster.settings import job_pids
from dasktrain.jobs.job import PRUNED, STOPPED, Job
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
from dasktrain.parallel.comm.rendezvous import rank_environment
from dasktrain.parallel.gpus import GpuPool
from dasktrain.parallel.placement import rank_resources
from dasktrain.run.driver import Driver, Stop
from dasktrain.run.launch import free_port, throwaway_tls

POLL = 0.2  # s between two looks at a rank's program
ENDS = (0, STOPPED, PRUNED)  # how a rank's program ends well


def run_gang(job, spec, placed, grace, attempt, say=None):
    """Run the gang ``job`` (its ``job.json`` is ``spec``) on ``placed``
    (``[(worker address, [GPU ids])]``, one per rank) until it ends:
    ``(code, how, rank)``: rank 0's exit code where every rank ended,
    else the failed rank's (``how``: why, in words; ``rank``: which),
    or ``(None, how, None)`` once cancelled. A rank's worker that dies:
    with its config's ``on_worker_loss`` 'continue' (the default) the
    ranks left go on from the last checkpoint, on the workers and GPUs
    the queue gave them; with 'wait', the job ends, to be requeued.
    ``say(line)``: how it goes, for the job's output."""
    say = say or (lambda line: None)
    config = spec.get('config') or {}
    left, round_ = list(placed), 0
    while True:
        round_ += 1
        code, how, rank, lost = _round(job, spec, left, grace,
                                       f'{attempt}-{round_}')
        if lost is None:
            return code, how, rank
        left = [p for p in left if p[0] not in lost]
        if config.get('on_worker_loss', 'continue') != 'continue' or \
                not left:
            return code, how, rank
        say(f'worker(s) {", ".join(lost)} lost: going on from the last '
            f'checkpoint with {len(left)} rank(s) (on_worker_loss '
            'continue)')


def _round(job, spec, placed, grace, attempt):
    """One start of the gang's ranks on ``placed`` (``attempt``: the
    job's attempt and this start's, ``'A-R'``): as :func:`run_gang` says,
    and the workers lost (None: none)."""
    from distributed import get_worker, worker_client
    from distributed.comm.addressing import get_address_host
    worker = get_worker()
    host = get_address_host(worker.address)
    name = f'dasktrain-gang-{job.id}-{attempt}'
    timeout = float((spec.get('config') or {}).get('collective_timeout')
                    or 300.0)
    user = job_user(job.spec())
    with throwaway_tls(host) as tls, worker_client() as client:
        pems = [Path(p).read_text() for p in tls]
        port = free_port(host)
        with user_tls(pems, user, job.folder) as theirs, \
                _rendezvous(job, spec, host, port, theirs, user, attempt,
                            grace):
            rendezvous = f'tls://{host}:{port}'
            infos = worker_info(client)
            with Driver(client, name, lambda event: None) as driver:
                driver.start(gang_rank, [
                    (str(job.folder), rank, len(placed), list(ids),
                     rendezvous, name, pems, grace, timeout, attempt)
                    for rank, (_, ids) in enumerate(placed)],
                    [w for w, _ in placed],
                    [rank_resources(spec['gpus'], infos.get(w, {}))
                     for w, _ in placed])
                epochs = Epochs(job)

                def cancelled():  # at every look: the epochs told too
                    epochs.tell()
                    return (job.folder / 'cancel').exists()
                outcome = driver.watch(
                    failed=lambda result: result['code'] not in ENDS,
                    interrupt=cancelled)
                driver.stop(grace + 10)
                first = driver.futures[0]
                if outcome.kind == 'failed' and outcome.value.echo() and \
                        first.status == 'finished' and \
                        first.result()['code'] in ENDS:
                    # Rank 0 ended the run (pruned, stopped): the others
                    # lost it as a peer.
                    return first.result()['code'], None, 0, None
    if outcome.kind == 'interrupted':
        return None, f'every rank stopped (grace {grace:g} s)', None, None
    if outcome.kind == 'done':
        return outcome.value[0]['code'], None, 0, None
    if outcome.kind == 'lost':
        rank = [w for w, _ in placed].index(outcome.value[0])
        return -9, (f'its worker ({outcome.value[0]}) died; `dasktrain '
                    f'requeue {job.id}` resumes the job from its last '
                    'checkpoint'), rank, outcome.value
    failure = outcome.value
    result = failure.result or {}
    how = result.get('why') or result.get('last') or failure.why or \
        f'{type(failure.error).__name__}: {failure.error}'
    return result.get('code', 1) or 1, how, failure.rank, None


@contextlib.contextmanager
def _rendezvous(job, spec, host, port, tls, user, attempt, grace):
    """The ranks' scheduler on ``host``:``port`` (TLS with the attempt's
    ``tls`` files, no dashboard) until the block ends: ``dask scheduler``
    as the job's submitter under its keeper, never root (whoever holds
    its key may run code in it: only as themselves), its output in the
    job's ``rendezvous.log``."""
    from dasktrain.spawn import python
    env = job_environment(submitted_env(job.folder), [], 1, user)
    env['DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION'] = '1'
    ca, cert, key = tls
    argv = python('distributed.cli.dask_scheduler', '--host', host,
                  '--port', str(port), '--protocol', 'tls', '--tls-ca-file',
                  ca, '--tls-cert', cert, '--tls-key', key, '--no-dashboard')
    where = containment.jobs_folder()
    contain = contained(job.id, f'{attempt}-rendezvous', spec, where,
                        containment.cluster_mark(), job_pids(),
                        containment.in_force().controllers if where else ())
    with _job_log(job.folder, 'rendezvous.log', user) as log:
        kept = keeper.start(argv, env, grace, stdout=log, user=user,
                            cwd=str(job.folder), contain=contain)
    try:
        yield
    finally:
        if kept.poll() is None:
            kept.stop(grace)
        finish(contain)


@contextlib.contextmanager
def user_tls(pems, user, where):
    """The rendezvous' CA, certificate and key (``pems``, PEM texts) as
    files only ``user`` (None: this process's) may read, in a folder of
    the job's folder ``where`` (what a killed worker leaves goes with the
    job), removed on exit: ``(ca, cert, key)`` paths."""
    folder = tempfile.mkdtemp(prefix='.rendezvous-tls-', dir=where)  # 0700
    try:
        paths = []
        for name, text in zip(('ca.pem', 'cert.pem', 'key.pem'), pems):
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, 'w') as f:
                f.write(text)
            if user is not None:
                os.chown(path, user.uid, user.gid)
            paths.append(path)
        if user is not None:
            os.chown(folder, user.uid, user.gid)
        yield tuple(paths)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _rank_log(folder, rank, user):
    """Rank 0's output: the job's ``output.log``; rank r's:
    ``rank{r}.log`` beside it (:func:`_job_log`)."""
    if rank == 0:
        return open_output(folder, user)
    return _job_log(folder, f'rank{rank}.log', user)


def _job_log(folder, name, user):
    """The job's log ``name`` for writing: the user's, 0600, made anew
    (never through a symlink: root's folder holds it)."""
    path = os.path.join(folder, name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600)
    if user is not None:
        os.fchown(fd, user.uid, user.gid)
    return os.fdopen(fd, 'ab')


def gang_rank(folder, rank, size, ids, rendezvous, name, pems, grace,
              timeout, attempt):
    """The task of rank ``rank`` of ``size``: the job's training program
    as its submitter, holding the GPUs ``ids`` of this worker (none: a
    CPU slot), joined to the others through ``rendezvous``; stopped when
    the driver says (the job's cancel, another rank's failure). Returns
    ``{'rank', 'code', 'last', 'why'}``."""
    from distributed import get_worker
    from distributed.comm.addressing import get_address_host

    folder = Path(folder)
    job = Job(folder.name, folder)
    spec = job.spec()
    user = job_user(spec)
    program = job_program(spec, folder, user)
    worker = get_worker()
    kept_in = containment.in_force()
    where = containment.jobs_folder()
    contain = contained(job.id, f'{attempt}-rank{rank}', spec, where,
                        containment.cluster_mark(), job_pids(),
                        kept_in.controllers if where else ())
    held = GpuPool.acquire(spec['gpus'], want=ids) if spec['gpus'] else []
    try:
        env = job_environment(submitted_env(folder), held, job_threads(
            os.sched_getaffinity(0), len(held),
            worker.state.total_resources), user)
        with Stop(name) as stop, user_tls(pems, user, folder) as tls, \
                _rank_log(folder, rank, user) as log:
            env.update(rank_environment(
                rank, size, rendezvous, name,
                f'tls://{get_address_host(worker.address)}', tls, timeout))
            log.write(f'=== rank {rank} of {size} on {worker.address}, GPUs '
                      f'{",".join(g.id for g in held) or "none"} ===\n'
                      .encode())
            log.flush()
            kept = keeper.start(program.argv, env, grace, stdout=log,
                                user=user, cwd=program.cwd,
                                stdin=program.stdin, contain=contain)
            stopped = False
            with kept_for(kept, job.id):
                try:
                    while kept.poll() is None:
                        if stop.is_set() and not stopped:
                            kept.stop(grace)
                            stopped = True
                        time.sleep(POLL)
                finally:
                    finish(contain)
            error = kept.start_error()
    finally:
        GpuPool.release(held)
    if error is not None:
        return {'rank': rank, 'code': keeper.CANNOT_START, 'last': None,
                'why': error}
    code = 0 if stopped else kept.returncode
    return {'rank': rank, 'code': code, 'why': None,
            'last': _last_line(folder, rank, user)}


def _last_line(folder, rank, user):
    return last_line(folder, user, name='output.log' if rank == 0
                     else f'rank{rank}.log')
