"""A dask.distributed cluster on this machine: start, status, stop.

``start_cluster`` runs the standard ``dask scheduler`` and one ``dask
worker`` as background processes. The worker owns the machine's GPUs and
advertises them as the resource ``GPU=n`` (on a machine without GPUs, ``CPU``
slots), so jobs that ask for K GPUs wait until a worker has K free. The
addresses are recorded in ``$DASKTRAIN_HOME/cluster.json`` (default
``~/.dasktrain``) for later commands. Another machine joins with the
standard ``dask worker ADDRESS --resources GPU=n``.

Dask runs pickled code sent by any client: whoever reaches the scheduler can
run code as the user who started it. It binds to 127.0.0.1 unless told
otherwise; bind elsewhere only with TLS, on a network you trust.
"""
import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dasktrain.errors import UserError
from dasktrain.files import write_json

HOME_ENV = 'DASKTRAIN_HOME'
MONITOR = 'dasktrain.monitor'  # preloaded by the scheduler and the worker


class ClusterError(UserError):
    pass


def home():
    """dasktrain's state folder: ``$DASKTRAIN_HOME`` or ``~/.dasktrain``."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / '.dasktrain')


def state_path():
    return home() / 'cluster.json'


def read_state():
    """The recorded cluster, or None."""
    try:
        return json.loads(state_path().read_text())
    except (OSError, ValueError):
        return None


def _write_state(state):
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, state, indent=2)


def detect_gpus():
    """How many CUDA GPUs this machine has (0 without CuPy or a driver)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no cupy, no driver, no device: all mean none
        return 0


def security_from(tls_ca_file=None, tls_cert=None, tls_key=None):
    """A ``distributed.Security`` for TLS files, or None when none given."""
    given = [tls_ca_file, tls_cert, tls_key]
    if not any(given):
        return None
    if not all(given):
        raise ClusterError('TLS needs all of --tls-ca-file, --tls-cert and '
                           '--tls-key')
    from distributed.security import Security
    return Security(tls_ca_file=tls_ca_file, tls_client_cert=tls_cert,
                    tls_client_key=tls_key, require_encryption=True)


def connect(address=None, security=None, timeout=10):
    """A Client for ``address`` (default: the recorded cluster)."""
    from distributed import Client
    state = read_state()
    if address is None:
        if state is None:
            raise ClusterError('no cluster is recorded; start one with '
                               '`dasktrain cluster start` or pass '
                               '--scheduler ADDRESS')
        address = state['scheduler']
    if security is None and state and state.get('tls') and \
            address == state['scheduler']:
        security = security_from(**state['tls'])
    try:
        with restore_default_scheduler():
            return Client(address, timeout=timeout, security=security)
    except (OSError, TimeoutError, ValueError) as e:
        raise ClusterError(f'cannot reach the scheduler at {address} '
                           f'({type(e).__name__}: {e}); is the cluster '
                           'running (`dasktrain cluster status`)?') from None


@contextlib.contextmanager
def restore_default_scheduler(always=False):
    """Put dask's default scheduler back as it was after an error (or
    always): a Client makes itself the default when created, and one that
    fails to connect, or is shut down, does not undo it."""
    import dask
    had = 'scheduler' in dask.config.config
    before = dask.config.config.get('scheduler')
    failed = True
    try:
        yield
        failed = False
    finally:
        if failed or always:
            if had:
                dask.config.config['scheduler'] = before
            else:
                dask.config.config.pop('scheduler', None)


def _is_loopback(host):
    if host in ('localhost', ''):
        return host == 'localhost'
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host, tls):
    """The warning for binding ``host`` without TLS, or None."""
    if _is_loopback(host) or tls:
        return None
    return (f'warning: binding to {host} without TLS: anyone who can reach '
            'this port can run any code as you. Use --tls-* files or keep '
            'the default 127.0.0.1')


def start_cluster(host='127.0.0.1', port=8786, dashboard_port=8787,
                  gpus=None, cpu_slots=1, tls_ca_file=None, tls_cert=None,
                  tls_key=None, timeout=60):
    """Start a scheduler and a worker in the background; record them.

    Parameters
    ----------
    host : str, default '127.0.0.1'
        Interface to bind. Anything but loopback without TLS warns.
    port, dashboard_port : int, default 8786, 8787
        0 picks free ports.
    gpus : int, optional
        GPUs the worker advertises; default: the machine's count.
    cpu_slots : int, default 1
        CPU jobs (``--gpus 0``) the worker runs at once, beside its GPU
        jobs (advertised as ``CPU``).
    tls_ca_file, tls_cert, tls_key : str, optional
        PEM files; with them every connection uses TLS (``tls://``).
    timeout : float, default 60
        Seconds to wait for the processes to come up.

    Returns
    -------
    dict
        What was recorded: scheduler and dashboard addresses, pids,
        resources.
    """
    state = read_state()
    if state is not None and _alive(state):
        raise ClusterError(f"a cluster is already running at "
                           f"{state['scheduler']}; stop it with `dasktrain "
                           "cluster stop` first")
    tls = {'tls_ca_file': tls_ca_file, 'tls_cert': tls_cert,
           'tls_key': tls_key} if any((tls_ca_file, tls_cert, tls_key)) \
        else None
    security = security_from(**tls) if tls else None
    warning = exposure_warning(host, tls is not None)
    if warning:
        print(warning, file=sys.stderr)
    gpus = detect_gpus() if gpus is None else gpus
    # CPU slots on every machine: a GPU server runs CPU jobs (--gpus 0) too.
    resources = f'GPU={gpus} CPU={cpu_slots}' if gpus else f'CPU={cpu_slots}'
    folder = home()
    (folder / 'logs').mkdir(parents=True, exist_ok=True)
    scheduler_file = folder / 'scheduler.json'
    scheduler_file.unlink(missing_ok=True)
    tls_args = []
    if tls:
        tls_args = ['--tls-ca-file', tls_ca_file, '--tls-cert', tls_cert,
                    '--tls-key', tls_key]
    dask = [sys.executable, '-m', 'dask']
    processes = [_spawn(dask + [
        # dasktrain's metrics and jobs page on the dashboard's server
        'scheduler', '--preload', MONITOR, '--host', host,
        '--port', str(port),
        '--dashboard-address', f'{host}:{dashboard_port}',
        '--scheduler-file', str(scheduler_file),
        *(['--protocol', 'tls'] if tls else []), *tls_args],
        folder / 'logs' / 'scheduler.log')]
    try:
        info = _wait_for(lambda: json.loads(scheduler_file.read_text()),
                         timeout, 'the scheduler', processes)
        address = info['address']
        processes.append(_spawn(dask + [
            'worker', address, '--preload', MONITOR, '--nworkers', '1',
            # One thread more than slots: a scale-out job's driver holds
            # a thread (and no GPU) while its ranks hold the slots.
            '--nthreads', str(gpus + max(cpu_slots, 1) + 1),
            '--resources', resources, '--host', host,
            '--local-directory', str(folder / 'worker-space'),
            *tls_args], folder / 'logs' / 'worker.log'))
        client = connect(address, security)
        with client:
            _wait_for(lambda: client.scheduler_info()['workers'] or None,
                      timeout, 'the worker', processes)
            dashboard = client.dashboard_link
    except BaseException:
        for process in processes:
            _kill(process.pid)
        raise
    state = {'scheduler': address, 'dashboard': dashboard,
             'pids': [p.pid for p in processes], 'resources': resources,
             'host': host, 'tls': tls, 'started': time.time()}
    _write_state(state)
    return state


def _spawn(argv, log_path):
    log = open(log_path, 'ab')
    # A session of its own: the cluster outlives the command that started
    # it, and a Ctrl-C there does not reach it.
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _wait_for(probe, timeout, what, processes):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise ClusterError(f'{what} exited at start (code '
                                   f'{process.returncode}); see the logs in '
                                   f"{home() / 'logs'}")
        try:
            value = probe()
            if value:
                return value
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise ClusterError(f'{what} did not come up within {timeout:.0f} s; '
                       f"see the logs in {home() / 'logs'}")


def _alive(state):
    return any(_pid_alive(pid) for pid in state.get('pids', ()))


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill(pid, grace=5.0):
    """SIGTERM a process group, SIGKILL it if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not _pid_alive(pid):
                return
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.1)


def cluster_status(address=None):
    """Scheduler address, dashboard and workers with their resources."""
    with connect(address) as client:
        info = client.scheduler_info()
        workers = {addr: {'name': w.get('name'),
                          'resources': w.get('resources', {}),
                          'threads': w.get('nthreads')}
                   for addr, w in info['workers'].items()}
        return {'scheduler': client.scheduler.address,
                'dashboard': client.dashboard_link, 'workers': workers}


def stop_cluster():
    """Shut down the recorded cluster and forget it."""
    state = read_state()
    if state is None:
        raise ClusterError('no cluster is recorded; nothing to stop')
    try:
        with restore_default_scheduler(always=True), \
                connect(state['scheduler'], timeout=5) as client:
            client.shutdown()
    except ClusterError:
        pass  # already gone; make sure of the processes below
    for pid in state.get('pids', ()):
        _kill(pid)
    state_path().unlink(missing_ok=True)
    return state
