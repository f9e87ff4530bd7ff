"""Throwaway Dask workers on this machine, for one run: ``local_workers``
(N CPU worker processes) and ``local_device_workers`` (one worker process
per device, each seeing only its GPU).

Unlike the recorded cluster of :mod:`dasktrain.cluster.local`, these live
as long as a ``with`` block: every listener on 127.0.0.1, TLS with
throwaway certificates (other users of the machine cannot run code in the
workers), gone on exit. Owns the workers' processes and environment; may
not touch training (what runs on them is the caller's).
"""
import contextlib
import os

from dasktrain.cluster import malloc
from dasktrain.cluster.local import restore_default_scheduler
from dasktrain.parallel.gpus import gpu_ids, visible_gpus
from dasktrain.spawn import check_main_guard

_BLAS_THREADS = ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS')
# Dask's statistical profiler samples every thread's stack each 10 ms and
# folds them each second: 2-3 % of a CPU rank's time (py-spy, 2 ranks on 2
# cores), for a profile no one reads in a cluster that lives for one run.
# A Nanny hands the config it was made under to its worker process.
# And glibc's own allocator settings, not Dask's (cluster/malloc.py). And
# fewer wake-ups of the processes' event loops, which take CPU from the
# ranks on a machine whose every core computes: Dask's health tick every
# 20 ms, the nanny's memory look every 100 ms, the system monitor's 500 ms.
_QUIET = {'distributed.worker.profile.enabled': False, **malloc.CONFIG,
          'distributed.admin.tick.interval': '500ms',
          'distributed.worker.memory.monitor-interval': '1s',
          'distributed.admin.system-monitor.interval': '2s'}
#: The Dask web routes of a run's throwaway processes and of a job of
#: ranks' rendezvous: ``/health`` alone. Dask's others (its info pages:
#: workers' logs, where a failed task's ``repr`` shows its arguments, a
#: rank's environment among them; its JSON, proxy and metrics routes)
#: would be every local user's, with no login in front.
HEALTH_ONLY = {
    'distributed.scheduler.http.routes': ['distributed.http.health'],
    'distributed.worker.http.routes': ['distributed.http.health']}


def health_only_env():
    """:data:`HEALTH_ONLY` as a Dask process started elsewhere reads it:
    its environment's variables.

    >>> health_only_env()['DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES']
    "['distributed.http.health']"
    """
    return {'DASK_' + key.upper().replace('.', '__').replace('-', '_'):
            repr(value) for key, value in HEALTH_ONLY.items()}


@contextlib.contextmanager
def local_device_workers(devices, blas_threads=1):
    """A Client to one new worker process per device of ``devices``, closed
    on exit (no dashboard: a run's throwaway workers): for GPUs each
    worker sees exactly its GPU
    (``CUDA_VISIBLE_DEVICES``, as dask-cuda's LocalCUDACluster does) and
    offers it as ``GPU=1``; for ``'@numpy'`` replicas, CPU workers with
    ``blas_threads`` BLAS threads each (:func:`local_workers`).

    Examples
    --------
    >>> gpus = ('@cupy:0', '@cupy:1')
    >>> with local_device_workers(gpus) as client:  # doctest: +SKIP
    ...     train(TrainConfig(workers=2, devices=('@cupy:0',)),
    ...           client=client)
    """
    # Imported here: it imports Chainer, which CPU workers need not wait for.
    from dasktrain.parallel.cuda_check import gpu_count
    ids = gpu_ids(devices)
    if not ids:
        # No dashboard: no one is shown its link, and Bokeh's import
        # alone costs the run's start-up most of a second of CPU. Forked
        # from a process that imported Chainer once (_forkserver).
        with local_workers(len(devices), blas_threads, dashboard=False,
                           method=_forkserver(blas_threads)) as client:
            yield client
        return
    import dask
    from distributed import Client, Nanny, Scheduler, SpecCluster
    from distributed.security import Security
    count, _ = gpu_count()
    entries = visible_gpus(count=count)  # this process's ordinal -> entry
    env = {k: str(blas_threads) for k in _BLAS_THREADS}
    # As local_workers: 127.0.0.1 only, TLS with throwaway certificates.
    security = Security.temporary()
    common = {'host': '127.0.0.1', 'protocol': 'tls', 'security': security}
    workers = {f'gpu{i}': {'cls': Nanny, 'options': dict(
        common, nthreads=1, resources={'GPU': 1},
        dashboard_address='127.0.0.1:0',
        env=dict(env, CUDA_VISIBLE_DEVICES=entries[i]))} for i in ids}
    scheduler = {'cls': Scheduler, 'options': dict(
        common, dashboard_address='127.0.0.1:0', dashboard=False)}
    malloc.users_environ()  # the workers inherit it: not Dask's leftover
    with restore_default_scheduler(always=True), dask.config.set(
            dict(_QUIET, **HEALTH_ONLY)), SpecCluster(
                workers=workers, scheduler=scheduler,
                security=security) as cluster:
        with Client(cluster, security=security,
                    set_as_default=False) as client:
            client.wait_for_workers(len(ids))
            yield client


#: What this process's forkserver was started with (None: not started).
_FORKED = {'key': None}
#: What the forkserver imports once, for every worker forked from it: a
#: rank's training needs them all (Chainer alone is a second of CPU).
PRELOAD = ['distributed', 'numpy', 'chainer', 'dasktrain.run.train']
#: Variables those imports read once, when they load (``CHAINER_DTYPE``
#: is Chainer's default dtype for good): a worker forked from a server
#: that loaded them under other values would not see today's.
READ_AT_IMPORT = ('CHAINER_', 'CUPY_', 'CUDA_', 'NCCL_', 'PYTHONHASHSEED')


def _forkserver_key(blas_threads, environ):
    """What a forkserver's workers inherit from its imports: the BLAS
    thread count and the :data:`READ_AT_IMPORT` variables of
    ``environ``.

    Examples
    --------
    >>> _forkserver_key(1, {'CHAINER_DTYPE': 'float64', 'HOME': '/root'})
    (1, (('CHAINER_DTYPE', 'float64'),))
    """
    return blas_threads, tuple(sorted(
        (k, v) for k, v in environ.items() if k.startswith(READ_AT_IMPORT)))


def _forkserver(blas_threads):
    """``'forkserver'``, with :data:`PRELOAD` imported there once, for
    workers of ``blas_threads`` BLAS threads; None (spawn) where this
    process's forkserver already runs with another count or other
    :data:`READ_AT_IMPORT` variables: NumPy and Chainer read them once,
    when they load, which the forkserver did for good.
    Measured (2 workers, 2 cores): Chainer ready in both 2.8 s after the
    start against 5.0 s spawned, and closed in 0.05 s against 0.9 s."""
    key = _forkserver_key(blas_threads, os.environ)
    if _FORKED['key'] is None:
        import dask
        import distributed  # noqa: F401  (its config, for the context)
        from distributed.utils import get_mp_context
        method = 'distributed.worker.multiprocessing-method'
        with dask.config.set({method: 'forkserver'}):
            context = get_mp_context()  # Dask's preload, set once
        context.set_forkserver_preload(PRELOAD)
        _FORKED['key'] = key
    return 'forkserver' if _FORKED['key'] == key else None


@contextlib.contextmanager
def local_workers(n, blas_threads=1, dashboard=True, method=None):
    """A Client to ``n`` new Dask worker processes on this machine, each
    with ``blas_threads`` BLAS threads, closed on exit: CPU scale-out
    without a cluster (one thread each, N workers use N cores).

    ``dashboard=False`` starts no dashboard (no Bokeh to import);
    ``method='forkserver'`` forks the workers from one process that
    imported Dask once, instead of each importing it again (``spawn``):
    seconds fewer on a busy machine, for a launch that is waited on.

    Examples
    --------
    >>> with local_workers(2) as client:  # doctest: +SKIP
    ...     train(TrainConfig(workers=2, mode='ipm', mix_every=10),
    ...           client=client)
    """
    import dask
    from distributed import Client, LocalCluster
    check_main_guard()  # before any process re-imports the script
    env = {k: str(blas_threads) for k in _BLAS_THREADS}
    # BLAS reads these once, when it loads: set before the workers spawn.
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    malloc.users_environ()  # the workers inherit it: not Dask's leftover
    try:
        # Every listener on 127.0.0.1 (':0' would put the dashboard on
        # every interface); TLS with throwaway certificates, so that other
        # users of the machine cannot run code in the workers.
        # The preload: a terminal's Ctrl-C reaches every process of its
        # group; the workers leave it to this process, which shuts them
        # down, instead of each printing its own traceback.
        # Their web servers: /health alone (and the dashboard's pages
        # with dashboard=True), see HEALTH_ONLY.
        config = dict(_QUIET, **HEALTH_ONLY, **{
            'distributed.worker.multiprocessing-method': method} if method
            else {})
        if dashboard:
            config['distributed.scheduler.http.routes'] = [
                'distributed.http.health', 'distributed.http.statics']
        with restore_default_scheduler(always=True), dask.config.set(
                config), LocalCluster(
                n_workers=n, threads_per_worker=1, processes=True,
                host='127.0.0.1',
                # Without a dashboard the scheduler still serves /health:
                # on a free port, not 8787's (a warning when taken).
                dashboard_address='127.0.0.1:0',
                scheduler_kwargs=None if dashboard else {'dashboard': False},
                security=True, env=env,
                preload=['dasktrain.cluster.ignore_ctrl_c']) as cluster:
            with Client(cluster, set_as_default=False) as client:
                yield client
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
