"""Submitting a job, in the submitter's process: :func:`submit` (a
training run), :func:`submit_command` (any program,
``dasktrain submit -- PROGRAM ARGS``), both through :func:`queue_request`.

The request (:class:`~dasktrain.jobs.request.JobRequest`) is made and
checked here, as the submitter (their files read, their folder and
environment recorded), then handed to the queue
:func:`~dasktrain.jobs.client.route.shared_queue` names: a shared
cluster's socket, whose server writes the job's folder, or the cluster
of your own: its folder written here
(:func:`~dasktrain.jobs.folder.create`) and the job handed to its
scheduler's queue (:func:`~dasktrain.jobs.scheduler.dispatch.queue`),
which starts it in order as one task holding its GPUs. The job returns
at once; everything about it is then read from its folder (or asked of
the socket): :class:`~dasktrain.jobs.job.Job`.
"""
import os
import re

from dasktrain.cluster.local import connect, read_state, worker_info
from dasktrain.containment import Containment
from dasktrain.errors import argument
from dasktrain.jobs.client.route import shared_queue
from dasktrain.jobs.folder import create, me
from dasktrain.jobs.job import Job, JobError, jobs_dir, user_name
from dasktrain.jobs.request import JobRequest, Program, Training
from dasktrain.jobs.scheduler.dispatch import queue
from dasktrain.jobs.worker.gpu_use import UNUSABLE_METRIC


def submit(config, gpus=1, name=None, client=None, scheduler=None,
           path=None, check=True, notify=None, after=None, after_any=False,
           time=None, time_limit=None, module=None, extra=None, mem=None):
    """Queue a training job; returns at once with its
    :class:`~dasktrain.jobs.job.Job`.

    Parameters
    ----------
    config : TrainConfig
        The run; ``out`` is replaced by the job's own folder.
    gpus : int, default 1
        GPUs the job reserves (0: one ``CPU`` slot). If ``config.devices``
        names devices itself (e.g. ``('@numpy',)``), those are used. With
        ``config.workers`` set, GPUs per rank: the job is a gang of that
        many ranks, each holding ``gpus`` on a worker of its own, placed
        at once by the queue (:mod:`~dasktrain.jobs.worker.gang`).
    name : str, optional
        A label for listings; default the model's name.
    client : distributed.Client, optional
        Default: connect to ``scheduler`` or the recorded cluster; with
        neither (nor ``path``), a shared cluster's socket where you have
        no cluster of your own (see :mod:`dasktrain.jobs.client.route`).
    scheduler : str, optional
        The scheduler's address, when no ``client`` is given.
    path : str, optional
        Jobs dir; must be on storage every worker sees.
    check : bool, default True
        Refuse a job no worker can run; False queues it regardless (until
        such a worker joins), as a search does once it has checked.
    notify : str, optional
        Told when the job ends: a webhook URL (Slack-compatible JSON is
        POSTed) or ``mailto:ADDR`` (with a local MTA); default the
        cluster's (``cluster start --notify``), if any. See
        :mod:`dasktrain.jobs.end_notice`.
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
    mem : str or int, optional
        Memory its processes may use together (``'8G'``, bytes): the
        ``memory.max`` of its cgroup, refused where the cluster cannot
        cap memory (``dasktrain cluster status`` says).
    module, extra : optional
        The ``dasktrain`` module the job's program runs (``python -m
        MODULE FOLDER``; default :data:`dasktrain.jobs.record.TRAIN_JOB`) and
        more keys for its ``job.json``: a search's trials (see
        :mod:`dasktrain.tuning.trials`).

    Examples
    --------
    >>> config = TrainConfig(model='tiny', epochs=2)
    >>> job = submit(config, gpus=0)  # doctest: +SKIP
    >>> job.result()['final']['epoch']  # doctest: +SKIP
    2
    """
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
        raise JobError(f'gpus must be an int >= 0, got {gpus!r}')
    program = Training.of(config, module=module or Training.module,
                          extra=extra)
    request = JobRequest.of(program, gpus, name, notify, after, after_any,
                            time, time_limit, mem)
    return queue_request(request, client, scheduler, path, check)


def parse_env(items):
    """``KEY=VALUE`` strings (``--env``) as a dict; JobError for others.

    >>> parse_env(['A=1', 'B=x=y'])
    {'A': '1', 'B': 'x=y'}
    """
    env = {}
    for item in items or ():
        key, sep, value = item.partition('=')
        if not sep or not re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*', key):
            raise JobError(f'{argument("env")} takes KEY=VALUE, got '
                           f'{item!r}')
        env[key] = value
    return env


def submit_command(argv, gpus=0, name=None, env=None, cwd=None, grace=None,
                   requeue=False, client=None, scheduler=None, path=None,
                   notify=None, after=None, after_any=False, time=None,
                   time_limit=None, mem=None):
    """Queue a program; returns at once with its
    :class:`~dasktrain.jobs.job.Job`.

    It runs in its submitter's folder and environment (as they are now),
    with ``CUDA_VISIBLE_DEVICES`` set to exactly its GPUs, under its
    keeper: a cancel stops every process it started (SIGTERM, then
    SIGKILL after ``grace`` seconds); its exit code decides its end (0
    ``finished``, else ``failed``); a worker that dies under it leaves it
    ``lost``, unless ``requeue``.

    Parameters
    ----------
    argv : list of str
        The program and its arguments (no shell: pass ``['sh', '-c',
        '...']`` for one).
    gpus : int, default 0
        GPUs it holds, seen as ``CUDA_VISIBLE_DEVICES`` 0..K-1 (0: a CPU
        slot, no GPU visible).
    name : str, optional
        A label for listings; default the program's name.
    env : dict, optional
        Variables added to the submitter's environment as it is now.
    cwd : str, optional
        Where it runs; default the working directory, made absolute.
    grace : float, optional
        Seconds between a cancel's SIGTERM and its SIGKILL; default the
        cluster's longest (``cluster start --max-grace``, default 30). A
        cluster refuses more than its longest.
    requeue : bool, default False
        Start it again if its worker dies (for programs that resume
        themselves); otherwise it ends ``lost``.
    notify, after, after_any, time, time_limit, mem, client, scheduler, path
        As :func:`submit`'s.

    Examples
    --------
    >>> job = submit_command(['python', 'train.py', '--epochs', '3'],
    ...                      gpus=1)  # doctest: +SKIP
    >>> job.result()['state']  # doctest: +SKIP
    'finished'
    """
    program = Program.of(argv, env, cwd, grace, requeue)
    request = JobRequest.of(program, gpus, name, notify, after, after_any,
                            time, time_limit, mem)
    return queue_request(request, client, scheduler, path)


def queue_request(request, client=None, scheduler=None, path=None,
                  check=True):
    """Queue the checked ``request``: through a shared cluster's socket
    where :func:`~dasktrain.jobs.client.route.shared_queue` says so (never
    with ``client``), else on ``client``'s cluster (default
    ``scheduler``'s, else the recorded one) with its folder in the jobs
    dir ``path``; its :class:`~dasktrain.jobs.job.Job`."""
    door = None if client is not None else shared_queue(scheduler, path)
    if door is not None:
        return door.submit(request)
    root = jobs_dir(path)
    request.check_after(root)
    owned = client is None
    client = client or connect(scheduler)
    try:
        check_owner(client)
        check_limits(client, request)
        if check:
            check_resources(client, request)
        job_id, folder, spec = create(root.resolve(), request, me(),
                                      client.scheduler.address)
        job = Job(job_id, folder)
        # Before the task: the scheduler sees 'queued' before 'running'.
        job.announce(client)
        queue(client, folder, spec)
        return job
    finally:
        if owned:
            client.close()


def check_limits(client, request):
    """Refuse a job asking for a memory limit (``mem``) that the recorded
    cluster of ``client`` cannot enforce (no cgroup v2 memory
    controller): a limit nobody holds to is worse than none."""
    if request.mem is None:
        return
    state = read_state()
    if not state or state.get('scheduler') != client.scheduler.address or \
            not state.get('contain'):
        return  # not the recorded cluster: its worker says
    problem = Containment(**state['contain']).limit_problem(mem=request.mem)
    if problem:
        raise JobError(f'{argument("mem")}: {problem}')


def check_resources(client, request):
    """Refuse a job no worker of ``client``'s cluster can ever run (see
    :meth:`~dasktrain.jobs.request.JobRequest.check_fits`), saying where
    a worker's GPUs go unused because CuPy cannot use them.

    Examples
    --------
    >>> check_resources(client, request)  # doctest: +SKIP
    JobError: no worker has 3 GPUs (largest: 2 among 1 worker); ...
    """
    workers = worker_info(client)
    request.check_fits(
        {addr: w.get('resources', {}) for addr, w in workers.items()},
        {addr: (w.get('metrics') or {}).get(UNUSABLE_METRIC)
         for addr, w in workers.items()})


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
