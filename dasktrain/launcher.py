"""``dasktrain launch``: start N copies of a program as the ranks of one
job, as ``mpiexec -n N`` does, with Dask placing and watching them.

:func:`launch` gets a cluster (throwaway local workers, one GPU each,
when GPUs are asked for, started and stopped here; or a running cluster,
``scheduler``), starts one long Dask task per rank, and each task starts
the program as a child process in a session of its own, with the
environment of
:mod:`dasktrain.parallel.comm.rendezvous` (rank, size, rendezvous, TLS
files): ``dasktrain.chainermn.create_communicator()`` in the program
joins the other ranks from it, peer to peer. CPU ranks on this machine
(no ``scheduler``, no GPUs) are started here instead, as ``mpiexec``
starts them: children of this process, all at once, with a scheduler in
this process for their rendezvous and no worker processes.

Output: rank 0's stdout and stderr come back live (Dask events, so from
any machine; pipes, for ranks started here) and also go to ``rank0.log``
in the output folder; every other rank's to ``rank{r}.log``, shown in
full when that rank fails.

Faults: the first rank to exit non-zero (or to lose its worker) ends the
job: the others are stopped (SIGTERM to their process groups, SIGKILL
after ``grace`` seconds), one line says which rank failed and why, and
the exit status is that rank's. A rank that hangs makes its peers fail
within the collective timeout, which ends the job the same way. Ctrl-C
stops every rank before the local workers go.

Owns starting, watching and stopping a launched job's ranks; may not
touch what the program does (that is the program's, and
:mod:`dasktrain.chainermn`'s).
"""
import codecs
import contextlib
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

from dasktrain.cluster.guard import signals_raise
from dasktrain.cluster.local import connect, restore_default_scheduler
from dasktrain.cluster.workers import local_device_workers
from dasktrain.errors import UserError, argument
from dasktrain.parallel.comm.rendezvous import rank_environment
from dasktrain.ranks import run_rank, variable
from dasktrain.spawn import die_with_parent

logger = logging.getLogger(__name__)

POLL = 0.1  # s between looks at the ranks
SETTLE = 1.0  # s to wait for more failures: the first to fail is named
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
                          f'{len(set(ids))} distinct GPU(s) for {n} ranks: '
                          'one GPU per rank')
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
           grace=5.0, echo=None, client=None):
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
        The output folder (``rank{r}.log``); default
        ``launch-YYYYmmdd-HHMMSS``.
    timeout : float
        Seconds a collective waits for a peer (``DASKTRAIN_TIMEOUT``).
    grace : float
        Seconds between SIGTERM and SIGKILL when ranks are stopped.
    echo : callable, optional
        ``echo(stream, text)`` with ``stream`` ``'stdout'`` or ``'stderr'``:
        rank 0's output, and a failed rank's; default: dropped.
    client : distributed.Client, optional
        Run on this cluster instead.

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
    out = Path(out or time.strftime('launch-%Y%m%d-%H%M%S')).absolute()
    out.mkdir(parents=True, exist_ok=True)
    echo = echo or (lambda stream, text: None)
    local = scheduler is None and client is None  # workers started here
    with contextlib.ExitStack() as stack:
        # A queue's cancel (SIGTERM) or a closed terminal (SIGHUP) stops
        # the ranks as Ctrl-C does, rather than orphaning them.
        stack.enter_context(signals_raise())
        if client is None:
            stack.enter_context(restore_default_scheduler(always=True))
            if scheduler is not None:
                client = stack.enter_context(connect(scheduler))
            elif gpus:
                client = stack.enter_context(local_device_workers(
                    tuple(f'@cupy:{g}' for g in gpus)))
            else:  # CPU ranks on this machine: started here
                return _run_here(argv, n, out, timeout, grace, echo)
        tls = stack.enter_context(_tls_files(client.security))
        return _run(client, argv, n, bool(gpus), out, timeout, grace, echo,
                    tls, local)


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


def _run(client, argv, n, gpus, out, timeout, grace, echo, tls, local):
    from distributed import Event
    from distributed.comm.addressing import parse_address
    job = f'dasktrain-launch-{uuid.uuid4().hex[:8]}'
    scheme = parse_address(client.scheduler.address)[0]
    environ = dict(os.environ, PYTHONUNBUFFERED='1')
    if not gpus:  # one core per CPU rank, unless the user chose
        environ.update({k: environ.get(k, '1') for k in _BLAS})
    pids = {}

    def relay(event):
        _, message = event
        if message.get('kind') == 'pid':
            pids[message['rank']] = message['pid']
        else:
            echo(message['stream'], message['text'])

    client.subscribe_topic(job, relay)
    stop = Event(f'{job}-stop', client=client)
    infos = client.scheduler_info(n_workers=-1)['workers']
    workers = sorted(infos)
    resources = _rank_resources(infos, n, gpus)
    futures = []
    for rank in range(n):
        variable(client, job, rank).set(False)  # True once it started
        variable(client, job, rank, 'gpu').set(None)  # [host, GPU]
        env = dict(environ, **rank_environment(
            rank, n, client.scheduler.address, job, scheme, tls, timeout))
        placed = dict(workers=[workers[rank]], allow_other_workers=False) \
            if local and len(workers) >= n else {}
        futures.append(client.submit(
            run_rank, argv, env, os.getcwd(), str(out / f'rank{rank}.log'),
            rank, job, grace, gpus, key=f'{job}-rank{rank}', pure=False,
            retries=0, resources=resources, **placed))
    try:
        while not _ended(futures) and _first_failure(futures) is None:
            time.sleep(POLL)
        failed = _first_failure(futures)
        if failed is not None:
            time.sleep(SETTLE)  # a peer's failure follows the root one
            failed = _first_failure(futures)
            stop.set()
            _ended(futures, grace + 10)
            return _report(failed, futures, echo)
        return 0
    finally:
        stop.set()
        _ended(futures, grace + 10)
        client.unsubscribe_topic(job)
        if local:  # whatever a lost task left: its process group here
            for pid in pids.values():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        client.cancel(futures, force=True)
        for rank in range(n):
            with contextlib.suppress(Exception):
                variable(client, job, rank).delete()
                variable(client, job, rank, 'gpu').delete()


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


def _ended(futures, within=0.0):
    """Whether every rank's task has ended, waiting up to ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        if all(f.status != 'pending' for f in futures):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL)


def _outcome(future):
    """A finished rank's result dict, or one for a lost task; None while
    it runs."""
    if future.status == 'finished':
        return future.result()
    if future.status in ('error', 'cancelled', 'lost'):
        error = future.exception() if future.status == 'error' else None
        why = f'{type(error).__name__}: {error}' if error else \
            f'its task was {future.status}'
        return {'rank': int(future.key.rsplit('rank', 1)[1]), 'code': 1,
                'why': f'lost its Dask task ({why})', 'ended': time.time(),
                'log': None}
    return None


def _first_failure(futures):
    """The failed rank to blame: the first to end, though not one that
    failed only because a peer was gone (a rank whose error is a lost
    peer can end before the peer's own exit is seen)."""
    failures = [o for o in map(_outcome, futures)
                if o is not None and (o['code'] != 0 or o.get('why'))]
    if not failures:
        return None
    return min(failures, key=lambda o: (_echoes_a_peer(o), o['ended']))


def _echoes_a_peer(outcome):
    last = outcome.get('last') or ''
    return any(error in last for error in (
        'PeerLost', 'CollectiveError', 'CommClosedError', 'StreamClosed'))


def _report(failed, futures, echo):
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


# ------------------------------------------------- ranks started here
# A CPU launch on this machine starts its ranks as children of this
# process, as mpiexec does, all at once, with a scheduler in this process
# (no workers) for their rendezvous: no worker processes to start, import
# Dask in, register and stop, which were most of a short job's wall time
# (bench/startup.py). Output, faults and stopping as on workers.

def _run_here(argv, n, out, timeout, grace, echo):
    """Run the ranks as this process's children; the exit status. They
    start first, the scheduler (Dask's import, most of this process's
    start-up) while they import theirs: their rendezvous waits for it."""
    job = f'dasktrain-launch-{uuid.uuid4().hex[:8]}'
    environ = dict(os.environ, PYTHONUNBUFFERED='1')
    environ.update({k: environ.get(k, '1') for k in _BLAS})
    ended = threading.Event()  # set whenever a rank ends
    children = []
    with _throwaway_tls() as tls:
        port = _free_port()
        address = f'tls://127.0.0.1:{port}'
        try:
            for rank in range(n):
                env = dict(environ, **rank_environment(
                    rank, n, address, job, 'tls://127.0.0.1', tls, timeout))
                children.append(_Child(argv, env, rank, out, echo, ended))
            with _scheduler_here(port, tls):
                return _watch_here(children, ended, grace, echo)
        finally:
            for child in children:
                child.stop(grace)


@contextlib.contextmanager
def _throwaway_tls():
    """(ca, cert, key) of a CA and certificate made for this launch alone
    (127.0.0.1), in a private folder removed on exit."""
    from dasktrain.cluster.tls import ensure_certificates
    folder = tempfile.mkdtemp(prefix='dasktrain-launch-')  # 0700
    try:
        files = ensure_certificates(folder)
        yield files['tls_ca_file'], files['tls_cert'], files['tls_key']
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _free_port():
    """A port of 127.0.0.1 free now, for the scheduler the ranks are
    told of before it starts."""
    import socket
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _scheduler_here(port, tls):
    """A scheduler in this process on 127.0.0.1:``port`` (TLS, no
    dashboard, no workers), for the ranks' rendezvous."""
    from distributed import LocalCluster
    from distributed.security import Security
    ca, cert, key = tls
    security = Security(tls_ca_file=ca, tls_client_cert=cert,
                        tls_client_key=key, tls_scheduler_cert=cert,
                        tls_scheduler_key=key, require_encryption=True)
    try:
        cluster = LocalCluster(
            n_workers=0, processes=False, host='127.0.0.1', protocol='tls',
            scheduler_port=port, security=security,
            dashboard_address='127.0.0.1:0',
            scheduler_kwargs={'dashboard': False})
    except OSError as e:
        raise LaunchError(f'the ranks\' rendezvous cannot listen on '
                          f'127.0.0.1:{port} ({e}); launch again') from None
    with cluster:
        yield


def _watch_here(children, ended, grace, echo):
    """Wait for the ranks; as :func:`_run` does, the first to fail ends
    the job, named in one line."""
    while True:
        ended.wait(1.0)
        ended.clear()
        outcomes = [c.outcome() for c in children]
        failed = [o for o in outcomes if o is not None and o['code'] != 0]
        if failed:
            time.sleep(SETTLE)  # a peer's failure follows the root one
            failed = [o for o in (c.outcome() for c in children)
                      if o is not None and o['code'] != 0]
            for child in children:
                child.stop(grace)
            return _report(min(failed, key=lambda o: (
                _echoes_a_peer(o), o['ended'])), None, echo)
        if all(o is not None for o in outcomes):
            for child in children:
                child.join_output()
            return 0


class _Child:
    """One rank started here: its process (a session of its own, killed
    with this process), rank 0's output relayed live, every rank's kept in
    its log."""

    def __init__(self, argv, env, rank, out, echo, ended):
        self.rank, self.log = rank, str(out / f'rank{rank}.log')
        self.code = self.why = None
        self.time = None
        self._readers = []
        with open(self.log, 'wb') as log:
            pipe = subprocess.PIPE if rank == 0 else log
            try:
                self.proc = subprocess.Popen(
                    argv, env=env, stdin=subprocess.DEVNULL, stdout=pipe,
                    stderr=pipe, start_new_session=True,
                    preexec_fn=die_with_parent)
            except OSError as e:
                self.proc, self.code, self.time = None, 127, time.time()
                self.why = f'cannot start {argv[0]}: {e.strerror}'
                ended.set()
                return
        if rank == 0:
            lock = threading.Lock()  # stdout and stderr share the log
            self._readers = [
                _relay(stream, name, self.log, lock, echo)
                for stream, name in ((self.proc.stdout, 'stdout'),
                                     (self.proc.stderr, 'stderr'))]

        def wait():
            self.proc.wait()
            self.time = time.time()
            ended.set()
        threading.Thread(target=wait, daemon=True,
                         name=f'dasktrain-rank{rank}').start()

    def outcome(self):
        """The rank's result as a worker's rank task gives it, or None
        while it runs."""
        if self.time is None:
            return None
        code = self.code if self.proc is None else self.proc.returncode
        return {'rank': self.rank, 'code': code, 'ended': self.time,
                'log': self.log, 'why': self.why,
                'last': _last_line(self.log)}

    def join_output(self):
        for reader in self._readers:
            reader.join(5)

    def stop(self, grace):
        """Its process group: SIGTERM, SIGKILL after ``grace`` s."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.join_output()


def _relay(stream, name, log_path, lock, echo):
    """A thread copying ``stream`` to the rank's log and to ``echo``, in
    chunks as they come (a progress bar's ``\\r`` stays)."""
    decoder = codecs.getincrementaldecoder('utf-8')(errors='replace')

    def run():
        fd = stream.fileno()
        with open(log_path, 'ab') as log:
            while True:
                data = os.read(fd, 65536)
                text = decoder.decode(data, final=not data)
                with lock:
                    log.write(data)
                    log.flush()
                if text:
                    echo(name, text)
                if not data:
                    break
    thread = threading.Thread(target=run, daemon=True,
                              name=f'dasktrain-{name}')
    thread.start()
    return thread


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
