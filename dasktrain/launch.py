"""THE ``train(config)``: where a run trains, decided once, and the one
per-rank loop run there.

:func:`train` asks :func:`dasktrain.parallel.placement.place` where
``config`` trains, and runs :func:`dasktrain.training.loop.run`:

* here, in this process (a job of one rank);
* one process per device: a job of as many ranks on throwaway worker
  processes (:func:`~dasktrain.cluster.workers.local_device_workers`);
* ``workers=N``: a job of N ranks on a running Dask cluster.

A job of ranks: this process (the driver) picks the workers and starts one
long task on each, a *rank*, which joins the others
(:class:`~dasktrain.parallel.comm.dask.DaskComm`, NCCL between GPUs
where every rank can use it) and runs the loop on that worker's devices
and its replicas' shards of the data: dg sums the gradients every step,
ipm averages parameters at every mix. Dask starts, places and watches the
processes; no MPI, no ``mpiexec``. The driver only relays progress (rank
0 logs Dask events) and reacts to failures: if a worker dies, the job goes
on from its last checkpoint with the workers left
(``on_worker_loss='continue'``) or once enough are back (``'wait'``); any
other error ends the job with that error. A rank that hangs makes the
others fail after ``collective_timeout`` seconds, never wait forever.

Every worker must see ``out`` and ``data_dir`` at the same paths (one
machine, or a shared filesystem): rank 0 writes the log and checkpoint,
and after a lost worker the new ranks resume from it.

Owns running the loop where placement says, the ranks, the relay and the
retries; may not touch job folders (:mod:`dasktrain.jobs` runs a job by
calling :func:`train`).
"""
import logging
import os
import queue
import time
import uuid

import chainer

from dasktrain.cluster.local import (
    connect,
    restore_default_scheduler,
    worker_info,
)
from dasktrain.cluster.workers import local_device_workers
from dasktrain.config import TrainConfig
from dasktrain.data.datasets import (
    augmentation_plan,
    load_dataset,
    resolve_spec,
)
from dasktrain.data.datasets import spec_file as dataset_file
from dasktrain.data.download import CIFAR100, download_cifar10
from dasktrain.errors import UserError, argument
from dasktrain.parallel.comm import CollectiveError, DaskComm, NcclComm
from dasktrain.parallel.devices import (
    frames_released,
    free_gpu_memory,
    resolve_devices,
)
from dasktrain.parallel.gpus import (
    GpuPool,
    gpu_ids,
    nccl_problem,
    place_devices,
    use_nccl,
)
from dasktrain.parallel.placement import (
    HERE,
    PER_DEVICE,
    able_workers,
    gpus_per_rank,
    place,
    rank_resources,
    rank_threads,
)
from dasktrain.training.checkpoint import prepare_out
from dasktrain.training.loop import run
from dasktrain.training.models import resolve_model
from dasktrain.training.progress import Progress
from dasktrain.training.usermodel import is_spec, spec_file

logger = logging.getLogger(__name__)

POLL = 0.2  # s between looks at the ranks' futures and events


class ScaleOutError(UserError):
    """The cluster cannot run the job as asked."""


class RankCancelled(Exception):
    """Raised inside a rank whose task was cancelled."""


def train(config=None, callbacks=(), client=None, **overrides):
    """Train as ``config`` says, where it says; return the summary.

    Parameters
    ----------
    config : TrainConfig, optional
        Default ``TrainConfig()``; keyword ``overrides`` replace fields.
        ``workers=N`` runs N ranks on a Dask cluster; else several devices
        train as one process each, unless ``in_process``.
    callbacks : sequence of callables, default ()
        Each is called as ``callback(row)`` after an epoch's log row and
        checkpoint are written (e.g. to plot live in a notebook).
    client : distributed.Client, optional
        The cluster of ``workers=N``; default: connect to
        ``config.scheduler``, else the recorded cluster.

    Returns
    -------
    dict
        ``log`` (all rows), ``final`` (the last row), ``out``, ``devices``
        and ``stopped_early``; for a job of ranks also ``attempts`` and
        ``workers`` (the workers of the last attempt).

    Examples
    --------
    >>> summary = train(TrainConfig(epochs=5))  # doctest: +SKIP
    >>> summary['final']['validation/main/accuracy']  # doctest: +SKIP
    >>> train(TrainConfig(workers=2, mode='ipm'))  # doctest: +SKIP
    """
    config = (config or TrainConfig()).replace(**overrides)
    # The user's model: one line if it is wrong, before anything starts;
    # ranks elsewhere find the same file.
    config = config.replace(model=resolve_model(config.model,
                                                config.model_args),
                            dataset=resolve_spec(config.dataset))
    progress = Progress(config.progress, config.epochs)
    placement = place(config)  # asks CUDA, once, when no devices are named
    if placement.where != HERE:
        _say_data(config, progress)
    if placement.where == HERE:
        with prepare_out(config):
            return run(config, devices=placement.devices,
                       callbacks=callbacks, progress=progress)
    if placement.where == PER_DEVICE:
        # A missing GPU is one line, before any worker process starts.
        resolve_devices(placement.devices)
        progress.say(f'training on {placement.ranks} worker processes, one '
                     f'per device ({argument("in_process")}: all in this one)')
        with local_device_workers(placement.devices, rank_threads(
                placement.ranks, os.cpu_count())) as client:
            return _job(config.replace(workers=placement.ranks,
                                       devices=placement.rank_devices),
                        callbacks, client, progress)
    return _job(config, callbacks, client, progress)


def _say_data(config, progress):
    """The data and its augmentation, in the driver's first lines (the
    ranks show nothing): a dataset other than CIFAR-10 is loaded here,
    so that one that is wrong is one line before any worker starts."""
    if config.dataset == 'cifar10':
        progress.say(augmentation_plan('cifar10', True, (32,),
                                       config.augment)[1])
        return
    data = load_dataset(config.dataset, config.data_dir, url=config.url,
                        md5=config.md5, label_set=config.label_set,
                        train_size=config.train_size)
    progress.say(data.describe())
    progress.say(data.augmentation_words(config.augment))


def _send_model(client, config):
    """A model file and a dataset's, to every worker (Dask's
    ``upload_file``): a worker on another machine needs no copy of the
    user's folder."""
    for path in (spec_file(config.model) if is_spec(config.model) else None,
                 dataset_file(config.dataset)):
        if path is not None:
            client.upload_file(str(path), load=False)


def _job(config, callbacks, client, progress):
    """Run ``config.workers`` ranks on ``client``'s cluster (default:
    ``config.scheduler``'s, else the recorded one)."""
    # Ranks run elsewhere, in other working directories.
    config = config.replace(out=os.path.abspath(config.out),
                            data_dir=os.path.abspath(config.data_dir))
    with prepare_out(config):  # locked here; rank 0 writes into it
        if config.dataset in ('cifar10', 'cifar100'):  # once, not per rank
            download_cifar10(config.data_dir, url=config.url, md5=config.md5,
                             progress=config.progress,
                             **({'source': CIFAR100}
                                if config.dataset == 'cifar100' else {}))
        if client is not None:
            return _drive(client, config, callbacks, progress)
        with restore_default_scheduler(always=True):
            with connect(config.scheduler) as client:
                return _drive(client, config, callbacks, progress)


# ------------------------------------------------------------ the ranks

class _RankProgress(Progress):
    """A rank's display: rank 0 relays its progress to the driver as Dask
    events on ``topic``; every rank stops once its task is cancelled (the
    driver gave up on it, or died): a running task's thread is not
    stopped by Dask, and must not train on beside a rerun. Shows nothing
    itself: the driver shows the run."""

    def __init__(self, topic, relay, every=1.0):
        from distributed import get_worker
        from distributed.worker import thread_state
        super().__init__(False, None)
        self.worker, self.key = get_worker(), thread_state.key
        self.topic, self.relay, self.every = topic, relay, every
        self.last, self.done = 0.0, 0

    def _send(self, kind, **data):
        task = self.worker.state.tasks.get(self.key)
        if task is None or task.state == 'cancelled':
            raise RankCancelled(f'{self.key} was cancelled')
        if self.relay:
            self.worker.log_event(self.topic, dict(kind=kind, **data))

    def warn(self, line):
        """One line for the user, logged by the driver."""
        self._send('warning', line=line)

    def start(self, epoch, iterations):
        self.done = 0
        self._send('start', epoch=epoch, iterations=iterations)

    def step(self, loss, accuracy, done=None):
        self.done += 1
        now = time.monotonic()
        if now - self.last >= self.every:  # spare the scheduler
            self.last = now
            self._send('step', done=self.done, loss=loss, accuracy=accuracy)

    def end(self, row):
        self._send('end', row=row)


def _nccl_module():
    """CuPy's NCCL module, or None where CuPy cannot be imported."""
    try:
        from cupy.cuda import nccl
    except Exception:  # no CuPy, or a broken one: the Dask path serves
        return None
    return nccl


def _drain(inbox):
    """What ``inbox`` (a queue) holds now, in order."""
    items = []
    while True:
        try:
            items.append(inbox.get_nowait())
        except queue.Empty:
            return items


def _rank(config, name, rank, size, gpus):
    """The task body of rank ``rank``: join the others, train, report."""
    held = GpuPool.acquire(gpus) if gpus else []
    # The worker's free GPUs by their CUDA ordinals in this process.
    devices = place_devices(config.devices, [g.index for g in held]) \
        if held else config.devices or ('@numpy',)
    try:
        with frames_released(), DaskComm.rendezvous(
                name, rank, size, config.collective_timeout) as host:
            comm = host
            progress = _RankProgress(name, relay=rank == 0)
            # NCCL only if every rank can use it: the ranks must agree.
            module = _nccl_module()
            nccl = use_nccl(devices, module)
            if all(host.allgather(nccl)):
                comm = NcclComm(host, gpu_ids(devices)[0])
            elif gpu_ids(devices) and not nccl:
                progress.warn(nccl_problem(module))
            try:
                with chainer.using_device(chainer.get_device(devices[0])):
                    summary = run(config, comm=comm, devices=devices,
                                  progress=progress)
            finally:
                if comm is not host:
                    comm.close()
            return summary if rank == 0 else None
    finally:
        free_gpu_memory(gpu_ids(devices))  # before the next job gets them
        GpuPool.release(held)


# ------------------------------------------------------------ the driver

def _drive(client, config, callbacks, progress):
    """Run the job's ranks until they end, again from the checkpoint after
    a lost worker; the summary of rank 0."""
    from distributed import Variable
    _send_model(client, config)
    gpus = gpus_per_rank(config.devices, worker_info(client).values(),
                         config.gpus_per_worker)
    job = uuid.uuid4().hex[:8]
    wanted = minimum = config.workers
    patience, attempt = config.collective_timeout, 0
    while True:
        attempt += 1
        workers = _choose(client, config, gpus, wanted, minimum, patience)
        name = f'dasktrain-{job}-{attempt}'
        ranks = config.replace(resume=config.resume or attempt > 1,
                               progress=False)
        # Events pushed to us as they come: polling get_events would fetch
        # the topic's whole log (up to 1,000 of them) five times a second.
        inbox = queue.SimpleQueue()
        client.subscribe_topic(name, inbox.put)
        futures = _launch(client, ranks, name, workers, gpus)
        try:
            outcome, value = _watch(client, futures, workers, inbox,
                                    progress, callbacks)
        finally:
            client.unsubscribe_topic(name)
            client.cancel(futures, force=True)
            for rank in range(len(workers)):
                Variable(f'{name}/rank{rank}', client=client).delete()
        if outcome == 'done':
            value.update(attempts=attempt, workers=workers)
            return value
        then = 'waiting for replacements, then ' \
            if config.on_worker_loss == 'wait' else ''
        logger.warning('worker(s) %s lost; %sresuming from the last '
                       'checkpoint', ', '.join(value), then)
        if config.on_worker_loss == 'continue':
            wanted, minimum = max(1, len(workers) - len(value)), 1
        else:
            patience = float('inf')


def _choose(client, config, gpus, wanted, minimum, patience):
    """Addresses of up to ``wanted`` workers able to host a rank, once at
    least ``minimum`` are; ScaleOutError after ``patience`` seconds."""
    deadline = time.monotonic() + patience
    announced = False
    while True:
        able = able_workers(worker_info(client), gpus)
        if len(able) >= minimum:
            return able[:wanted]
        if time.monotonic() > deadline:
            raise ScaleOutError(
                f'{argument("workers")} {config.workers} needs {minimum} Dask '
                'workers'
                f'{f" with {gpus} GPUs each" if gpus else ""}; the cluster '
                f'has {len(able)} after {patience:g} s; add workers (`dask '
                f'worker ADDRESS`) or lower {argument("workers")}')
        if not announced:
            logger.warning('waiting for %d workers (have %d)', minimum,
                           len(able))
            announced = True
        time.sleep(1.0)


def _launch(client, config, name, workers, gpus):
    """One rank's task on each of ``workers``, holding its resources."""
    infos = worker_info(client)
    return [client.submit(
        _rank, config, name, rank, len(workers), gpus,
        key=f'{name}-rank{rank}', workers=[address],
        allow_other_workers=False,
        resources=rank_resources(gpus, infos[address]), pure=False)
        for rank, address in enumerate(workers)]


def _watch(client, futures, workers, inbox, progress, callbacks):
    """Relay progress (the ranks' events, as ``inbox`` receives them) until
    the ranks end. Returns ('done', summary) or ('lost', addresses); raises
    the root error of a failed job."""
    failed_since = None
    while True:
        for _, event in _drain(inbox):  # each once, in order
            if event['kind'] == 'warning':
                progress.warn(event['line'])
            elif event['kind'] == 'start':
                progress.start(event['epoch'], event['iterations'])
            elif event['kind'] == 'step':
                progress.step(event['loss'], event['accuracy'],
                              done=event['done'])
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
