"""``dasktrain launch``: start N copies of a program as the ranks of one
job, as ``mpiexec -n N`` does, with Dask placing and watching them.

:func:`launch` gets a cluster (throwaway single-threaded local workers,
one per rank, one GPU each when GPUs are asked for, started and stopped
here; or a running cluster, ``scheduler``) and drives one long Dask task
per rank (:class:`~dasktrain.run.driver.Driver`, the driver ``train``'s
ranks have too). Each task (:func:`run_rank`) starts the program under
its keeper (:mod:`dasktrain.keeper`), with the environment of
:mod:`dasktrain.parallel.comm.rendezvous` (rank, size, rendezvous, TLS
files): ``dasktrain.chainermn.create_communicator()`` in the program
joins the other ranks from it, peer to peer. CPU ranks on this machine
(no ``scheduler``, no GPUs) are the same driver's children instead
(:meth:`~dasktrain.run.driver.Driver.start_here`), started as ``mpiexec``
starts them: under their keepers, all at once, with no scheduler and no
worker processes: rank 0 tells the others where each listens
(``DASKTRAIN_RANK0``).

Output: rank 0's stdout and stderr come back live (Dask events, so from
any machine; pipes, for ranks started here) and also go to ``rank0.log``
in the output folder (one only you can change:
:func:`~dasktrain.training.outdir.check_own`; logs never written through
a symlink); every other rank's to ``rank{r}.log``, shown in
full when that rank fails.

Faults: the first rank to exit non-zero (or to lose its worker) ends the
job: the others are stopped (their keepers: SIGTERM to every process of
theirs, SIGKILL after ``grace`` seconds), one line says which rank failed
and why, and the exit status is that rank's. A rank that hangs makes its
peers fail within the collective timeout, which ends the job the same
way. Ctrl-C stops every rank before the local workers go.
"""
import contextlib
import functools
import logging
import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path

from dasktrain.cluster.start_lock import signals_raise
from dasktrain.cluster.tls import private_copies, throwaway
from dasktrain.errors import UserError, argument, plural
from dasktrain.files import open_for_writing
from dasktrain.keeper import exit_words
from dasktrain.parallel.comm.rendezvous import (
    LISTEN,
    SIZE,
    chainermn_environment,
    chainermn_folder,
    rank_environment,
)
from dasktrain.parallel.comm.transports import unix_fits
from dasktrain.parallel.gpus import VISIBLE, GpuPool
from dasktrain.run.driver import (
    Driver,
    RankResult,
    RunState,
    Stop,
    last_line,
    start_program,
)
from dasktrain.training.outdir import check_own, launch_folder

logger = logging.getLogger(__name__)

_BLAS = ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS')


class LaunchError(UserError):
    """A launch that cannot start as asked."""


def rank_gpus(devices, n):
    """The GPU of each of ``n`` ranks, from ``--devices``: ``None``/``'cpu'``
    -> (); ``'0,1'`` -> (0, 1), one GPU per rank.

    >>> rank_gpus('cpu', 2), rank_gpus('1,0', 2)
    ((), (1, 0))
    """
    if devices in (None, '', 'cpu'):
        return ()
    try:
        ids = tuple(int(d) for d in str(devices).split(','))
    except ValueError:
        raise LaunchError(f'{argument("devices")} takes cpu or GPU ids '
                          f'like 0,1; got {devices!r}') from None
    if len(ids) != n or len(set(ids)) != n or min(ids) < 0:
        raise LaunchError(f'{argument("devices")} {devices} names '
                          f'{plural(len(set(ids)), "distinct GPU")} for '
                          f'{n} ranks: one GPU per rank')
    return ids


def launch(argv, n, devices=None, scheduler=None, out=None, timeout=300.0,
           grace=5.0, echo=None, client=None, chainermn=True):
    """Run ``argv`` as ``n`` ranks until they end; the exit status.

    Parameters
    ----------
    argv : list of str
        The program and its arguments, started in this working directory
        with this environment plus the rank's variables.
    n : int
        Ranks.
    devices : str, optional
        ``'cpu'`` (default) or GPU ids ``'0,1'``, one per rank.
    scheduler : str, optional
        A running cluster's scheduler; default: local workers, started and
        stopped here.
    out : str, optional
        The output folder (``rank{r}.log``); default a new
        ``runs/launch-YYYYmmdd-HHMMSS``
        (:func:`~dasktrain.training.outdir.launch_folder`).
    timeout : float
        Seconds a collective waits for a peer (``DASKTRAIN_TIMEOUT``).
    grace : float
        Seconds between SIGTERM and SIGKILL when ranks are stopped.
    echo : callable, optional
        ``echo(stream, text)`` with ``stream`` ``'stdout'`` or ``'stderr'``:
        rank 0's output, and a failed rank's; default: dropped.
    client : distributed.Client, optional
        Run on this cluster instead.
    chainermn : bool
        The ranks' ``import chainermn`` gets :mod:`dasktrain.chainermn`
        (:mod:`dasktrain.chainermn.substitution`); False: the installed
        ChainerMN's.

    Returns
    -------
    int
        0, or the first failing rank's exit status (128 + signal number
        for a rank killed by a signal, as a shell says it).

    Examples
    --------
    >>> launch(['python', 'train.py'], 2)  # doctest: +SKIP
    0
    """
    if not argv:
        raise LaunchError('nothing to launch: give the program after --, '
                          'e.g. dasktrain launch -n 2 -- python train.py')
    if not isinstance(n, int) or n < 1:
        raise LaunchError(f'{argument("n")} must be >= 1, got {n!r}')
    gpus = rank_gpus(devices, n)
    if scheduler is None and client is None and \
            shutil.which(argv[0]) is None:
        raise LaunchError(f'cannot start {argv[0]}: no such program')
    out = Path(out).absolute() if out else launch_folder()
    out.mkdir(parents=True, exist_ok=True)
    check_own(out)  # the ranks' logs: no stranger's folder
    echo = echo or (lambda stream, text: None)
    local = scheduler is None and client is None  # workers started here
    with contextlib.ExitStack() as stack:
        # A queue's cancel (SIGTERM) or a closed terminal (SIGHUP) stops
        # the ranks as Ctrl-C does, rather than orphaning them.
        stack.enter_context(signals_raise())
        if local and not gpus:  # CPU ranks on this machine: started here
            # Not dasktrain.chainermn's import here: Chainer's, a second.
            extra = chainermn_environment(stack.enter_context(
                chainermn_folder()), os.environ) if chainermn else {}
            return _run_here(argv, n, out, timeout, grace, echo, extra)
        # Dask's modules only here: CPU ranks on this machine never
        # import them (a launch's start is mostly imports).
        from dasktrain.cluster.local import connect, restore_default_scheduler
        from dasktrain.cluster.workers import local_device_workers
        if client is None:
            stack.enter_context(restore_default_scheduler(always=True))
            if scheduler is not None:
                client = stack.enter_context(connect(scheduler))
            else:
                client = stack.enter_context(local_device_workers(
                    tuple(f'@cupy:{g}' for g in gpus)))
        tls = stack.enter_context(_tls_files(client.security))
        return _run(client, argv, n, bool(gpus), out, timeout, grace, echo,
                    tls, local, chainermn)


@contextlib.contextmanager
def _tls_files(security):
    """(ca, cert, key) paths of ``security`` (private copies where they
    are PEM text, removed on exit); None without TLS."""
    if security is None or not security.tls_ca_file:
        yield None
        return
    values = (security.tls_ca_file, security.tls_client_cert,
              security.tls_client_key)
    if not any(v.startswith('-----BEGIN') for v in values):
        yield values
        return
    with private_copies(values) as paths:
        yield paths


def _relay(echo, pids):
    """What the driver does with the ranks' events: a rank's output to
    ``echo``, its keeper's pid into ``pids``."""
    def relay(message):
        if message.get('kind') == 'pid':
            pids[message['rank']] = message['pid']
        else:
            echo(message['stream'], message['text'])
    return relay


def _run(client, argv, n, gpus, out, timeout, grace, echo, tls, local,
         chainermn):
    from distributed.comm.addressing import parse_address
    job = f'dasktrain-launch-{uuid.uuid4().hex[:8]}'
    scheme = parse_address(client.scheduler.address)[0]
    environ = dict(os.environ, PYTHONUNBUFFERED='1')
    if not gpus:  # one core per CPU rank, unless the user chose
        environ.update({k: environ.get(k, '1') for k in _BLAS})
    pids = {}
    infos = client.scheduler_info(n_workers=-1)['workers']
    workers = sorted(infos)
    resources = _rank_resources(infos, n, gpus)
    placed = workers[:n] if local and len(workers) >= n else [None] * n
    names = [f'{what}{r}' for r in range(n) for what in ('started', 'gpu')]
    with Driver(client, job, _relay(echo, pids), names) as driver:
        for rank in range(n):
            variable(client, job, rank).set(False)  # True once it started
            variable(client, job, rank, 'gpu').set(None)  # [host, GPU]

        driver.start(run_rank, [
            (argv, dict(environ, **rank_environment(
                rank, n, client.scheduler.address, job, scheme, tls,
                timeout)), os.getcwd(), str(out / f'rank{rank}.log'), rank,
             job, grace, gpus, chainermn) for rank in range(n)], placed,
            [resources] * n)
        try:
            result = driver.watch()
        finally:
            driver.stop(grace + 10)
            driver.relay_events()
            if local:  # whatever a lost task left: its process group here
                for pid in pids.values():
                    with contextlib.suppress(ProcessLookupError,
                                             PermissionError):
                        os.killpg(pid, signal.SIGKILL)
    return _exit_status(result, echo)


def _exit_status(result, echo):
    """The launch's exit status from its ranks' :class:`~dasktrain.run.
    driver.RunResult`: 0, else the failed rank's, said in one line."""
    if result.state is RunState.SUCCEEDED:
        return 0
    if result.state is RunState.LOST:  # a rank never restarts: its failure
        rank = list(result.workers).index(result.lost[0])
        return _report(RankResult(rank, 1, why='its worker died'), echo)
    failure = result.failure
    error = failure.why or \
        f'{type(failure.error).__name__}: {failure.error}'
    return _report(failure.result or RankResult(
        failure.rank, 1, why=f'lost its Dask task ({error})'), echo)


def _rank_resources(infos, n, gpus):
    """What each rank's task holds on the cluster: a GPU, a CPU slot where
    the workers offer them (a recorded cluster), else a thread. Every rank
    must run at once: LaunchError where the cluster cannot."""
    kind = 'GPU' if gpus else 'CPU' if any(
        'CPU' in i.get('resources', {}) for i in infos.values()) else None
    if kind is None:
        have = sum(i.get('nthreads', 1) for i in infos.values())
        what = 'worker threads'
    else:
        have = int(sum(i.get('resources', {}).get(kind, 0)
                       for i in infos.values()))
        what = f'{kind}s' if kind == 'GPU' else 'CPU slots'
    if have < n:
        raise LaunchError(
            f'{n} ranks must run at once and the cluster has {have} '
            f'{what}; add workers, or start the cluster with more '
            f'({"--gpus" if kind == "GPU" else "--cpu-slots"})')
    return None if kind is None else {kind: 1}


def _report(failed, echo):
    """Say which rank failed and why (a rank r > 0's whole log to
    ``echo``); the exit status that says it (128 + N for signal N, as a
    shell says it)."""
    rank, code = failed.rank, failed.code
    why = failed.why or exit_words(code)
    if rank != 0 and failed.log:
        echo('stderr', f'--- rank {rank} ({failed.log}) ---\n')
        with contextlib.suppress(OSError):
            echo('stderr', Path(failed.log).read_text(errors='replace'))
        echo('stderr', f'--- end of rank {rank} ---\n')
    logger.error('rank %d failed (%s)%s; the other ranks were stopped',
                 rank, why, f': {failed.last}' if failed.last else '')
    if code is None or code == 0:
        return 1
    return 128 - code if code < 0 else code


# ------------------------------------------------------------ a rank

def variable(client, job, rank, what='started'):
    """The Dask Variable ``{job}/{what}{rank}``: a rank's ``started`` flag
    (a rerun task must not start the program again) or its ``gpu``
    ``[host, GPU]``."""
    from distributed import Variable
    return Variable(f'{job}/{what}{rank}', client=client)


def run_rank(argv, env, cwd, log_path, rank, job, grace, gpus,
             chainermn=False):
    """The task body of one rank: start the program under its keeper
    (with ``chainermn``, its ``import chainermn`` dasktrain's: a shim
    folder of its own on this machine), relay rank 0's output, stop it
    when the launch says so; a :class:`~dasktrain.run.driver.RankResult`.
    """
    from distributed import get_worker
    from distributed.comm.addressing import get_address_host, parse_address
    worker = get_worker()
    started = variable(worker.client, job, rank)
    if started.get():
        # Dask reran the task after its worker died: a rank never restarts.
        return RankResult(rank, 1, why='its worker died', ended=time.time())
    started.set(True)
    scheme = parse_address(worker.address)[0]
    env = dict(env, **{LISTEN: f'{scheme}://'
                        f'{get_address_host(worker.address)}'})
    held = GpuPool.acquire(1) if gpus else []
    try:
        with Stop(job) as stop, (chainermn_folder() if chainermn else
                                 contextlib.nullcontext()) as shim:
            if shim is not None:
                env.update(chainermn_environment(shim, env))
            env[VISIBLE] = _machine_gpus(worker, job, rank, int(env[SIZE]),
                                         held, stop) if gpus else ''
            with open_for_writing(log_path) as log:
                kept, readers = start_program(
                    argv, env, grace, log, None if rank else
                    functools.partial(_send, worker, job), cwd=cwd)
                worker.log_event(job, {'kind': 'pid', 'rank': rank,
                                       'pid': kept.pid})
                ended = kept.watch(stop.is_set, grace)
                for reader in readers:
                    reader.join(5)
    finally:
        GpuPool.release(held)
    return RankResult.of(rank, ended, log_path, last_line(log_path))


def _machine_gpus(worker, job, rank, size, held, stop):
    """``CUDA_VISIBLE_DEVICES`` of a GPU rank: the GPUs the job's ranks
    on this machine hold, in rank order, as ``mpiexec`` leaves them; so
    device ``comm.intra_rank`` is this rank's own."""
    from distributed.comm.addressing import get_address_host
    host = get_address_host(worker.address)
    variable(worker.client, job, rank, 'gpu').set([host, held[0].id])
    while True:
        got = [variable(worker.client, job, r, 'gpu').get()
               for r in range(size)]
        if all(got) or stop.is_set():
            return ','.join(g for h, g in filter(None, got) if h == host)
        time.sleep(0.2)


def _send(worker, job, name, text):
    """``text`` of the rank's stream ``name``, an event to the launch."""
    worker.log_event(job, {'kind': 'output', 'stream': name, 'text': text})


# ------------------------------------------------- ranks started here
# A CPU launch on this machine starts its ranks as children of this
# process, as mpiexec does, all at once, meeting through rank 0 (no
# scheduler, no workers): nothing of Dask's to start, import, register
# and stop here, which were most of a short job's wall time
# (bench/startup.py, bench/chainermn.py). Keepers, output, faults and
# stopping as on workers.

def _run_here(argv, n, out, timeout, grace, echo, extra):
    """Run the ranks as the driver's children; the exit status. They
    meet without a scheduler, in a private folder made here (0700):
    rank 0 listens on a Unix socket there and writes its path to a file
    there (``DASKTRAIN_RANK0``); the others read it, dial rank 0 first
    and learn from it where each listens. No rank imports Dask or TLS
    to meet, this process starts no Dask, and no other user of the
    machine can enter the folder. Where a long ``TMPDIR`` leaves no room
    for a socket's path, they listen on 127.0.0.1 with TLS instead, on
    ports the kernel chose (none named before it is bound)."""
    job = f'dasktrain-launch-{uuid.uuid4().hex[:8]}'
    environ = dict(os.environ, PYTHONUNBUFFERED='1', **extra)
    environ.update({k: environ.get(k, '1') for k in _BLAS})
    with contextlib.ExitStack() as stack:
        meet = stack.enter_context(tempfile.TemporaryDirectory(  # 0700
            prefix='dasktrain-meet-', ignore_cleanup_errors=True))
        if unix_fits(meet):
            listen, tls = f'unix://{meet}', None
        else:
            listen, tls = 'tls://127.0.0.1', stack.enter_context(throwaway())
        driver = stack.enter_context(Driver(None, job, _relay(echo, {})))
        rank0 = os.path.join(meet, 'rank0')
        try:
            driver.start_here(argv, [dict(environ, **rank_environment(
                rank, n, None, job, listen, tls, timeout,
                rank0=rank0)) for rank in range(n)],
                [str(out / f'rank{rank}.log') for rank in range(n)], grace)
        except OSError as e:  # a log it may not write (a planted symlink)
            raise LaunchError(f'cannot write {e.filename} ({e.strerror}); '
                              'launch again') from None
        try:
            result = driver.watch()
        finally:
            driver.stop(grace)
            driver.relay_events()
    return _exit_status(result, echo)
