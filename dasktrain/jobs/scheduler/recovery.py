"""Jobs a scheduler lost, and jobs of a cluster that stops: nothing is
left ``queued`` or ``running`` forever.

A job's task lives in its scheduler's memory. When the scheduler dies
(killed, a machine restarted) the job folder still says ``queued`` or
``running`` and nothing will ever run it: :func:`orphans` finds such jobs
(their scheduler is unreachable or no longer holds their task),
:func:`requeue` hands one to a running cluster (a training job resumes
from its checkpoint), :func:`recover` does both for a jobs dir (what
``cluster start`` runs), and :func:`settle` records what becomes of a
cluster's jobs when it is stopped on purpose. :func:`lost_reason` says
why a job can no longer finish, for ``result --wait`` and
``logs --follow``.
"""
import os
import stat
import time

from dasktrain.files import write_json
from dasktrain.jobs.job import (
    DONE,
    JobError,
    current_user,
    list_jobs,
    update_status,
)
from dasktrain.jobs.scheduler.dispatch import queue
from dasktrain.jobs.scheduler.query import ask_scheduler

# What `cluster stop` does with the jobs still queued or running on it.
STOP_POLICIES = ('cancel', 'requeue', 'wait')


def live_jobs(path=None, scheduler=None, anyone=False):
    """This user's jobs (everyone's with ``anyone``: a shared cluster's)
    that are queued or running (on ``scheduler`` only, when given);
    unreadable folders are skipped."""
    found, me = [], current_user()
    for job in list_jobs(path):
        try:
            spec, state = job.spec(), job.recorded()['state']
        except JobError:
            continue
        if state in DONE or not (anyone or spec.user == me):
            continue
        if scheduler is None or spec.scheduler == scheduler:
            found.append(job)
    return found


def orphans(jobs, ask=ask_scheduler):
    """The jobs among ``jobs`` whose scheduler is unreachable or no longer
    holds their task; ``ask(keys, address)`` as
    :func:`~dasktrain.jobs.scheduler.query.ask_scheduler` (one question per
    scheduler)."""
    by_address = {}
    for job in jobs:
        try:
            address = job.spec().scheduler
        except JobError:  # damaged meanwhile: not ours to requeue
            continue
        by_address.setdefault(address, []).append(job)
    lost = []
    for address, group in by_address.items():
        known = ask([j.key for j in group], address) if address else None
        lost += [j for j in group if known is None or j.key not in known]
    return lost


def requeue(job, client):
    """Hand ``job`` to the scheduler of ``client`` again: queued anew (a
    training job resumes from its checkpoint), recorded in its files.
    A finished job is refused (JobError)."""
    spec = reset(job, client.scheduler.address)
    job.announce(client)
    queue(client, job.folder, spec)


def reset(job, address):
    """``job``'s files made queued anew on the scheduler at ``address``
    (what :func:`requeue` and a shared cluster's socket server hand to
    the queue); its spec. JobError for a finished job."""
    status = job.recorded()
    if status['state'] == 'finished':
        raise JobError(f'job {job.id} finished; nothing to requeue')
    spec = dict(job.spec().data, scheduler=address)
    (job.folder / 'cancel').unlink(missing_ok=True)
    path = job.folder / 'job.json'
    write_json(path, spec, mode=stat.S_IMODE(os.stat(path).st_mode))
    update_status(job.folder, state='queued', ended=None, error=None,
                  gpus=None, worker=None)
    return spec


def recover(client, path=None, ask=ask_scheduler, anyone=False):
    """Requeue on ``client``'s cluster every live job of this user (of
    every user with ``anyone``: a shared cluster's) in the jobs dir
    ``path`` that its scheduler lost; returns ``(requeued, [(job,
    why not)])``: a job whose files cannot be read is left as it is."""
    lost, failed = orphans(live_jobs(path, anyone=anyone), ask), []
    for job in list(lost):
        try:
            requeue(job, client)
        except JobError as e:
            lost.remove(job)
            failed.append((job, str(e)))
    return lost, failed


def settle(jobs, policy, timeout=None, poll=0.5):
    """What becomes of ``jobs`` (queued or running on a cluster being
    stopped) under ``policy``: 'cancel' records them cancelled, 'requeue'
    leaves them queued for the next ``cluster start`` (which
    :func:`recover` s them), 'wait' returns once they ended (or after
    ``timeout`` seconds, None: no limit). Call 'cancel' and 'requeue'
    once the cluster's processes are gone (a dying worker must not write
    after). A job that ended meanwhile keeps its end, and one whose folder
    is gone meanwhile (a finished job purged, ``--keep-finished``) is left
    out. Returns {job id: state}."""
    if policy not in STOP_POLICIES:
        raise ValueError(f'policy must be one of {STOP_POLICIES}, got '
                         f'{policy!r}')
    if policy == 'wait':
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(_state(j) in ('queued', 'running') for j in jobs):
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(poll)
        return {j.id: _state(j) for j in jobs}
    for job in jobs:
        if _state(job) not in ('queued', 'running'):
            continue  # it ended while the cluster stopped: as it ended
        try:
            if policy == 'cancel':
                update_status(job.folder, state='cancelled',
                              ended=time.time(),
                              error='the cluster was stopped (`dasktrain '
                                    f'requeue {job.id}` runs it again)')
            else:
                update_status(job.folder, state='queued', gpus=None,
                              worker=None, error='the cluster was stopped; '
                              'requeued at the next `dasktrain cluster '
                              'start`')
        except FileNotFoundError:  # purged meanwhile
            continue
    return {j.id: _state(j) for j in jobs if j.folder.is_dir()}


def _state(job):
    """``job``'s recorded state ('unreadable' where its files cannot be
    read: a state it never leaves by waiting)."""
    try:
        return job.recorded()['state']
    except JobError:
        return 'unreadable'



def lost_reason(job, ask=ask_scheduler):
    """Why ``job`` (queued or running) can no longer finish, or None while
    its scheduler still holds it (its ``lost_reason``: a shared cluster's
    job asks its socket)."""
    return job.lost_reason(ask)

