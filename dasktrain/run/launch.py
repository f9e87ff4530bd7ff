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
(no ``scheduler``, no GPUs) are started here instead, as ``mpiexec``
starts them (:func:`_run_here`): under their keepers, children of this
process, all at once, with no scheduler and no worker processes: rank 0
tells the others where each listens (``DASKTRAIN_RANK0``).

Output: rank 0's stdout and stderr come back live (Dask events, so from
any machine; pipes, for ranks started here) and also go to ``rank0.log``
in the output folder; every other rank's to ``rank{r}.log``, shown in
full when that rank fails.

Faults: the first rank to exit non-zero (or to lose its worker) ends the
job: the others are stopped (their keepers: SIGTERM to every process of
theirs, SIGKILL after ``grace`` seconds), one line says which rank failed
and why, and the exit status is that rank's. A rank that hangs makes its
peers fail within the collective timeout, which ends the job the same
way. Ctrl-C stops every rank before the local workers go.
"""
import codecs
import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

from dasktrain import keeper
from dasktrain.cluster.guard import signals_raise
from dasktrain.cluster.local import connect, restore_default_scheduler
from dasktrain.cluster.workers import local_device_workers
from dasktrain.errors import UserError, argument, plural
from dasktrain.parallel.comm.rendezvous import (
    LISTEN,
    SIZE,
    chainermn_environment,
    chainermn_folder,
    rank_environment,
)
from dasktrain.parallel.gpus import VISIBLE, GpuPool
from dasktrain.run.driver import (
    PATIENCE,
    POLL,
    SETTLE,
    Driver,
    Failure,
    Stop,
    blame,
)
from dasktrain.training.outdir import launch_folder

logger = logging.getLogger(__name__)

_BLAS = ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS')


class LaunchError(UserError):
    """A launch that cannot start as asked."""


def parse_devices(devices, n):
    """``None``/``'cpu'`` -> (); ``'0,1'`` -> (0, 1), one GPU per rank.

    >>> parse_devices('cpu', 2), parse_devices('1,0', 2)
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


def exit_words(code):
    """An exit code in words.

    >>> exit_words(3), exit_words(-9)
    ('exit 3', 'killed by SIGKILL')
    """
    if code is not None and code < 0:
        try:
            return f'killed by {signal.Signals(-code).name}'
        except ValueError:
            return f'killed by signal {-code}'
    return f'exit {code}'


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
    gpus = parse_devices(devices, n)
    if scheduler is None and client is None and \
            shutil.which(argv[0]) is None:
        raise LaunchError(f'cannot start {argv[0]}: no such program')
    out = Path(out).absolute() if out else launch_folder()
    out.mkdir(parents=True, exist_ok=True)
    echo = echo or (lambda stream, text: None)
    local = scheduler is None and client is None  # workers started here
    with contextlib.ExitStack() as stack:
        # A queue's cancel (SIGTERM) or a closed terminal (SIGHUP) stops
        # the ranks as Ctrl-C does, rather than orphaning them.
        stack.enter_context(signals_raise())
        # Not dasktrain.chainermn's import here: Chainer's, a second.
        extra = chainermn_environment(stack.enter_context(
            chainermn_folder(out)), os.environ) if chainermn else {}
        if local and not gpus:  # CPU ranks on this machine: started here
            return _run_here(argv, n, out, timeout, grace, echo, extra)
        if client is None:
            stack.enter_context(restore_default_scheduler(always=True))
            if scheduler is not None:
                client = stack.enter_context(connect(scheduler))
            else:
                client = stack.enter_context(local_device_workers(
                    tuple(f'@cupy:{g}' for g in gpus)))
        tls = stack.enter_context(_tls_files(client.security))
        return _run(client, argv, n, bool(gpus), out, timeout, grace, echo,
                    tls, local, extra)


@contextlib.contextmanager
def _tls_files(security):
    """(ca, cert, key) paths of ``security`` (written to a private folder
    when they are PEM text, removed on exit); None without TLS."""
    if security is None or not security.tls_ca_file:
        yield None
        return
    values = (security.tls_ca_file, security.tls_client_cert,
              security.tls_client_key)
    if not any(v.startswith('-----BEGIN') for v in values):
        yield values
        return
    folder = tempfile.mkdtemp(prefix='dasktrain-launch-')  # 0700
    try:
        paths = []
        for name, value in zip(('ca.pem', 'cert.pem', 'key.pem'), values):
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, 'w') as f:
                f.write(value)
            paths.append(path)
        yield tuple(paths)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run(client, argv, n, gpus, out, timeout, grace, echo, tls, local,
         extra):
    from distributed.comm.addressing import parse_address
    job = f'dasktrain-launch-{uuid.uuid4().hex[:8]}'
    scheme = parse_address(client.scheduler.address)[0]
    environ = dict(os.environ, PYTHONUNBUFFERED='1', **extra)
    if not gpus:  # one core per CPU rank, unless the user chose
        environ.update({k: environ.get(k, '1') for k in _BLAS})
    pids = {}

    def relay(message):
        if message.get('kind') == 'pid':
            pids[message['rank']] = message['pid']
        else:
            echo(message['stream'], message['text'])

    infos = client.scheduler_info(n_workers=-1)['workers']
    workers = sorted(infos)
    resources = _rank_resources(infos, n, gpus)
    placed = workers[:n] if local and len(workers) >= n else [None] * n
    names = [f'{what}{r}' for r in range(n) for what in ('started', 'gpu')]
    with Driver(client, job, relay, names) as driver:
        for rank in range(n):
            variable(client, job, rank).set(False)  # True once it started
            variable(client, job, rank, 'gpu').set(None)  # [host, GPU]

        driver.start(run_rank, [
            (argv, dict(environ, **rank_environment(
                rank, n, client.scheduler.address, job, scheme, tls,
                timeout)), os.getcwd(), str(out / f'rank{rank}.log'), rank,
             job, grace, gpus) for rank in range(n)], placed, [resources] * n)
        try:
            outcome = driver.watch(failed=lambda result: result['code'])
        finally:
            driver.stop(grace + 10)
            driver.relay_events()
            if local:  # whatever a lost task left: its process group here
                for pid in pids.values():
                    with contextlib.suppress(ProcessLookupError,
                                             PermissionError):
                        os.killpg(pid, signal.SIGKILL)
        if outcome.kind == 'done':
            return 0
        if outcome.kind == 'lost':  # a rank never restarts: its failure
            rank = placed.index(outcome.value[0])
            return _report({'rank': rank, 'code': 1, 'log': None,
                            'why': 'its worker died', 'last': None}, echo)
        failure = outcome.value
        result = failure.result or {
            'rank': failure.rank, 'code': 1, 'log': None, 'last': None,
            'why': f'lost its Dask task ({failure.why or _error(failure)})'}
        return _report(result, echo)


def _error(failure):
    return f'{type(failure.error).__name__}: {failure.error}'


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
    rank, code = failed['rank'], failed['code']
    why = failed.get('why') or exit_words(code)
    if rank != 0 and failed.get('log'):
        echo('stderr', f'--- rank {rank} ({failed["log"]}) ---\n')
        with contextlib.suppress(OSError):
            echo('stderr', Path(failed['log']).read_text(errors='replace'))
        echo('stderr', f'--- end of rank {rank} ---\n')
    last = failed.get('last')
    logger.error('rank %d failed (%s)%s; the other ranks were stopped',
                 rank, why, f': {last}' if last else '')
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


def run_rank(argv, env, cwd, log_path, rank, job, grace, gpus):
    """The task body of one rank: start the program under its keeper,
    relay rank 0's output, stop it when the launch says so; returns
    ``{'rank', 'code', 'ended', 'log', 'last', 'why'}``."""
    from distributed import get_worker
    from distributed.comm.addressing import get_address_host, parse_address
    worker = get_worker()
    started = variable(worker.client, job, rank)
    if started.get():
        # Dask reran the task after its worker died: a rank never restarts.
        return {'rank': rank, 'code': 1, 'ended': time.time(), 'log': None,
                'why': 'its worker died', 'last': None}
    started.set(True)
    scheme = parse_address(worker.address)[0]
    env = dict(env, **{LISTEN: f'{scheme}://'
                        f'{get_address_host(worker.address)}'})
    held = GpuPool.acquire(1) if gpus else []
    try:
        with Stop(job) as stop:
            env[VISIBLE] = _machine_gpus(worker, job, rank, int(env[SIZE]),
                                         held, stop) if gpus else ''
            with open(log_path, 'wb') as log:
                pipe = None if rank else subprocess.PIPE
                kept = keeper.start(argv, env, grace, stdout=pipe or log,
                                    stderr=pipe or log, cwd=cwd)
                worker.log_event(job, {'kind': 'pid', 'rank': rank,
                                       'pid': kept.pid})
                lock = threading.Lock()  # stdout and stderr share the log
                readers = [_reader(stream, log, lock, functools.partial(
                    _send, worker, job, name)) for stream, name in (
                        (kept.stdout, 'stdout'), (kept.stderr, 'stderr'))
                           if stream is not None]
                code, ended = _wait(kept, stop, grace)
                for reader in readers:
                    reader.join(5)
                error = kept.start_error()
    finally:
        GpuPool.release(held)
    if error is not None:
        return {'rank': rank, 'code': keeper.CANNOT_START, 'ended': ended,
                'log': log_path, 'last': None, 'why': error}
    return {'rank': rank, 'code': code, 'ended': ended, 'log': log_path,
            'last': _last_line(log_path), 'why': None}


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


def _reader(stream, log, lock, send):
    """A thread copying ``stream`` to ``log`` and its text to ``send``
    (chunks as they come: a progress bar's ``\\r`` stays)."""
    # A character split between two reads is decoded once it is whole.
    decoder = codecs.getincrementaldecoder('utf-8')(errors='replace')

    def run():
        fd = stream.fileno()
        while True:
            data = os.read(fd, 65536)
            text = decoder.decode(data, final=not data)
            with lock:
                log.write(data)
                log.flush()
            if text:
                send(text)
            if not data:
                break
    thread = threading.Thread(target=run, daemon=True,
                              name='dasktrain-output')
    thread.start()
    return thread


def _wait(kept, stop, grace):
    """The program's exit code and when it ended; its keeper stops it
    once ``stop`` is set (then it reads 0: not this rank's own failure)."""
    while kept.poll() is None:
        if stop.is_set():
            kept.stop(grace)
            return 0, time.time()
        time.sleep(0.1)
    return kept.returncode, time.time()


def _last_line(path):
    """The last non-empty line of a rank's log (its error, usually)."""
    try:
        with open(path, 'rb') as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            lines = f.read().decode(errors='replace').splitlines()
    except OSError:
        return None
    lines = [line.strip() for line in lines if line.strip()]
    return lines[-1][:300] if lines else None


# ------------------------------------------------- ranks started here
# A CPU launch on this machine starts its ranks as children of this
# process, as mpiexec does, all at once, meeting through rank 0 (no
# scheduler, no workers): nothing of Dask's to start, import, register
# and stop here, which were most of a short job's wall time
# (bench/startup.py, bench/chainermn.py). Keepers, output, faults and
# stopping as on workers.

def _run_here(argv, n, out, timeout, grace, echo, extra):
    """Run the ranks under keepers started here; the exit status. They
    meet without a scheduler: rank 0 listens on a port chosen here, the
    others dial it first and learn from it where each listens
    (``DASKTRAIN_RANK0``), so this process imports no Dask."""
    job = f'dasktrain-launch-{uuid.uuid4().hex[:8]}'
    environ = dict(os.environ, PYTHONUNBUFFERED='1', **extra)
    environ.update({k: environ.get(k, '1') for k in _BLAS})
    ended = threading.Event()  # set whenever a rank ends
    children = []
    with throwaway_tls() as tls:
        rank0 = f'tls://127.0.0.1:{free_port()}'
        try:
            for rank in range(n):
                env = dict(environ, **rank_environment(
                    rank, n, None, job, 'tls://127.0.0.1', tls, timeout,
                    rank0=rank0))
                children.append(_Child(argv, env, rank, out, echo, ended,
                                       grace))
            return _watch_here(children, ended, grace, echo)
        finally:
            for child in children:
                child.stop(grace)


@contextlib.contextmanager
def throwaway_tls(host='127.0.0.1'):
    """(ca, cert, key) of a CA and certificate made for one job of ranks
    alone (``host``), in a private folder removed on exit."""
    from dasktrain.cluster.tls import ensure_certificates
    folder = tempfile.mkdtemp(prefix='dasktrain-launch-')  # 0700
    try:
        files = ensure_certificates(folder, host)
        yield files['tls_ca_file'], files['tls_cert'], files['tls_key']
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def free_port(host='127.0.0.1'):
    """A port of ``host`` free now, for the scheduler the ranks are
    told of before it starts."""
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _watch_here(children, ended, grace, echo):
    """Wait for the ranks; as :meth:`~dasktrain.run.driver.Driver.watch`
    does, the first to fail that is not a peer's echo ends the job (once
    the others have had ``SETTLE`` seconds to show theirs; an echo waits
    ``PATIENCE`` seconds for its cause), named in one line."""
    first = None
    while True:
        ended.wait(POLL)
        ended.clear()
        outcomes = [c.outcome() for c in children]
        failures = [Failure(o['rank'], None, o, o['ended'])
                    for o in outcomes if o is not None and o['code'] != 0]
        done = all(o is not None for o in outcomes)
        if done and not failures:
            for child in children:
                child.join_output()
            return 0
        if not failures:
            continue
        now = time.monotonic()
        first = first or now
        roots = [f for f in failures if not f.echo()]
        if done or now - first > PATIENCE or \
                (roots and now - first >= SETTLE):
            for child in children:
                child.stop(grace)
            return _report(blame(failures).result, echo)


class _Child:
    """One rank started here, under its keeper (dying with this process;
    rank 0's output relayed live, every rank's kept in its log)."""

    def __init__(self, argv, env, rank, out, echo, ended, grace):
        self.rank, self.log = rank, str(out / f'rank{rank}.log')
        self.time = self.why = None
        self._readers = []
        with open(self.log, 'wb') as log:
            pipe = subprocess.PIPE if rank == 0 else log
            self.kept = keeper.start(argv, env, grace, stdout=pipe,
                                     stderr=pipe, cwd=os.getcwd())
        if rank == 0:
            log = open(self.log, 'ab')
            lock = threading.Lock()  # stdout and stderr share the log
            self._readers = [
                _reader(stream, log, lock, functools.partial(echo, name))
                for stream, name in ((self.kept.stdout, 'stdout'),
                                     (self.kept.stderr, 'stderr'))]
        else:
            log = None

        def wait():
            self.kept.wait()
            self.join_output()
            if log is not None:
                log.close()
            self.why = self.kept.start_error()
            self.time = time.time()
            ended.set()
        threading.Thread(target=wait, daemon=True,
                         name=f'dasktrain-rank{rank}').start()

    def outcome(self):
        """The rank's result as a worker's rank task gives it, or None
        while it runs."""
        if self.time is None:
            return None
        if self.why is not None:
            return {'rank': self.rank, 'code': keeper.CANNOT_START,
                    'ended': self.time, 'log': self.log, 'why': self.why,
                    'last': None}
        return {'rank': self.rank, 'code': self.kept.returncode,
                'ended': self.time, 'log': self.log, 'why': None,
                'last': _last_line(self.log)}

    def join_output(self):
        for reader in self._readers:
            reader.join(5)

    def stop(self, grace):
        """Its keeper stops every process of the rank: SIGTERM, SIGKILL
        after ``grace`` s."""
        if self.kept.poll() is None:
            self.kept.stop(grace)
        self.join_output()
