"""Checking and queueing a training job on the scheduler.

:func:`submit` checks what the submitter asked for in their own process
(:func:`training_request`: the config, their model and data files read
as bytes), then either hands that request to a shared cluster's front
door (:mod:`~dasktrain.jobs.door`, where you have no cluster of your
own), or writes the job's folder (:func:`dasktrain.jobs.folders.create`)
and hands one task (:func:`~dasktrain.jobs.worker.run_job`) to the
scheduler's queue (:mod:`~dasktrain.jobs.dispatch`), which starts it in
order as one task holding K GPUs. Cancelling is the job's own
(:meth:`~dasktrain.jobs.records.Job.cancel`), requeueing a lost job
:mod:`~dasktrain.jobs.recover`'s.
What the scheduler knows of jobs is :mod:`~dasktrain.jobs.asking`'s.

Owns the submitter's side only: it never runs a job (that is
:mod:`~dasktrain.jobs.worker`'s).
"""
import json
import os
from pathlib import Path

from dasktrain.cluster.local import connect, worker_info
from dasktrain.data.datasets import resolve_spec
from dasktrain.data.datasets import spec_file as dataset_file
from dasktrain.errors import argument
from dasktrain.jobs.dispatch import enqueue
from dasktrain.jobs.door import front_door
from dasktrain.jobs.folders import create, me
from dasktrain.jobs.protocol import NO_WORKERS
from dasktrain.jobs.queue import parse_time
from dasktrain.jobs.records import (
    KEY_PREFIX,
    Job,
    JobError,
    jobs_dir,
    user_name,
)
from dasktrain.jobs.worker import run_job
from dasktrain.notify import check_target
from dasktrain.parallel.gpus import GpuError, place_devices
from dasktrain.userspec import is_spec, spec_file


def check_resources(client, config, gpus):
    """Refuse a job no worker of ``client``'s cluster can ever run: more
    GPUs (or CPU slots, for ``gpus=0``) than any worker offers.

    Examples
    --------
    >>> check_resources(client, TrainConfig(), gpus=3)  # doctest: +SKIP
    JobError: no worker has 3 GPU (largest: 2 among 1 workers); ...
    """
    check_fits({addr: w.get('resources', {})
                for addr, w in worker_info(client).items()},
               config.workers, gpus)


def check_fits(resources, workers, gpus):
    """:func:`check_resources` on the workers' ``resources`` (``{address:
    {'GPU': n, 'CPU': m}}``) for a job of ``gpus`` (per rank, with
    ``workers`` ranks; None: one)."""
    resource = 'GPU' if gpus else 'CPU'
    need = max(gpus, 1)
    have = {addr: r.get(resource, 0) for addr, r in resources.items()}
    if workers is not None:
        able = sum(1 for n in have.values() if n >= gpus)
        if able < workers:
            each = f'{gpus} GPUs' if gpus else 'a CPU slot'
            raise JobError(f'{argument("workers")} {workers} needs as '
                           f'many Dask workers with {each}; the cluster has '
                           f'{able}; add workers or lower '
                           f'{argument("workers")}')
    elif not have or max(have.values()) < need:
        largest = max(have.values(), default=0)
        slots = sum(r.get('CPU', 0) for r in resources.values())
        instead = (f'pass {argument("gpus")} 0 to take one of the {slots:g} '
                   f'CPU slot{"s" * (slots != 1)} the workers offer, '
                   if gpus and slots else 'ask for fewer, ')
        raise JobError(f'no worker has {need} {resource} (largest: '
                       f'{largest:g} among {len(have)} workers); '
                       f'{instead}or add a worker with `dask worker '
                       f'ADDRESS --resources {resource}={need}`')


def check_devices(config, gpus):
    """Refuse, at submit time, a job whose own --devices name GPUs other
    than the ones it reserves (the cluster picks which GPUs a job gets).

    Examples
    --------
    >>> check_devices(TrainConfig(devices=('@cupy:2', '@cupy:3')), gpus=2)
    >>> check_devices(TrainConfig(devices=('@cupy:0',)), gpus=0)
    Traceback (most recent call last):
    ...
    dasktrain.jobs.records.JobError: --devices 0 names 1 GPU(s) but 0 were...
    """
    if config.workers is not None and \
            config.gpus_per_worker not in (None, gpus):
        raise JobError(f'{argument("gpus_per_worker")} '
                       f'{config.gpus_per_worker} contradicts '
                       f'{argument("gpus")} {gpus} (GPUs per worker of a '
                       f'job across workers): pass one of them')
    if config.devices is None:
        return
    try:  # with workers: per rank, each holding `gpus`
        place_devices(config.devices, range(gpus))
    except GpuError as e:
        raise JobError(str(e)) from None


def queue_options(root, after=None, after_any=False, time=None,
                  time_limit=None):
    """The queue's keys of a ``job.json`` (``after``, ``after_any``,
    ``time``, ``time_limit``), checked: every job ``after`` names exists in
    the jobs dir ``root``; durations are seconds or text such as ``2h``.
    JobError naming the argument otherwise.

    Examples
    --------
    >>> queue_options('/tmp/none', time='2h')
    {'after': [], 'after_any': False, 'time': 7200.0, 'time_limit': None}
    """
    after = after_ids(after)
    for dep in after:
        if not (Path(root) / dep / 'job.json').exists():
            raise JobError(f'{argument("after")}: no job {dep!r} in {root}; '
                           '`dasktrain jobs` lists them')
    if after_any and not after:
        raise JobError(f'{argument("after_any")} needs '
                       f'{argument("after")} ID[,ID]')
    return {'after': after, 'after_any': bool(after_any),
            **durations(time, time_limit)}


def durations(time=None, time_limit=None):
    """``{'time': s, 'time_limit': s}``: ``--time`` and ``--time-limit`` in
    seconds (None where not given); JobError naming the argument.

    >>> durations('2h')
    {'time': 7200.0, 'time_limit': None}
    """
    return {'time': None if time is None else parse_time(time, 'time'),
            'time_limit': None if time_limit is None else
            parse_time(time_limit, 'time_limit')}


def submit(config, gpus=1, name=None, client=None, scheduler=None,
           path=None, extra=None, check=True, notify=None, after=None,
           after_any=False, time=None, time_limit=None):
    """Queue a training job; returns at once with its
    :class:`~dasktrain.jobs.records.Job`.

    Parameters
    ----------
    config : TrainConfig
        The run; ``out`` is replaced by the job's own folder.
    gpus : int, default 1
        GPUs the job reserves (0: one ``CPU`` slot). If ``config.devices``
        names devices itself (e.g. ``('@numpy',)``), those are used. With
        ``config.workers`` set, GPUs per worker: the job's driver then
        holds no GPU and its ranks queue for theirs (see scaleout.py).
    name : str, optional
        A label for listings; default the model's name.
    client : distributed.Client, optional
        Default: connect to ``scheduler`` or the recorded cluster; with
        neither (nor ``path``), a shared cluster's front door where you
        have no cluster of your own (see :mod:`dasktrain.jobs.door`).
    scheduler : str, optional
        The scheduler's address, when no ``client`` is given.
    path : str, optional
        Jobs dir; must be on storage every worker sees.
    extra : dict, optional
        More keys for ``job.json``; ``'child'`` names the ``dasktrain``
        module the job's child process runs as ``python -m MODULE FOLDER``
        (default :data:`dasktrain.jobs.worker.CHILD`; a trial's reports to
        its study, see :mod:`dasktrain.tuning.trials`).
    check : bool, default True
        Refuse a job no worker can run; False queues it regardless (until
        such a worker joins), as a search does once it has checked.
    notify : str, optional
        Told when the job ends: a webhook URL (Slack-compatible JSON is
        POSTed) or ``mailto:ADDR`` (with a local MTA); default the
        cluster's (``cluster start --notify``), if any. See
        :mod:`dasktrain.jobs.endings`.
    after : list of str or str, optional
        Job ids (or ``'ID,ID'``) it starts after, once they finished.
    after_any : bool, default False
        Start after them whatever their end (failed, cancelled too);
        without it, a job they run after that did not finish fails this
        one with one line.
    time : str or float, optional
        How long it is expected to run (``2h``, ``45m``, seconds): its
        estimated end, and others' estimated starts; past it, ``jobs``
        flags it overdue.
    time_limit : str or float, optional
        How long it may run: stopped (and failed) once past.

    Examples
    --------
    >>> config = TrainConfig(model='tiny', epochs=2)
    >>> job = submit(config, gpus=0)  # doctest: +SKIP
    >>> job.result()['final']['epoch']  # doctest: +SKIP
    2
    """
    door = None if client is not None else front_door(scheduler, path)
    if door is not None and (config.workers is not None or extra):
        raise JobError(NO_WORKERS if config.workers is not None else
                       'a shared cluster runs no search\'s trials '
                       '(`dasktrain tune`): use a cluster of your own')
    request = training_request(config, gpus, name, notify, time, time_limit)
    if door is not None:
        return door.submit(dict(request, after=after_ids(after),
                                after_any=bool(after_any)))
    options = queue_options(jobs_dir(path), after, after_any, time,
                            time_limit)
    owned = client is None
    client = client or connect(scheduler)
    try:
        check_owner(client)
        if check:
            check_resources(client, config, gpus)
        job_id, folder, spec = create(
            jobs_dir(path).resolve(), request, options, me(),
            client.scheduler.address, extra)
        job = Job(job_id, folder)
        # Before the task: the scheduler sees 'queued' before 'running'.
        job.announce(client)
        queue(client, folder, spec)
        return job
    finally:
        if owned:
            client.close()


def after_ids(after):
    """``after`` (job ids, or ``'ID,ID'``) as a list of ids.

    >>> after_ids('a, b,'), after_ids(None)
    (['a', 'b'], [])
    """
    if isinstance(after, str):
        after = after.split(',')
    return [str(a).strip() for a in after or () if str(a).strip()]


def training_request(config, gpus=1, name=None, notify=None, time=None,
                     time_limit=None):
    """What a training job's submitter decides, checked in the
    submitter's process (as that user): the config with its user's model
    and data checked and made absolute, and their files read (a shared
    cluster's root never opens a file a user names). The request
    :func:`dasktrain.jobs.folders.create` takes, and the front door."""
    if not isinstance(gpus, int) or gpus < 0:
        raise JobError(f'gpus must be an int >= 0, got {gpus!r}')
    notify = check_target(notify)
    check_devices(config, gpus)
    times = durations(time, time_limit)
    if is_spec(config.model):  # the user's model: one line if wrong, here
        from dasktrain.training.models import resolve_model  # Chainer: now
        config = config.replace(model=resolve_model(config.model,
                                                    config.model_args))
    # The data: its spec checked and made absolute here (the job runs in
    # its own folder).
    config = config.replace(dataset=resolve_spec(config.dataset),
                            data_dir=os.path.abspath(config.data_dir))
    # A model file as it is now: editing it later changes no job.
    files = {}
    for key, source in (('model', spec_file(config.model)
                         if is_spec(config.model) else None),
                        ('dataset', dataset_file(config.dataset))):
        if source is not None:
            try:
                files[key] = (source.name, source.read_bytes())
            except OSError as e:
                raise JobError(f'cannot read {argument(key)} file {source} '
                               f'({e.strerror})') from None
    return {'kind': 'train', 'name': name, 'gpus': int(gpus),
            'notify': notify, **times,
            'config': json.loads(config.to_json()), 'files': files}


def _uid():
    return os.getuid()


def check_owner(client, uid=None):
    """Refuse a job the cluster could not run: its worker runs as the
    user who started the cluster (uid ``client``'s scheduler runs as)
    and must write the job's folder, which is private to its submitter
    (``uid``, default this process's). One cluster per user: see
    docs/security.md."""
    uid = os.getuid() if uid is None else uid
    try:
        owner = client.run_on_scheduler(_uid)
    except Exception:  # an older scheduler, a closed one: checked later
        return
    if owner != uid:
        name = user_name(owner)
        raise JobError(
            f'this cluster runs its jobs as {name}, not as you '
            f'({user_name(uid)}): it could not write your job\'s private '
            f'folder. Start a cluster of your own (`dasktrain cluster '
            f'start --port 0`), or ask {name} to submit it')


def queue(client, folder, spec):
    """Hand the job in ``folder`` (its ``job.json`` is ``spec``) to the
    scheduler: held in the queue's order by its
    :class:`~dasktrain.jobs.dispatch.Dispatcher` (installed there if
    missing), which starts it as one task. A scale-out job's driver needs
    a thread only (its ranks queue for their GPUs as Dask tasks): it is
    handed to Dask at once."""
    if not spec['workers']:
        client.run_on_scheduler(enqueue, folder=str(folder))
        return
    from distributed import fire_and_forget
    future = client.submit(run_job, str(folder), key=KEY_PREFIX + spec['id'],
                           pure=False)
    fire_and_forget(future)  # runs on after this client goes away
