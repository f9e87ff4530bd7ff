"""A training job across workers on a shared cluster (a gang): its ranks
are its training program, one per worker the queue placed them on, each
started as the job's submitter under its keeper, as every job is.

The ranks never reach the cluster's Dask (only root does): they join as
the ranks of ``dasktrain launch`` do
(:mod:`dasktrain.parallel.comm.rendezvous`), through a scheduler of their
own, started for the attempt as the submitter (never root: whoever holds
its key may run code in it) on the gang's first worker, with a CA and
certificate made for it alone (each copy written 0600 for the
submitter, removed when its rank ends), listening on a port of the
kernel's choosing on that worker's address alone (its web server:
``/health`` only), and then talk to each other peer to peer. Rank 0
writes the job's ``out/`` and ``output.log``; rank r > 0 its
``rank{r}.log``.

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
import dataclasses
import os
import time
from pathlib import Path

from dasktrain import containment, keeper
from dasktrain.cluster.local import worker_info
from dasktrain.cluster.settings import clear_nccl, job_pids
from dasktrain.cluster.tls import private_copies, throwaway
from dasktrain.cluster.workers import health_only_env
from dasktrain.files import loads_bounded, read_regular
from dasktrain.jobs.ending import PRUNED, STOPPED
from dasktrain.jobs.job import Job
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
from dasktrain.parallel.comm.rendezvous import rank_environment
from dasktrain.parallel.gpus import CLEAR_NCCL, GpuPool
from dasktrain.parallel.placement import rank_resources
from dasktrain.run.driver import (
    Driver,
    Failure,
    RankResult,
    RunResult,
    RunState,
    Stop,
    go_on,
)

POLL = 0.2  # s between two looks at a rank's program
RENDEZVOUS_TIMEOUT = 120.0  # s the ranks' scheduler may take to listen
ENDS = (0, STOPPED, PRUNED)  # how a rank's program ends well


def run_gang(job, spec, placed, grace, attempt, say=None):
    """Run the gang ``job`` (its record is ``spec``) on ``placed`` (``[(worker
    address, [GPU ids])]``, one per rank) until it ends; its
    :class:`~dasktrain.jobs.ending.JobEnd`: rank 0's end where every rank
    ended, else the failed rank's (named), or its cancel's. A rank's
    worker that dies: with its config's ``on_worker_loss`` 'continue' (the
    default) the ranks left go on from the last checkpoint, on the
    workers and GPUs the queue gave them (:func:`~dasktrain.run.driver.
    go_on`); with 'wait', the job ends, to be requeued. ``say(line)``:
    how it goes, for the job's output."""
    say = say or (lambda line: None)

    def round_(left, n):
        return _round(job, spec, left, grace, f'{attempt}-{n}')

    def replan(left, result):
        left = [p for p in left if p[0] not in result.lost]
        if spec.on_worker_loss != 'continue' or not left:
            return None
        say(f'worker(s) {", ".join(result.lost)} lost: going on from the '
            f'last checkpoint with {len(left)} rank(s) (on_worker_loss '
            'continue)')
        return left
    result, _ = go_on(round_, list(placed), replan)
    return _end(job, spec, result, grace)


def _end(job, spec, result, grace):
    """The gang's end from its last round's
    :class:`~dasktrain.run.driver.RunResult`."""
    if result.state is RunState.STOPPED:
        return spec.end(None, f'every rank stopped (grace {grace:g} s)',
                        job.cancel_reason())
    first = result.results[0] if result.results else None
    if result.state is RunState.SUCCEEDED or (
            result.state is RunState.FAILED and
            result.failure.lost_peer() and first is not None and
            first.code in ENDS):
        # Rank 0 ended the run (done, pruned, stopped): the others at
        # most lost it as a peer.
        return spec.end(first.code)
    if result.state is RunState.LOST:
        rank = list(result.workers).index(result.lost[0])
        return spec.end(-9, failure=(
            f'rank {rank}: its worker ({result.lost[0]}) died; `dasktrain '
            f'requeue {job.id}` resumes the job from its last checkpoint'))
    failure = result.failure
    if failure.rank is None:  # no rank started: the job's own why
        return spec.end(1, failure=failure.why)
    failed = failure.result
    how = (failed and (failed.why or failed.last)) or failure.why or \
        f'{type(failure.error).__name__}: {failure.error}'
    return spec.end((failed.code if failed else 1) or 1,
                    failure=f'rank {failure.rank}: {how}')


def _round(job, spec, placed, grace, attempt):
    """One start of the gang's ranks on ``placed`` (``attempt``: the
    job's attempt and this start's, ``'A-R'``); its
    :class:`~dasktrain.run.driver.RunResult`, each rank's result as its
    ranks were once stopped."""
    from distributed import get_worker, worker_client
    from distributed.comm.addressing import get_address_host
    worker = get_worker()
    host = get_address_host(worker.address)
    name = f'dasktrain-gang-{job.id}-{attempt}'
    user = job_user(spec)
    with throwaway(host) as tls, worker_client() as client:
        pems = [Path(p).read_text() for p in tls]
        with private_copies(pems, job.folder, user) as theirs, \
                _rendezvous(job, spec, host, theirs, user, attempt,
                            grace) as rendezvous:
            if isinstance(rendezvous, Failure):  # it never listened
                return RunResult(RunState.FAILED, failure=rendezvous)
            infos = worker_info(client)
            # NCCL between machines only where the cluster allows it:
            # decided here, once, for every rank.
            clear = clear_nccl(shared=user is not None)
            with Driver(client, name, lambda event: None) as driver:
                driver.start(gang_rank, [
                    (str(job.folder), rank, len(placed), list(ids),
                     rendezvous, name, pems, grace, spec.collective_timeout,
                     attempt, clear)
                    for rank, (_, ids) in enumerate(placed)],
                    [w for w, _ in placed],
                    [rank_resources(spec.gpus, infos.get(w, {}))
                     for w, _ in placed])
                announcer = EpochAnnouncer(job)

                def cancelled():  # at every look: the epochs told too
                    announcer.tell()
                    return (job.folder / 'cancel').exists()
                result = driver.watch(
                    failed=lambda result: result.code not in ENDS,
                    interrupt=cancelled)
                driver.stop(grace + 10)
                return dataclasses.replace(result, results=driver.results())


@contextlib.contextmanager
def _rendezvous(job, spec, host, tls, user, attempt, grace):
    """The ranks' scheduler on ``host`` (TLS with the attempt's ``tls``
    files) until the block ends: ``dask scheduler`` as the job's
    submitter under its keeper, never root (whoever holds its key may
    run code in it: only as themselves), its output in the job's
    ``rendezvous.log``. Yields its address once it listens, on a port
    the kernel chose as it bound it (:func:`_listening`: no port is
    chosen before, which another user could bind first), or the
    :class:`~dasktrain.run.driver.Failure` that says why it did not.
    Its web server answers ``/health`` alone, on ``host``
    (:data:`~dasktrain.cluster.workers.HEALTH_ONLY`)."""
    from distributed.comm.addressing import unparse_host_port

    from dasktrain.spawn import python
    env = job_environment(submitted_env(job.folder), [], 1, user)
    env['DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION'] = '1'
    env.update(health_only_env())
    ca, cert, key = tls
    # In the attempt's folder of TLS copies: the submitter's, 0700.
    told = os.path.join(os.path.dirname(ca), 'scheduler.json')
    argv = python('distributed.cli.dask_scheduler', '--host', host,
                  '--port', '0', '--protocol', 'tls', '--tls-ca-file', ca,
                  '--tls-cert', cert, '--tls-key', key, '--no-dashboard',
                  '--dashboard-address', unparse_host_port(host, 0),
                  '--scheduler-file', told)
    where = containment.jobs_folder()
    contain = contained(job.id, f'{attempt}-rendezvous', spec, where,
                        containment.cluster_mark(), job_pids(),
                        containment.in_force().controllers if where else ())
    with _job_log(job.folder, 'rendezvous.log', user) as log:
        kept = keeper.start(argv, env, grace, stdout=log, user=user,
                            cwd=str(job.folder), contain=contain)
    try:
        try:
            found = _listening(kept, told, host, user)
        except RendezvousError as e:
            found = Failure(None, None, None, time.time(), why=str(e))
        yield found
    finally:
        if kept.poll() is None:
            kept.stop(grace)
        finish(contain)


class RendezvousError(Exception):
    """The ranks' scheduler did not listen: why, in words."""


def _listening(kept, told, host, user, timeout=RENDEZVOUS_TIMEOUT):
    """The address the ranks' scheduler (``kept``) listens on, from the
    scheduler file it writes once it does (``told``, in the submitter's
    folder: read only as a small regular file of theirs, never through a
    symlink), checked to be on ``host``; RendezvousError where it ended
    first, or said nothing within ``timeout`` seconds."""
    from distributed.comm.addressing import get_address_host, parse_address
    owner = user.uid if user is not None else os.getuid()
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = loads_bounded(read_regular(told, owner, limit=65536),
                                 limit=65536, name='its scheduler file')
            address = info['address']
            if parse_address(address)[0] == 'tls' and \
                    get_address_host(address) == host:
                return address
            raise RendezvousError(f'its rendezvous said it listens on '
                                  f'{address!r}, not on {host}')
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not written yet, or half
        if kept.poll() is not None:
            raise RendezvousError('its rendezvous ended before it listened '
                                  '(see rendezvous.log)')
        if time.monotonic() > deadline:
            raise RendezvousError(f'its rendezvous did not listen within '
                                  f'{timeout:g} s (see rendezvous.log)')
        time.sleep(POLL)


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
              timeout, attempt, clear=False):
    """The task of rank ``rank`` of ``size``: the job's training program
    as its submitter, holding the GPUs ``ids`` of this worker (none: a
    CPU slot), joined to the others through ``rendezvous``; stopped when
    the driver says (the job's cancel, another rank's failure); ``clear``:
    whether it may sum over NCCL with ranks on other machines (its
    driver's word, the same for every rank). A
    :class:`~dasktrain.run.driver.RankResult`."""
    from distributed import get_worker
    from distributed.comm.addressing import get_address_host

    folder = Path(folder)
    job = Job(folder.name, folder)
    spec = job.spec()
    user = job_user(spec)
    program = spec.program(folder, user)
    worker = get_worker()
    kept_in = containment.in_force()
    where = containment.jobs_folder()
    contain = contained(job.id, f'{attempt}-rank{rank}', spec, where,
                        containment.cluster_mark(), job_pids(),
                        kept_in.controllers if where else ())
    held = GpuPool.acquire(spec.gpus, want=ids) if spec.gpus else []
    try:
        env = job_environment(submitted_env(folder), held, job_threads(
            os.sched_getaffinity(0), len(held),
            worker.state.total_resources), user)
        with Stop(name) as stop, private_copies(pems, folder, user) as tls, \
                _rank_log(folder, rank, user) as log:
            env.update(rank_environment(
                rank, size, rendezvous, name,
                f'tls://{get_address_host(worker.address)}', tls, timeout))
            env[CLEAR_NCCL] = '1' if clear else '0'

            log.write(f'=== rank {rank} of {size} on {worker.address}, GPUs '
                      f'{",".join(g.id for g in held) or "none"} ===\n'
                      .encode())
            log.flush()
            kept = keeper.start(program.argv, env, grace, stdout=log,
                                user=user, cwd=program.cwd,
                                stdin=program.stdin, contain=contain)
            with kept_for(kept, job.id):
                try:
                    ended = kept.watch(stop.is_set, grace, poll=POLL)
                finally:
                    finish(contain)
    finally:
        GpuPool.release(held)
    return RankResult.of(rank, ended, last=last_line(
        folder, user, name='output.log' if rank == 0 else f'rank{rank}.log'))
