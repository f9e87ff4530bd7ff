"""Command jobs: any program queued like a training run,
``dasktrain submit --gpus K -- python train.py ...``: the submitter's side.

:func:`submit_command` records the program (argv), the submitter's working
directory and environment (PATH, the active virtualenv or conda, every
variable, plus ``env`` additions) in the job's private folder (0700, or a
shared cluster's root-only file: secrets in the environment are readable
by the submitter only) and queues it like a training job (a shared
cluster's through its front door, :mod:`~dasktrain.jobs.door`). On a worker,
:func:`dasktrain.jobs.worker.run_program` starts it under its keeper
(:mod:`dasktrain.keeper`, in a session of its own) in that directory,
with that environment and ``CUDA_VISIBLE_DEVICES`` set to exactly its GPUs
(none for 0), its output into ``output.log``. The exit code decides the
end: 0 ``finished``, else ``failed (exit 3)`` or ``failed (killed by
SIGKILL)``. A cancel sends SIGTERM to every process of the job, then
SIGKILL after ``grace`` seconds, and says which; nothing the program
started outlives the job, nor its worker. A program whose worker died
under it is ``lost`` (Dask would start it again from scratch elsewhere),
unless it was submitted with ``requeue=True``, for programs that resume
themselves.

Owns submitting command jobs; the queue and the records are
:mod:`~dasktrain.jobs.submit`'s and :mod:`~dasktrain.jobs.records`'; running
every job :mod:`~dasktrain.jobs.worker`'s.
"""
import os
import re
from types import SimpleNamespace

from dasktrain.cluster.local import connect
from dasktrain.errors import argument
from dasktrain.jobs.door import front_door
from dasktrain.jobs.folders import PROGRAM, create, me
from dasktrain.jobs.records import Job, JobError, jobs_dir
from dasktrain.jobs.submit import (
    after_ids,
    check_owner,
    check_resources,
    durations,
    queue,
    queue_options,
)
from dasktrain.notify import check_target

KIND = PROGRAM  # job.json's kind of a command job


def check_argv(argv):
    """The program's argv as a list of strings; JobError if it is empty."""
    if isinstance(argv, str) or not argv or \
            not all(isinstance(a, str) for a in argv):
        raise JobError(f'a command job needs a program and its arguments as '
                       f'a list of strings, got {argv!r}')
    return list(argv)


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


def submit_command(argv, gpus=0, name=None, env=None, cwd=None, grace=30.0,
                   requeue=False, client=None, scheduler=None, path=None,
                   notify=None, after=None, after_any=False, time=None,
                   time_limit=None):
    """Queue a program; returns at once with its
    :class:`~dasktrain.jobs.records.Job`.

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
    grace : float, default 30
        Seconds between a cancel's SIGTERM and its SIGKILL.
    requeue : bool, default False
        Start it again if its worker dies (for programs that resume
        themselves); otherwise it ends ``lost``.
    notify : str, optional
        Told when it ends (state, time, exit code): a webhook URL or
        ``mailto:ADDR``; default the cluster's. See
        :mod:`dasktrain.jobs.endings`.
    after, after_any, time, time_limit
        Its place in the queue: as :func:`dasktrain.jobs.submit.submit`'s.

    Examples
    --------
    >>> job = submit_command(['python', 'train.py', '--epochs', '3'],
    ...                      gpus=1)  # doctest: +SKIP
    >>> job.result()['state']  # doctest: +SKIP
    'finished'
    """
    door = None if client is not None else front_door(scheduler, path)
    request = command_request(argv, gpus, name, env, cwd, grace, requeue,
                              notify, time, time_limit)
    if door is not None:
        return door.submit(dict(request, after=after_ids(after),
                                after_any=bool(after_any)))
    options = queue_options(jobs_dir(path), after, after_any, time,
                            time_limit)
    owned = client is None
    client = client or connect(scheduler)
    try:
        check_owner(client)
        check_resources(client, SimpleNamespace(workers=None), gpus)
        job_id, folder, spec = create(jobs_dir(path).resolve(), request,
                                      options, me(), client.scheduler.address)
        job = Job(job_id, folder)
        job.announce(client)
        queue(client, folder, spec)
        return job
    finally:
        if owned:
            client.close()


def command_request(argv, gpus=0, name=None, env=None, cwd=None, grace=30.0,
                    requeue=False, notify=None, time=None, time_limit=None):
    """What a command job's submitter decides, checked in their process:
    the program, their folder (made absolute) and their environment as
    it is now, plus ``env``. The request
    :func:`dasktrain.jobs.folders.create` takes, and the front door."""
    argv = check_argv(argv)
    notify = check_target(notify)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise JobError(f'{argument("gpus")} must be an int >= 0, got '
                       f'{gpus!r}')
    if not (isinstance(grace, (int, float)) and grace >= 0):
        raise JobError(f'{argument("grace")} must be seconds >= 0, got '
                       f'{grace!r}')
    cwd = os.path.abspath(cwd or os.getcwd())
    if not os.path.isdir(cwd):
        raise JobError(f'the job would run in {cwd}, which is not a folder')
    return {'kind': KIND, 'name': name, 'gpus': gpus, 'notify': notify,
            **durations(time, time_limit), 'command': argv, 'cwd': cwd,
            'grace': float(grace), 'requeue': bool(requeue),
            'env': dict(os.environ, **(env or {}))}


def describe(spec):
    """A command job's program, for listings."""
    return ' '.join(spec.get('command') or ())
