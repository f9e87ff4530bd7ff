"""One training job across several Dask workers: one process per group.

``train(config)`` with ``config.workers = N`` picks N workers of a running
cluster and starts one long task on each: a *rank*, which runs the usual
training loop (:func:`dasktrain.training.run_group`) on that worker's own
devices and its replicas' shards of the data. Inside a worker the replicas
are a :class:`~dasktrain.parallel.GPUDistributedGradient` as ever; across
workers the ranks talk directly (:mod:`dasktrain.parallel.collective`): dg sums the
gradients every step, ipm averages parameters at every mix. Dask starts,
places and watches the processes; no MPI, no ``mpiexec``.

This process (the driver) only relays progress (rank 0 logs Dask events)
and reacts to failures: if a worker dies, the job goes on from its last
checkpoint with the workers left (``on_worker_loss='continue'``) or once
enough are back (``'wait'``); any other error ends the job with that
error. A rank that hangs makes the others fail after
``collective_timeout`` seconds, never wait forever.

Every worker must see ``out`` and ``data_dir`` at the same paths (one
machine, or a shared filesystem): rank 0 writes the log and checkpoint,
and after a lost worker the new ranks resume from it.
"""
import contextlib
import os
import sys
import time
import uuid

from dasktrain.cluster.local import (connect, restore_default_scheduler,
                                     worker_info)
from dasktrain.parallel.comm import CollectiveError, DaskComm
from dasktrain.parallel.devices import (free_gpu_memory, gpu_count,
                                        resolve_devices)
from dasktrain.parallel.gpus import (NCCL_MISSING, GpuPool, gpu_ids,
                                     place_devices, use_nccl, visible_gpus)
from dasktrain.parallel.comm import NcclComm
from dasktrain.config import TrainConfig
from dasktrain.errors import UserError
from dasktrain.training.loop import (_Progress, default_devices, prepare_out,
                                     run_group)
from dasktrain.training.loop import train as train_here

POLL = 0.2  # s between looks at the ranks' futures and events


class ScaleOutError(UserError):
    """The cluster cannot run the job as asked."""


class _RankProgress:
    """A rank's progress hooks: rank 0 relays its progress to the driver as
    Dask events on ``topic``; every rank stops once its task is cancelled
    (the driver gave up on it, or died): a running task's thread is not
    stopped by Dask, and must not train on beside a rerun."""

    def __init__(self, topic, relay, every=1.0):
        from distributed import get_worker
        from distributed.worker import thread_state
        self.worker, self.key = get_worker(), thread_state.key
        self.topic, self.relay, self.every = topic, relay, every
        self.seq, self.last, self.done = 0, 0.0, 0

    def _send(self, kind, **data):
        task = self.worker.state.tasks.get(self.key)
        if task is None or task.state == 'cancelled':
            raise RankCancelled(f'{self.key} was cancelled')
        if self.relay:
            self.seq += 1
            self.worker.log_event(self.topic, dict(kind=kind, seq=self.seq,
                                                   **data))

    def warn(self, line):
        """One line for the user, printed by the driver."""
        self._send('warning', line=line)

    def start(self, epoch, iterations):
        self.done = 0
        self._send('start', epoch=epoch, iterations=iterations)

    def step(self, loss, accuracy):
        self.done += 1
        now = time.monotonic()
        if now - self.last >= self.every:  # spare the scheduler
            self.last = now
            self._send('step', done=self.done, loss=loss, accuracy=accuracy)

    def end(self, row):
        self._send('end', row=row)


class RankCancelled(Exception):
    """Raised inside a rank whose task was cancelled."""


def _nccl_module():
    """CuPy's NCCL module, or None where CuPy cannot be imported."""
    try:
        from cupy.cuda import nccl
    except Exception:  # no CuPy, or a broken one: the Dask path serves
        return None
    return nccl


def _rank(config, name, rank, size, gpus):
    """The task body of rank ``rank``: join the others, train, report."""
    import chainer
    held = GpuPool.acquire(gpus) if gpus else []
    # The worker's free GPUs by their CUDA ordinals in this process.
    devices = place_devices(config.devices, [g.index for g in held]) \
        if held else config.devices or ('@numpy',)
    try:
        with DaskComm.rendezvous(name, rank, size,
                                 config.collective_timeout) as host:
            comm = host
            progress = _RankProgress(name, relay=rank == 0)
            # NCCL only if every rank can use it: the ranks must agree.
            nccl = use_nccl(devices, _nccl_module())
            if all(host.allgather(nccl)):
                comm = NcclComm(host, gpu_ids(devices)[0])
            elif gpu_ids(devices) and not nccl:
                progress.warn(NCCL_MISSING)
            try:
                with chainer.using_device(chainer.get_device(devices[0])):
                    summary = run_group(config, comm=comm, devices=devices,
                                        progress=progress)
            finally:
                if comm is not host:
                    comm.close()
            return summary if rank == 0 else None
    finally:
        free_gpu_memory(gpu_ids(devices))  # before the next job gets them
        GpuPool.release(held)


def _gpus_per_worker(config, infos):
    if config.devices is None:
        return 1 if any(w.get('resources', {}).get('GPU') for w in infos)\
            else 0
    return len(gpu_ids(config.devices))


def _choose(client, config, gpus, wanted, minimum, patience):
    """Addresses of up to ``wanted`` workers able to host a rank, once at
    least ``minimum`` are; ScaleOutError after ``patience`` seconds."""
    deadline = time.monotonic() + patience
    announced = False
    while True:
        infos = worker_info(client)
        able = sorted(a for a, w in infos.items()
                      if w.get('resources', {}).get('GPU', 0) >= gpus)
        if len(able) >= minimum:
            return able[:wanted]
        if time.monotonic() > deadline:
            raise ScaleOutError(
                f'--workers {config.workers} needs {minimum} Dask workers'
                f'{f" with {gpus} GPUs each" if gpus else ""}; the cluster '
                f'has {len(able)} after {patience:g} s; add workers (`dask '
                'worker ADDRESS`) or lower --workers')
        if not announced:
            print(f'waiting for {minimum} workers (have {len(able)})',
                  file=sys.stderr, flush=True)
            announced = True
        time.sleep(1.0)


def _launch(client, config, name, workers, gpus):
    infos = worker_info(client)
    futures = []
    for rank, address in enumerate(workers):
        resources = {'GPU': gpus} if gpus else \
            {'CPU': 1} if infos[address].get('resources', {}).get('CPU') \
            else None
        futures.append(client.submit(
            _rank, config, name, rank, len(workers), gpus,
            key=f'{name}-rank{rank}', workers=[address],
            allow_other_workers=False, resources=resources, pure=False))
    return futures


def _watch(client, futures, workers, topic, progress, callbacks):
    """Relay progress until the ranks end. Returns ('done', summary) or
    ('lost', addresses); raises the root error of a failed job."""
    seen = 0  # the scheduler keeps every event of the topic: skip old ones
    failed_since = None
    while True:
        for _, event in client.get_events(topic):
            if event['seq'] <= seen:
                continue
            seen = event['seq']
            if event['kind'] == 'warning':
                print(event['line'], file=sys.stderr, flush=True)
            elif event['kind'] == 'start':
                progress.start(event['epoch'], event['iterations'])
            elif event['kind'] == 'step':
                if progress.bar is not None:
                    progress.bar.n = event['done'] - 1
                progress.step(event['loss'], event['accuracy'])
            else:
                progress.end(event['row'])
                for callback in callbacks:
                    callback(event['row'])
        states = [f.status for f in futures]
        if all(s == 'finished' for s in states):
            return 'done', futures[0].result()
        alive = set(worker_info(client))
        lost = [w for w in workers if w not in alive]
        if lost:
            return 'lost', lost
        if 'error' in states:
            errors = [f.exception() for f in futures if f.status == 'error']
            root = [e for e in errors if not isinstance(e, CollectiveError)]
            if root:
                raise root[0]
            # A peer's failure shows first as a broken connection; give
            # the scheduler a moment to notice a dead worker.
            failed_since = failed_since or time.monotonic()
            if time.monotonic() - failed_since > 5.0 or \
                    all(s in ('error', 'finished') for s in states):
                raise errors[0]
        time.sleep(POLL)


def train(config=None, callbacks=(), client=None, **overrides):
    """Train as ``config`` says: in this process, or with ``workers`` set,
    as one job across that many Dask workers.

    Parameters
    ----------
    config : TrainConfig, optional
        Default ``TrainConfig()``; keyword ``overrides`` replace fields.
    callbacks : sequence of callables, default ()
        Called as ``callback(row)`` after each epoch.
    client : distributed.Client, optional
        Default: connect to ``config.scheduler``, else the recorded cluster.

    Returns
    -------
    dict
        As :func:`dasktrain.training.train`, plus ``attempts`` and
        ``workers`` (the workers of the last attempt).

    Examples
    --------
    >>> train(TrainConfig(workers=2, mode='ipm', mix_every=10))  # doctest: +SKIP
    """
    config = (config or TrainConfig()).replace(**overrides)
    if config.workers is None:
        devices = config.devices or default_devices()  # asks CUDA once
        plan = None if config.in_process else per_device_plan(devices)
        if plan is None:
            return train_here(config, callbacks)
        # A missing GPU is one line, before any worker process starts.
        resolve_devices(devices)
        workers, device = plan
        if config.progress:
            print(f'training on {workers} worker processes, one per device'
                  ' (--in-process: all in this one)', flush=True)
        with local_device_workers(devices) as client:
            return train(config.replace(workers=workers, devices=(device,)),
                         callbacks, client=client)
    # Ranks run elsewhere, in other working directories.
    config = config.replace(out=os.path.abspath(config.out),
                            data_dir=os.path.abspath(config.data_dir))
    with prepare_out(config):  # locked here; rank 0 writes into it
        from dasktrain.data.download import download_cifar10
        download_cifar10(config.data_dir, url=config.url, md5=config.md5,
                         progress=config.progress)  # once, not per rank
        if client is not None:
            return _drive(client, config, callbacks)
        with restore_default_scheduler(always=True):
            with connect(config.scheduler) as client:
                return _drive(client, config, callbacks)


def _drive(client, config, callbacks):
    from distributed import Variable
    infos = list(worker_info(client).values())
    gpus = _gpus_per_worker(config, infos)
    job = uuid.uuid4().hex[:8]
    progress = _Progress(config.progress, config.epochs)
    wanted = minimum = config.workers
    patience, attempt = config.collective_timeout, 0
    while True:
        attempt += 1
        workers = _choose(client, config, gpus, wanted, minimum, patience)
        name = f'dasktrain-{job}-{attempt}'
        run = config.replace(resume=config.resume or attempt > 1,
                             progress=False)
        futures = _launch(client, run, name, workers, gpus)
        try:
            outcome, value = _watch(client, futures, workers, name,
                                    progress, callbacks)
        finally:
            client.cancel(futures, force=True)
            for rank in range(len(workers)):
                Variable(f'{name}/rank{rank}', client=client).delete()
        if outcome == 'done':
            value.update(attempts=attempt, workers=workers)
            return value
        print(f'worker(s) {", ".join(value)} lost; '
              f'{"waiting for replacements, then " if config.on_worker_loss == "wait" else ""}'
              'resuming from the last checkpoint', file=sys.stderr,
              flush=True)
        if config.on_worker_loss == 'continue':
            wanted, minimum = max(1, len(workers) - len(value)), 1
        else:
            patience = float('inf')


_BLAS_THREADS = ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS')


def per_device_plan(devices):
    """(workers, each one's device) to train ``devices`` as one process
    per device, or None to keep them in one process: a single device, or
    a list with a GPU named twice or CPU and GPUs mixed.

    >>> per_device_plan(('@numpy', '@numpy'))
    (2, '@numpy')
    >>> per_device_plan(('@cupy:2', '@cupy:0'))
    (2, '@cupy:0')
    >>> per_device_plan(('@cupy:1', '@cupy:1')) is None
    True
    """
    devices = tuple(devices)
    if len(devices) < 2:
        return None
    if all(d == '@numpy' for d in devices):
        return len(devices), '@numpy'
    if len(gpu_ids(devices)) == len(devices):  # distinct GPUs only
        return len(devices), '@cupy:0'  # each worker sees its GPU as 0
    return None


@contextlib.contextmanager
def local_device_workers(devices, blas_threads=1):
    """A Client to one new worker process per device of ``devices``, closed
    on exit: for GPUs each worker sees exactly its GPU
    (``CUDA_VISIBLE_DEVICES``, as dask-cuda's LocalCUDACluster does) and
    offers it as ``GPU=1``; for ``'@numpy'`` replicas, CPU workers with
    ``blas_threads`` BLAS threads each (:func:`local_workers`)."""
    ids = gpu_ids(devices)
    if not ids:
        with local_workers(len(devices), blas_threads) as client:
            yield client
        return
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
        common, dashboard_address='127.0.0.1:0')}
    with restore_default_scheduler(always=True), SpecCluster(
            workers=workers, scheduler=scheduler,
            security=security) as cluster:
        with Client(cluster, security=security,
                    set_as_default=False) as client:
            client.wait_for_workers(len(ids))
            yield client


@contextlib.contextmanager
def local_workers(n, blas_threads=1):
    """A Client to ``n`` new Dask worker processes on this machine, each
    with ``blas_threads`` BLAS threads, closed on exit: CPU scale-out
    without a cluster (one thread each, N workers use N cores).

    Examples
    --------
    >>> with local_workers(2) as client:  # doctest: +SKIP
    ...     train(TrainConfig(workers=2, mode='ipm', mix_every=10),
    ...           client=client)
    """
    from distributed import Client, LocalCluster
    env = {k: str(blas_threads) for k in _BLAS_THREADS}
    # BLAS reads these once, when it loads: set before the workers spawn.
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        # Every listener on 127.0.0.1 (':0' would put the dashboard on
        # every interface); TLS with throwaway certificates, so that other
        # users of the machine cannot run code in the workers.
        with restore_default_scheduler(always=True), LocalCluster(
                n_workers=n, threads_per_worker=1, processes=True,
                host='127.0.0.1', dashboard_address='127.0.0.1:0',
                security=True, env=env) as cluster:
            with Client(cluster, set_as_default=False) as client:
                yield client
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
