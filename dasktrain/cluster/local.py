"""A dask.distributed cluster on this machine: start, status, stop.

``start_cluster`` runs the standard ``dask scheduler`` and one ``dask
worker`` (``workers=N``: N of them, the machine's GPUs shared out among
them, each its own: a job across N workers runs on one machine) as
background processes. A worker owns its GPUs and advertises them as the
resource ``GPU=n`` (on a machine without GPUs, ``CPU`` slots), so jobs that
ask for K GPUs wait until a worker has K free. The
addresses are recorded in ``$DASKTRAIN_HOME/cluster.json`` (default
``~/.dasktrain``) for later commands. Another machine joins with the
standard ``dask worker ADDRESS --resources GPU=n`` and the TLS files.

Dask runs pickled code sent by any client: whoever reaches the scheduler can
run code as the user who started it, and on a shared server every user
reaches 127.0.0.1. So the cluster requires TLS with certificates of its own
private CA (:mod:`dasktrain.cluster.tls`, files only the owner can read) at
both
ends of every connection, and every dasktrain client uses them;
``insecure=True`` drops that, loudly. Every listener (scheduler, worker,
nanny, both dashboards) binds the host given, 127.0.0.1 by default.

Owns the recorded cluster and the clients to it; throwaway workers for
one run are :mod:`dasktrain.cluster.workers`'. May not touch training.
"""
import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import time
from pathlib import Path

from dasktrain.cluster import malloc
from dasktrain.cluster import tls as _tls
from dasktrain.cluster.processes import (
    GRACE,
    kill,
    running,
    spawn,
    wait_for,
)
from dasktrain.cluster.settings import (
    MAX_GRACE,
    environment,
    max_grace,
    rules,
    settings,
)
from dasktrain.cluster.start_lock import starting
from dasktrain.containment import (
    CLUSTER_ENV,
    CONTAIN_ENV,
    Containment,
    cluster_tag,
    end_all,
    prepare,
)
from dasktrain.errors import UserError, argument
from dasktrain.files import write_json
from dasktrain.parallel.cuda_check import unusable_gpus_here
from dasktrain.parallel.gpus import VISIBLE, split_gpus, visible_gpus
from dasktrain.spawn import python

logger = logging.getLogger(__name__)

HOME_ENV = 'DASKTRAIN_HOME'
# What the scheduler and the worker preload: the queue, and the GPU
# readings of the worker's heartbeats.
SCHEDULER_PRELOAD = 'dasktrain.jobs.scheduler.preload'
WORKER_PRELOAD = 'dasktrain.jobs.worker.preload'


class ClusterError(UserError):
    pass


def home():
    """dasktrain's state folder: ``$DASKTRAIN_HOME`` or ``~/.dasktrain``."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / '.dasktrain')


def state_path(folder=None):
    """The record of the cluster in ``folder`` (default :func:`home`)."""
    return Path(folder or home()) / 'cluster.json'


def tls_dir(folder=None):
    """Where the cluster's CA and certificates live: ``home() / 'tls'``."""
    return Path(folder or home()) / 'tls'


def read_state(folder=None):
    """The recorded cluster (of ``folder``, default :func:`home`), or
    None."""
    try:
        return json.loads(state_path(folder).read_text())
    except (OSError, ValueError):
        return None


def _write_state(state, folder):
    path = state_path(folder)
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
        raise ClusterError(f'TLS needs all of {argument("tls_ca_file")}, '
                           f'{argument("tls_cert")} and {argument("tls_key")}')
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
                               f'{argument("scheduler")} ADDRESS')
        address = state['scheduler']
    if security is None:
        security = default_security(address, state)
    try:
        with restore_default_scheduler():
            return Client(address, timeout=timeout, security=security)
    except (OSError, TimeoutError, ValueError) as e:
        raise ClusterError(f'cannot reach the scheduler at {address} '
                           f'({type(e).__name__}: {e}); is the cluster '
                           'running (`dasktrain cluster status`)?') from None


def default_security(address, state=None):
    """The TLS files a dasktrain client uses for ``address`` unasked: the
    recorded cluster's, else those in :func:`tls_dir` (where a machine that
    joined keeps its copies); None for a ``tcp://`` address."""
    if not str(address).startswith('tls://'):
        return None
    state = state or read_state()
    files = (state or {}).get('tls') or _tls.files(tls_dir())
    if not files:
        raise ClusterError(f'{address} needs TLS certificates and none are '
                           f'recorded or in {tls_dir()}; copy ca.pem, '
                           'node.pem and node-key.pem there from the '
                           "cluster's machine")
    return security_from(**files)


def worker_info(client):
    """``{address: info}`` of the scheduler's workers, asked now.

    Not ``client.scheduler_info()['workers']``: the client's periodic
    refresh, which asks for no workers, can overwrite that cache between
    the fetch and the read, and a cluster then seems to have none."""
    return client.sync(client.scheduler.identity, n_workers=-1)['workers']


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
    """The warning for a cluster on ``host`` without TLS, or None."""
    if tls:
        return None
    if _is_loopback(host):
        return (f'warning: {argument("insecure")}: no TLS; every user of this '
                'machine can connect to the cluster and run any code as you')
    return (f'warning: {argument("insecure")}: binding to {host} without TLS; '
            'anyone who can reach this port can run any code as you')


def _with_port(host, port):
    return f'[{host}]:{port}' if ':' in host else f'{host}:{port}'


def start_cluster(host='127.0.0.1', port=8786, dashboard_port=8787,
                  gpus=None, cpu_slots=1, tls_ca_file=None, tls_cert=None,
                  tls_key=None, insecure=False, timeout=60,
                  dashboard_host=None, notify=None, busy_mib=None,
                  folder=None, env=None, umask=-1, cgroup=None, limits=None,
                  shared=False, workers=1):
    """Start a scheduler and ``workers`` workers in the background;
    record them.

    Parameters
    ----------
    host : str, default '127.0.0.1'
        Interface every listener binds.
    port, dashboard_port : int, default 8786, 8787
        0 picks free ports.
    gpus : int, optional
        GPUs the workers advertise in all; default: the machine's count.
    cpu_slots : int, default 1
        CPU jobs (``--gpus 0``) each worker runs at once, beside its GPU
        jobs (advertised as ``CPU``).
    workers : int, default 1
        Dask workers on this machine. Several share out its GPUs in
        order (:func:`~dasktrain.parallel.gpus.split_gpus`: each its own,
        as its ``CUDA_VISIBLE_DEVICES``), so a job across ``workers``
        ranks (``submit -- --workers N``) runs here.
    tls_ca_file, tls_cert, tls_key : str, optional
        PEM files of your own; default: the cluster's own CA and node
        certificate in :func:`tls_dir`, made on first use.
    insecure : bool, default False
        No TLS (``tcp://``): anyone who reaches the port runs code as you.
    timeout : float, default 60
        Seconds to wait for the processes to come up.
    dashboard_host : str, optional
        Interface of the dashboard (with the jobs page, ``/metrics`` and
        Dask's ``/info/logs``, served to whoever reaches it, without
        TLS); default ``host``. E.g. ``'127.0.0.1'`` while the scheduler
        listens on the network: reach it through an SSH tunnel.
    notify, busy_mib : optional
        See :mod:`dasktrain.cluster.settings`.
    limits : dict, optional
        The other settings of :func:`~dasktrain.cluster.settings.settings`
        (``max_grace``, ``pids_per_job``, ``notify_allow``, a shared
        cluster's limits per user); ``shared``: its defaults for those not
        given.
    cgroup : str, optional
        The cgroup v2 folder its jobs' cgroups go under (default: one
        beside this process's own cgroup; see
        :mod:`dasktrain.containment`).
    folder : Path, optional
        Its state, certificates and logs (default :func:`home`; a shared
        cluster's own, see :mod:`~dasktrain.cluster.shared`).
    env : dict, optional
        Variables added to its processes' environment.
    umask : int, default -1 (this process's)
        Its processes' umask.

    Returns
    -------
    dict
        What was recorded: scheduler and dashboard addresses, pids and
        their start times, resources, TLS files, settings.
    """
    # checked before anything starts
    extra = settings(notify, busy_mib, shared=shared, **(limits or {}))
    if type(workers) is not int or workers < 1:
        raise ClusterError(f'{argument("workers")} must be >= 1, got '
                           f'{workers!r}')
    folder = Path(folder or home())
    with starting(folder):
        return _start(host, port, dashboard_port, gpus, cpu_slots, tls_ca_file,
                      tls_cert, tls_key, insecure, timeout, dashboard_host,
                      extra, folder, env or {}, umask, cgroup, workers)


def own_cgroup(tag):
    """The name of the cgroup a cluster (tagged ``tag``) makes for its
    jobs, beside ``cluster start``'s own, where no ``--cgroup`` is
    given; ``cluster stop`` removes it."""
    return f'dasktrain-{tag}'


def _contain(folder, cgroup):
    """The containment of the cluster in ``folder`` (:mod:`dasktrain.
    containment`), with what a cluster there before left ended first."""
    tag = cluster_tag(folder.resolve())
    found = prepare(cgroup, name=own_cgroup(tag))
    left = end_all(found, f'{tag}/')
    if left:
        logger.warning('ended %d process(es) or cgroup(s) the jobs of a '
                       'cluster before left', left)
    return tag, found


def _start(host, port, dashboard_port, gpus, cpu_slots, tls_ca_file,
           tls_cert, tls_key, insecure, timeout, dashboard_host, extra,
           folder, more_env, umask, cgroup, workers):
    given = any((tls_ca_file, tls_cert, tls_key))
    if insecure and given:
        raise ClusterError(f'{argument("insecure")} and the TLS files '
                           'contradict each other; pass one or the other')
    state = read_state(folder)
    if state is not None and running(state):
        raise ClusterError(f"a cluster is already running at "
                           f"{state['scheduler']}; stop it with `dasktrain "
                           "cluster stop` first")
    if insecure:
        tls = None
    elif given:
        security_from(tls_ca_file, tls_cert, tls_key)  # all three or none
        tls = {'tls_ca_file': tls_ca_file, 'tls_cert': tls_cert,
               'tls_key': tls_key}
    else:
        tls = _tls.ensure_certificates(tls_dir(folder), host)
    warning = exposure_warning(host, tls is not None)
    if warning:
        logger.warning(warning)
    if gpus is None:
        gpus = detect_gpus()
        unusable = None if gpus else unusable_gpus_here()
        if unusable:  # said once, here; the worker's heartbeats carry it
            logger.warning(
                'warning: %s; until then the worker offers none of them, '
                'only CPU slots (--gpus N offers them anyway, to programs '
                'that need no CuPy)', unusable)
    # Each worker its own GPUs (one worker: as the machine shows them).
    shares = split_gpus(visible_gpus(os.environ, count=gpus), workers) \
        if workers > 1 else [None]
    # CPU slots on every machine: a GPU server runs CPU jobs (--gpus 0) too.
    owned = [gpus if share is None else len(share) for share in shares]
    resources = [f'GPU={n} CPU={cpu_slots}' if n else f'CPU={cpu_slots}'
                 for n in owned]
    logs = folder / 'logs'
    logs.mkdir(parents=True, exist_ok=True)
    scheduler_file = folder / 'scheduler.json'
    scheduler_file.unlink(missing_ok=True)
    tag, contain = _contain(folder, cgroup)
    tls_args, env = [], dict(environment(os.environ, extra), **more_env)
    env.update({CONTAIN_ENV: contain.env(), CLUSTER_ENV: tag})
    malloc.users_environ(env)  # not a value Dask left in os.environ
    if tls:
        tls_args = ['--tls-ca-file', tls['tls_ca_file'], '--tls-cert',
                    tls['tls_cert'], '--tls-key', tls['tls_key']]
        # Nothing in these processes may fall back to plain TCP.
        env['DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION'] = '1'
    processes = [spawn(python('dask',
        # dasktrain's metrics and jobs page on the dashboard's server
        'scheduler', '--preload', SCHEDULER_PRELOAD, '--host', host,
        '--port', str(port),
        '--dashboard-address', _with_port(dashboard_host or host,
                                          dashboard_port),
        '--scheduler-file', str(scheduler_file),
        *(['--protocol', 'tls'] if tls else []), *tls_args),
        logs / 'scheduler.log', env, umask)]
    try:
        info = wait_for(lambda: json.loads(scheduler_file.read_text()),
                        timeout, 'the scheduler', processes, logs,
                        ClusterError)
        address = info['address']
        for n, (share, count, offer) in enumerate(zip(shares, owned,
                                                      resources)):
            own_env = env if share is None else \
                dict(env, **{VISIBLE: ','.join(share)}) if share else env
            processes.append(spawn(python(
                'dask', 'worker', address, '--preload', WORKER_PRELOAD,
                '--nworkers', '1',
                # glibc's allocator settings, not Dask's (cluster/malloc.py)
                '--preload-nanny', 'dasktrain.cluster.malloc',
                # One thread more than slots: a scale-out job's driver
                # holds a thread (and no GPU) while its ranks hold the
                # slots.
                '--nthreads', str(count + max(cpu_slots, 1) + 1),
                '--resources', offer, '--host', host,
                # Its HTTP server (/health, /metrics) would bind every
                # interface otherwise.
                '--dashboard-address', _with_port(host, 0),
                '--local-directory', str(folder / 'worker-space'),
                *tls_args),
                logs / ('worker.log' if n == 0 else f'worker-{n}.log'),
                own_env, umask,
                # its jobs' keepers stop them within their grace first
                grace=max_grace(env) + GRACE))
        client = connect(address, security_from(**tls) if tls else None)
        with client:
            wait_for(lambda: len(worker_info(client)) >= workers or None,
                     timeout, 'the workers' if workers > 1 else 'the worker',
                     processes, logs, ClusterError)
            dashboard = client.dashboard_link
    except BaseException:
        for process in processes:
            kill(process.pid, process.created)
        raise
    state = {'scheduler': address, 'dashboard': dashboard,
             'pids': [p.pid for p in processes],
             'created': [p.created for p in processes],
             'resources': resources[0] if len(set(resources)) == 1 else
             ', '.join(resources), 'workers': workers,
             'host': host, 'tls': tls,
             'started': time.time(), 'tag': tag,
             'contain': dataclasses.asdict(contain), **extra}
    _write_state(state, folder)
    return state


def cluster_status(address=None):
    """Scheduler address, dashboard and workers with their resources;
    for the recorded cluster, how its jobs are kept and its rules."""
    with connect(address) as client:
        workers = {addr: {'name': w.get('name'),
                          'resources': w.get('resources', {}),
                          'threads': w.get('nthreads')}
                   for addr, w in worker_info(client).items()}
        found = {'scheduler': client.scheduler.address,
                 'dashboard': client.dashboard_link, 'workers': workers}
    state = read_state()
    if state and state.get('scheduler') == found['scheduler'] and \
            state.get('contain'):
        found['contain'] = Containment(**state['contain']).words()
        found['rules'] = rules(environment({}, state))
    return found


def stop_cluster(folder=None):
    """Shut down the recorded cluster (of ``folder``, default
    :func:`home`) and forget it.

    Only processes that are still the ones recorded (same pid, same start
    time) are signalled. Returns the recorded state with ``stale`` True
    when none of them was running any more (the record is removed all
    the same).
    """
    state = read_state(folder)
    if state is None:
        raise ClusterError('no cluster is recorded; nothing to stop')
    alive = running(state)
    grace = float(state.get('max_grace') or MAX_GRACE)
    if alive:
        try:
            security = security_from(**state['tls']) if state.get('tls') \
                else None
            with restore_default_scheduler(always=True), \
                    connect(state['scheduler'], security, timeout=5) as client:
                client.shutdown()
        except ClusterError:
            pass  # not answering; the signals below end it
        for pid, created in alive:
            kill(pid, created, grace + GRACE + 5)
    # Whatever a job left, wherever it went: its cgroup, its marker.
    contain = state.get('contain')
    if state.get('tag'):
        end_all(Containment(**contain) if contain else None,
                f"{state['tag']}/", own=own_cgroup(state['tag']))
    state_path(folder).unlink(missing_ok=True)
    return dict(state, stale=not alive)
