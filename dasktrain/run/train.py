"""THE ``train(config)``: where a run trains, decided once, and the one
per-rank loop run there.

:func:`train` asks :func:`dasktrain.parallel.placement.place` where
``config`` trains, once, and runs :func:`dasktrain.training.loop.run`:

* here, in this process (a job of one rank);
* one process per device: a job of as many ranks on throwaway worker
  processes (:func:`~dasktrain.cluster.workers.local_device_workers`);
* ``workers=N``: a job of N ranks on a running Dask cluster.

For a job of ranks, :class:`Ranks` is that decision whole (how many, the
GPUs each holds, each one's devices); the driver
(:class:`~dasktrain.run.driver.Driver`, the one ``dasktrain launch`` uses
too) starts one long task per rank on the workers it picks, each joins
the others (:class:`~dasktrain.parallel.comm.dask.DaskComm`, NCCL
between GPUs where every rank can use it) and runs the loop: dg sums the
gradients every step, ipm averages parameters at every mix. Rank 0
relays its display to this process as Dask events. If a worker dies, the
job goes on from its last checkpoint with the workers left
(``on_worker_loss='continue'``) or once enough are back (``'wait'``);
any other error ends the job with that error. A rank that hangs makes the
others fail after ``collective_timeout`` seconds, never wait forever.

Every worker must see ``out`` and ``data_dir`` at the same paths (one
machine, or a shared filesystem): rank 0 writes the log and checkpoint,
and after a lost worker the new ranks resume from it.
"""
import contextlib
import logging
import os
import time
import uuid
from typing import NamedTuple

import chainer

from dasktrain.cluster.local import (
    connect,
    restore_default_scheduler,
    worker_info,
)
from dasktrain.cluster.workers import local_device_workers
from dasktrain.config import TrainConfig
from dasktrain.data.datasets import resolve_spec
from dasktrain.data.datasets import spec_file as dataset_file
from dasktrain.data.download import CIFAR100, download_cifar10
from dasktrain.errors import (
    UserError,
    argument,
    flag_names,
    naming_flags,
    plural,
)
from dasktrain.parallel.comm import CollectiveError, DaskComm, NcclComm
from dasktrain.parallel.comm.base import Communicator
from dasktrain.parallel.comm.rendezvous import join, launched
from dasktrain.parallel.cuda_check import check_gpus_usable
from dasktrain.parallel.devices import (
    available_devices,
    frames_released,
    free_gpu_memory,
    own_gpu,
    resolve_devices,
)
from dasktrain.parallel.gpus import (
    CLEAR_NCCL_REFUSED,
    GpuPool,
    clear_nccl_allowed,
    gpu_ids,
    nccl_between,
    nccl_problem,
    place_devices,
    refuse_shared_gpu,
    use_nccl,
)
from dasktrain.parallel.placement import (
    HERE,
    LAUNCHED,
    PER_DEVICE,
    able_workers,
    gpus_per_rank,
    launched_devices,
    machine_place,
    place,
    rank_resources,
    rank_threads,
)
from dasktrain.run.driver import Driver, RankResult, RunState, Stop, go_on
from dasktrain.training.checkpoint import prepare_out
from dasktrain.training.loop import run
from dasktrain.training.models import resolve_model
from dasktrain.training.progress import Progress
from dasktrain.training.usermodel import is_spec, spec_file

logger = logging.getLogger(__name__)


class ScaleOutError(UserError):
    """The cluster cannot run the job as asked."""


class RankCancelled(Exception):
    """Raised inside a rank whose task was cancelled."""


class Ranks(NamedTuple):
    """Where a job of ranks trains, decided once: ``count`` ranks, each
    holding ``gpus`` GPUs of its worker and training on ``devices`` (as
    that rank sees them; None: its GPUs, else the CPU)."""
    count: int
    gpus: int
    devices: tuple | None

    def config(self, config, attempt=1):
        """The config each rank runs, which rank 0 records in ``args``: the
        run as it was asked for (its devices, and ``workers`` only where it
        named a cluster's), so that ``--resume`` places it again as the
        first start did; each rank trains on :attr:`devices`."""
        return config.replace(resume=config.resume or attempt > 1,
                              progress=False)


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
    # The user's model and data: one line if wrong, before anything
    # starts; ranks elsewhere find the same files.
    config = config.replace(model=resolve_model(config.model,
                                                config.model_args),
                            dataset=resolve_spec(config.dataset))
    progress = Progress(config.progress, config.epochs)
    # Asks CUDA, once, when no devices are named.
    placement = place(config, launched=launched())
    if placement.where in (HERE, PER_DEVICE, LAUNCHED):
        # GPUs here that CuPy cannot use: one line, before anything starts.
        check_gpus_usable(config.devices)
    if placement.where == LAUNCHED:
        return _launched(config, callbacks, progress)
    if placement.where == HERE:
        with prepare_out(config):
            return run(config, devices=placement.devices,
                       callbacks=callbacks, progress=progress)
    if placement.where == PER_DEVICE:
        # A missing GPU is one line, before any worker process starts.
        resolve_devices(placement.devices)
        progress.say(per_device_line(placement.devices))
        ranks = Ranks(placement.ranks, len(gpu_ids(placement.rank_devices)),
                      placement.rank_devices)
        with local_device_workers(placement.devices, rank_threads(
                placement.ranks, os.cpu_count())) as client:
            return _job(config, ranks, callbacks, client, progress)
    return _job(config, None, callbacks, client, progress)


def per_device_line(devices):
    """What :func:`train` says before it starts one worker process for
    each of ``devices``; under the ``dasktrain`` command it names the
    flag that keeps them in one process.

    Examples
    --------
    >>> per_device_line(('cpu', 'cpu'))
    'training on 2 devices (cpu, cpu), each in a worker process of its own'
    """
    line = (f'training on {plural(len(devices), "device")} '
            f'({", ".join(map(str, devices))}), each in a worker process of '
            'its own')
    if naming_flags():
        line += '; --in-process trains them all in this one process'
    return line


def _job(config, ranks, callbacks, client, progress):
    """Run the job's ranks on ``client``'s cluster (default:
    ``config.scheduler``'s, else the recorded one); ``ranks`` as decided
    (None: ``config.workers`` on that cluster, decided here)."""
    # Ranks run elsewhere, in other working directories.
    config = config.replace(out=os.path.abspath(config.out),
                            data_dir=os.path.abspath(config.data_dir))
    with prepare_out(config):  # locked here; rank 0 writes into it
        _download(config)  # once, not per rank
        if client is not None:
            return _drive(client, config, ranks, callbacks, progress)
        with restore_default_scheduler(always=True):
            with connect(config.scheduler) as client:
                return _drive(client, config, ranks, callbacks, progress)


def _download(config):
    """CIFAR-10 or -100 into ``config.data_dir`` if the run names it and
    it is not there yet, before the ranks read it."""
    if config.dataset in ('cifar10', 'cifar100'):
        download_cifar10(config.data_dir, url=config.url, md5=config.md5,
                         progress=config.progress,
                         **({'source': CIFAR100}
                            if config.dataset == 'cifar100' else {}))


def _send_files(client, config):
    """A model file and a dataset's, to every worker (Dask's
    ``upload_file``): a worker on another machine needs no copy of the
    user's folder."""
    for path in (spec_file(config.model) if is_spec(config.model) else None,
                 dataset_file(config.dataset)):
        if path is not None:
            client.upload_file(str(path), load=False)


# ------------------------------------------------------------ the ranks

class RankDisplay(Progress):
    """A rank's display: rank 0's goes to the driver as Dask events on
    ``topic`` (its lines, warnings, steps and epochs); the others show
    nothing. The driver shows the run."""

    def __init__(self, topic, relay, every=1.0):
        from distributed import get_worker
        super().__init__(relay, None)
        self.tty = False
        self.worker = get_worker()
        self.topic, self.relay, self.every = topic, relay, every
        self.last, self.done = 0.0, 0

    def _send(self, kind, **data):
        if self.relay:
            self.worker.log_event(self.topic, dict(kind=kind, **data))

    def say(self, line):
        self._send('say', line=line)

    def warn(self, line):
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


class Stoppable(Communicator):
    """A rank's communicator that stops the rank once its task is
    cancelled (the driver gave up on it, or died): every collective first
    raises :class:`RankCancelled` then. Dask does not stop a running
    task's thread, and a cancelled rank must not train on beside a rerun:
    its next collective, at the latest its epoch's sums, ends it."""

    def __init__(self, comm, stop):
        super().__init__(comm.rank, comm.size, comm.timeout)
        self.comm, self.stop = comm, stop
        self.solo, self.sums_on_device = comm.solo, comm.sums_on_device

    def _check(self):
        if self.stop.is_set():
            raise RankCancelled(f'{self.stop.key} was cancelled')

    def allreduce(self, arrays, check=False, scale=None):
        self._check()
        return self.comm.allreduce(arrays, check, scale)

    def iallreduce(self, arrays, check=False, around=None):
        self._check()
        return self.comm.iallreduce(arrays, check, around)

    def allgather(self, obj):
        self._check()
        return self.comm.allgather(obj)

    def gather(self, obj):
        self._check()
        return self.comm.gather(obj)

    def bcast(self, obj):
        self._check()
        return self.comm.bcast(obj)

    def barrier(self):
        self._check()
        return self.comm.barrier()

    def send(self, obj, dest):
        self._check()
        return self.comm.send(obj, dest)

    def recv(self, source):
        self._check()
        return self.comm.recv(source)

    def close(self):
        self.comm.close()


def _nccl_module():
    """CuPy's NCCL module, or None where CuPy cannot be imported."""
    try:
        from cupy.cuda import nccl
    except Exception:  # no CuPy, or a broken one: the Dask path serves
        return None
    return nccl


def _rank(config, name, rank, size, gpus, flags=False, devices=None):
    """The task body of rank ``rank``: join the others, train, report (a
    :class:`~dasktrain.run.driver.RankResult`, rank 0's with the run's
    summary); ``flags``: its messages name command-line flags, as the
    driver's (the ``dasktrain`` command's) do; ``devices``: the rank's
    (Ranks.devices)."""
    with flag_names() if flags else contextlib.nullcontext():
        return _rank_body(config, name, rank, size, gpus, devices)


def rank_comm(host, devices, progress):
    """The communicator a rank trains with: NCCL over ``host`` (its
    :class:`~dasktrain.parallel.comm.dask.DaskComm`) where every rank can
    use it on its ``devices`` (the ranks agree: one collective), else
    ``host`` itself, with a warning on ``progress`` for a GPU rank that
    cannot. In that collective the ranks also compare their own GPUs:
    GpuError (one line, on every rank) where two would hold one. Ranks on
    several machines use NCCL, in clear on the network, only where their
    cluster allows it (:func:`~dasktrain.parallel.gpus.nccl_between`);
    else they sum over their links, sealed on a TLS cluster."""
    module = _nccl_module()
    nccl = use_nccl(devices, module)
    facts = host.allgather((nccl, own_gpu(devices, host.machine),
                            (host.machine, clear_nccl_allowed())))
    refuse_shared_gpu([gpu for _, gpu, _ in facts])
    if all(ok for ok, _, _ in facts):
        if nccl_between([where for _, _, where in facts]):
            return NcclComm(host, gpu_ids(devices)[0])
        progress.warn(f'warning: {CLEAR_NCCL_REFUSED}')
        return host
    if gpu_ids(devices) and not nccl:
        progress.warn(nccl_problem(module))
    return host


def _rank_body(config, name, rank, size, gpus, devices):
    held = GpuPool.acquire(gpus) if gpus else []
    # The worker's free GPUs by their CUDA ordinals in this process.
    devices = place_devices(devices, [g.index for g in held]) \
        if held else devices or ('@numpy',)
    try:
        with Stop(name, event=False) as stop, frames_released(), \
                DaskComm.rendezvous(name, rank, size,
                                    config.collective_timeout) as host:
            progress = RankDisplay(name, relay=rank == 0)
            comm = rank_comm(host, devices, progress)
            try:
                with chainer.using_device(chainer.get_device(devices[0])):
                    summary = run(config, comm=Stoppable(comm, stop),
                                  devices=devices, progress=progress)
            finally:
                if comm is not host:
                    comm.close()
            return RankResult(rank, ended=time.time(),
                              summary=summary if rank == 0 else None)
    finally:
        free_gpu_memory(gpu_ids(devices))  # before the next job gets them
        GpuPool.release(held)


# ------------------------------------------------- a rank of a launch

def _launched(config, callbacks, progress):
    """Train as one rank of ``dasktrain launch`` (its environment says
    who the others are): join them, train on this rank's devices
    (:func:`~dasktrain.parallel.placement.launched_devices`), rank 0
    holding ``config.out``, downloading the data first, showing the run
    and calling ``callbacks``; the others train silently beside it. The
    summary, with ``rank`` and ``ranks``."""
    if config.workers is not None:
        raise ScaleOutError(f'{argument("workers")} asks for ranks on Dask '
                            'workers, and this process is already a rank '
                            f'of dasktrain launch; leave {argument("workers")}'
                            ' out')
    host = join()
    try:
        lead = host.rank == 0
        # Ranks of one machine, in rank order: the GPUs launch shows them.
        intra, intra_size, _, _ = machine_place(
            host.allgather(host.machine), host.rank)
        seen = 0 if config.devices else len(gpu_ids(available_devices()))
        try:
            devices = launched_devices(config.devices, seen, intra,
                                       intra_size)
        except ValueError as e:
            raise ScaleOutError(f'{e} ({argument("devices")})') from None
        display = progress if lead else Progress(False, config.epochs)
        comm = rank_comm(host, devices, display) if host.size > 1 else host
        try:
            with prepare_out(config) if lead else contextlib.nullcontext():
                if lead:
                    _download(config)
                host.barrier()  # the data and OUT are there for every rank
                with chainer.using_device(chainer.get_device(devices[0])):
                    summary = run(config, comm=comm, devices=devices,
                                  callbacks=callbacks if lead else (),
                                  progress=display)
        finally:
            if comm is not host:
                comm.close()
        return dict(summary, rank=host.rank, ranks=host.size)
    finally:
        host.close()


# ------------------------------------------------------------ the driver

def _relay(progress, callbacks):
    """What the driver does with rank 0's events: shows them, and calls
    ``callbacks`` with each epoch's row."""
    def relay(event):
        kind = event['kind']
        if kind == 'say':
            progress.say(event['line'])
        elif kind == 'warning':
            progress.warn(event['line'])
        elif kind == 'start':
            progress.start(event['epoch'], event['iterations'])
        elif kind == 'step':
            progress.step(event['loss'], event['accuracy'],
                          done=event['done'])
        else:
            progress.end(event['row'])
            for callback in callbacks:
                callback(event['row'])
    return relay


def _drive(client, config, ranks, callbacks, progress):
    """Run the job's ranks until they end, again from the checkpoint after
    a lost worker; the summary of rank 0."""
    _send_files(client, config)
    if ranks is None:  # decided here, once: the cluster's workers say
        ranks = Ranks(config.workers, gpus_per_rank(
            config.devices, worker_info(client).values(),
            config.gpus_per_worker), config.devices)
    job = uuid.uuid4().hex[:8]

    def round_(want, attempt):  # want: (wanted, minimum, patience)
        workers = _choose(client, ranks, *want)
        name = f'dasktrain-{job}-{attempt}'
        each = ranks.config(config, attempt)
        infos = worker_info(client)
        with Driver(client, name, _relay(progress, callbacks),
                    [f'rank{r}' for r in range(len(workers))]) as driver:
            driver.start(
                _rank, [(each, name, r, len(workers), ranks.gpus,
                         naming_flags(), ranks.devices)
                        for r in range(len(workers))],
                workers, [rank_resources(ranks.gpus, infos[w])
                          for w in workers])
            return driver.watch()

    def replan(want, result):
        then = 'waiting for replacements, then ' \
            if config.on_worker_loss == 'wait' else ''
        logger.warning('worker(s) %s lost; %sresuming from the last '
                       'checkpoint', ', '.join(result.lost), then)
        if config.on_worker_loss == 'continue':
            return max(1, len(result.workers) - len(result.lost)), 1, want[2]
        return want[0], want[1], float('inf')
    result, attempt = go_on(round_, (ranks.count, ranks.count,
                                     config.collective_timeout), replan)
    if result.state is RunState.SUCCEEDED:
        summary = result.results[0].summary
        summary.update(attempts=attempt, workers=list(result.workers))
        return summary
    failure = result.failure
    raise failure.error or CollectiveError(
        f'rank {failure.rank} failed: {failure.why}')


def _choose(client, ranks, wanted, minimum, patience):
    """Addresses of up to ``wanted`` workers able to host a rank, once at
    least ``minimum`` are; ScaleOutError after ``patience`` seconds."""
    deadline = time.monotonic() + patience
    announced = False
    while True:
        able = able_workers(worker_info(client), ranks.gpus)
        if len(able) >= minimum:
            return able[:wanted]
        if time.monotonic() > deadline:
            raise ScaleOutError(
                f'{argument("workers")} {ranks.count} needs {minimum} Dask '
                'workers'
                f'{f" with {ranks.gpus} GPUs each" if ranks.gpus else ""}; '
                f'the cluster has {len(able)} after {patience:g} s; add '
                f'workers (`dask worker ADDRESS`) or lower '
                f'{argument("workers")}')
        if not announced:
            logger.warning('waiting for %d workers (have %d)', minimum,
                           len(able))
            announced = True
        time.sleep(1.0)
