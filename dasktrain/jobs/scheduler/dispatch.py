"""The queue's dispatcher: a scheduler plugin that starts the jobs
:func:`~dasktrain.jobs.scheduler.policy.plan` says to start, in order,
and keeps what it decided about the others (position, waiting reason,
estimates) for ``dasktrain jobs`` and the jobs page.

Every job handed to the scheduler (:func:`enqueue`) is held here, not as
a Dask task: every :data:`TICK` seconds the :class:`Dispatcher` reads its
queued and running jobs' files, the workers' GPUs (their ``GPU``
resource, and where their heartbeats carry
:func:`~dasktrain.jobs.worker.gpu_use.worker_use`'s reading, their
``CUDA_VISIBLE_DEVICES`` entries and the GPUs busy outside the queue, by
:func:`~dasktrain.jobs.scheduler.outside_use.busy_outside`: what
``dasktrain gpus`` shows), plans, and hands each job to start to Dask as
one task (:func:`~dasktrain.jobs.worker.task.run_job`) on the planned
worker, with the planned GPU ids. A job across workers is a gang: it
starts once its ranks' workers and GPUs are free at once; its task (the
driver, holding no GPU) is told where they are, and the queue counts
those GPUs as the job's until it ends. A task holds the job's Dask
resources, so a worker that dies under it has Dask rerun it elsewhere.
The files are small and few (a lab's queue): reading them on the
scheduler's loop takes milliseconds. Nothing here is the only copy: the
job files are, and a scheduler that restarts gets its jobs back from
``cluster start``'s recovery (:mod:`~dasktrain.jobs.scheduler.recovery`),
in their submission order.

It also ends what must end: a job whose ``--after`` dependency failed
(without ``--after-any``) fails with one line, and a job past its
``--time-limit`` is stopped (its worker's cancel path, with the reason);
and every :data:`PURGE` seconds, in a thread, it removes the jobs that
ended longer ago than the cluster keeps them (``--keep-finished``).

A job whose files cannot be read (whatever they hold: see
:mod:`dasktrain.files`) is left out of the plan, held, and said once in
the log, not at every tick; the others are planned as if it were not
there.
"""
import asyncio
import logging
import os
import time
from pathlib import Path

from distributed.diagnostics.plugin import SchedulerPlugin

from dasktrain.cluster.settings import keep_finished
from dasktrain.errors import argument
from dasktrain.jobs.job import (
    DONE,
    EVENTS,
    KEY_PREFIX,
    Job,
    JobError,
    jobs_dir,
    purge_ended,
    row_number,
    update_status,
)
from dasktrain.jobs.scheduler.outside_use import busy_outside
from dasktrain.jobs.scheduler.policy import plan
from dasktrain.jobs.status import HELD
from dasktrain.jobs.worker.gpu_use import USE_METRIC
from dasktrain.jobs.worker.task import run_job
from dasktrain.parallel.outside import worker_ids

logger = logging.getLogger(__name__)

NAME = 'dasktrain-queue'
TICK = 1.0  # seconds between two plans (and at once after a submit)
# A running job's out/log (its user's) is read again at most this often.
LOG_STALE = 10.0
PURGE = 60.0  # s between two purges of ended jobs


def enqueue(dask_scheduler, folder):
    """Run on the scheduler (``client.run_on_scheduler(enqueue,
    folder=...)``): hold the job in ``folder`` in the queue, installing
    the :class:`Dispatcher` first on a scheduler without it."""
    installed(dask_scheduler).enqueue(folder)


def queue(client, folder, spec):
    """Hand the job in ``folder`` (its ``job.json`` is ``spec``) to
    ``client``'s scheduler: held in the queue's order by its
    :class:`Dispatcher` (installed there if missing), which starts it as
    one task, a job across workers included."""
    client.run_on_scheduler(enqueue, folder=str(folder))


def set_user_limit(client, max_gpus_per_user):
    """Let one user's jobs hold at most ``max_gpus_per_user`` GPUs at once
    on ``client``'s cluster (None: no limit); the others wait, "user limit
    reached". ``cluster start --max-gpus-per-user K`` calls it.

    Examples
    --------
    >>> set_user_limit(client, 2)  # doctest: +SKIP
    """
    limit = max_gpus_per_user
    if limit is not None and not (type(limit) is int and limit >= 1):
        raise JobError(f'{argument("max_gpus_per_user")} must be an int '
                       f'>= 1, got {limit!r}')
    client.run_on_scheduler(configure, max_gpus_per_user=limit)


def configure(dask_scheduler, max_gpus_per_user):
    """Run on the scheduler: :func:`set_user_limit`'s change."""
    installed(dask_scheduler).limit = max_gpus_per_user


def installed(dask_scheduler):
    """The scheduler's :class:`Dispatcher`, added and started first where
    it has none (a scheduler without dasktrain's preload)."""
    plugin = dask_scheduler.plugins.get(NAME)
    if plugin is None:
        plugin = Dispatcher()
        dask_scheduler.add_plugin(plugin, name=NAME)
    plugin.attach(dask_scheduler)
    return plugin


def answer(dask_scheduler, keys):
    """Run on the scheduler: ``{key: {'task': state, ...}}`` for each job
    key it holds: Dask's task state, or :data:`HELD` for a job still in
    the queue, with the dispatcher's ``position``, ``reason``, ``start``,
    ``end`` and ``overdue`` where it has them."""
    plugin = dask_scheduler.plugins.get(NAME)
    found = {}
    for key in keys:
        job_id = key[len(KEY_PREFIX):]
        view = dict(plugin.view.get(job_id, {})) if plugin else {}
        if key in dask_scheduler.tasks:
            found[key] = dict(view, task=dask_scheduler.tasks[key].state)
        elif plugin is not None and job_id in plugin.folders:
            found[key] = dict(view, task=HELD)
    return found


class Dispatcher(SchedulerPlugin):
    """The queue on the scheduler (see the module): ``folders`` {job id:
    folder} of the jobs held, ``running`` {job id: (folder, [(worker, GPU
    ids)] of each rank, its task's Dask resources)} of those it started
    that may still hold their GPUs, ``view`` {job id: what it last
    decided about it}."""
    name = NAME

    def __init__(self, max_gpus_per_user=None):
        self.limit = max_gpus_per_user
        self.folders, self.running, self.view = {}, {}, {}
        self.scheduler = self.client = self.callback = None
        self.ticking = self.again = False
        self.told = {}  # {job id or '': the last complaint logged}
        self.purged_at, self.purging = time.monotonic(), None

    def complain(self, job_id, error):
        """Log ``error`` about ``job_id`` ('' for the queue itself) once,
        not once per tick: again only when it changes. None clears it."""
        if error is None:
            self.told.pop(job_id, None)
            return
        if self.told.get(job_id) != error:
            self.told[job_id] = error
            logger.warning('dasktrain queue: %s%s', f'{job_id}: ' if job_id
                           else '', error)

    async def start(self, scheduler):
        self.attach(scheduler)

    def attach(self, scheduler):
        """Start planning every :data:`TICK` s on ``scheduler``'s loop
        (once)."""
        if self.callback is not None:
            return
        from tornado.ioloop import PeriodicCallback
        self.scheduler = scheduler
        self.callback = PeriodicCallback(self.tick, TICK * 1000)
        self.callback.start()

    async def close(self):
        if self.callback is not None:
            self.callback.stop()
        if self.client is not None:
            await self.client.close()

    def enqueue(self, folder):
        job_id = Path(folder).name
        self.folders[job_id] = str(folder)
        self.running.pop(job_id, None)
        if self.scheduler is not None:  # plan now, not a tick later
            self.scheduler.loop.add_callback(self.tick)

    async def tick(self):
        if self.ticking:  # a submit meanwhile: planned again at once
            self.again = True
            return
        self.ticking = True
        try:
            self.again = True
            while self.again:
                self.again = False
                await self._tick()
            self.complain('', None)
        except Exception as e:  # never expected: logged once, not per tick
            if self.told.get('') != repr(e):
                logger.exception('dasktrain queue: planning failed')
            self.told[''] = repr(e)
        finally:
            self.ticking = False

    def purge(self):
        """Start removing the jobs ended longer ago than the cluster keeps
        them, in a thread (one purge at a time)."""
        keep = keep_finished()
        if keep is None or self.purging is not None or \
                time.monotonic() - self.purged_at < min(PURGE, keep / 4):
            return
        self.purged_at = time.monotonic()
        roots = {jobs_dir()} | {Path(f).parent for f in self.folders.values()}

        def purge():
            return [i for root in roots for i in purge_ended(root, keep)]

        def done(future):
            self.purging = None
            if future.exception() is not None:
                self.complain('', f'purging ended jobs: {future.exception()}')
            elif future.result():
                logger.info('dasktrain queue: purged %d ended job(s): %s',
                            len(future.result()),
                            ', '.join(future.result()[:20]))
        self.purging = asyncio.ensure_future(asyncio.to_thread(purge))
        self.purging.add_done_callback(done)

    async def _tick(self):
        self.purge()
        now = time.time()
        # The queued jobs' files are read in a thread: with thousands
        # queued, reading them on the scheduler's loop held every other
        # request (another user's ping, a worker's heartbeat) for 0.1 s
        # each second.
        folders = dict(self.folders)
        queued, states, gone, told = await asyncio.to_thread(
            _queued, folders)
        for job_id in gone:  # unless queued again meanwhile
            if self.folders.get(job_id) == folders[job_id]:
                del self.folders[job_id]
        for job_id, error in told.items():
            self.complain(job_id, error)
        self._unpin()
        workers, busy = self._workers()
        running = self._running(now, workers)
        running += self._others(workers, running)
        decided = plan(queued, running, workers, now, busy, self.limit,
                       states)
        view = {}
        for job_id, estimate in decided.estimates.items():
            view[job_id] = dict(estimate,
                                reason=decided.reasons.get(job_id))
        self.view = view
        for job_id, why in decided.ends.items():
            self._end(job_id, why, now)
        placed = {}  # a gang's ranks, in order
        for job_id, worker, gpus in decided.starts:
            placed.setdefault(job_id, []).append((worker, gpus))
        for job_id, ranks in placed.items():
            await self._start(job_id, ranks, queued)

    def _running(self, now, workers):
        running = []
        for job_id in list(self.running):
            try:
                running += self._holding(job_id, now, workers)
                self.complain(job_id, None)
            except Exception as e:  # still holds what it was given
                self.complain(job_id, f'its files cannot be read ({e}); '
                                      'it keeps what it was given')
                folder, placed, resources = self.running[job_id]
                running += [{'id': job_id, 'user': '', 'worker': w,
                             'held': list(g), 'gpus': len(g), 'end': None,
                             'own_task': resources is None}
                            for w, g in placed]
        return running

    def _holding(self, job_id, now, workers):
        """What the running job ``job_id`` holds, for the planner ([] once
        it holds nothing)."""
        folder, placed, _ = self.running[job_id]
        job = Job(job_id, Path(folder))
        spec, status = job.spec(), job.recorded()
        task = self.scheduler.tasks.get(KEY_PREFIX + job_id)
        over = task is None or task.state in ('memory', 'erred', 'forgotten')
        # Its GPUs are free once its task is over and it ended (a cancelled
        # task is forgotten at once, its program may take its grace to
        # stop), or its task failed, or its worker is gone.
        where = status.get('worker') or placed[0][0]
        if over and (status['state'] in DONE or task is not None and
                     task.state == 'erred' or
                     where not in self.scheduler.workers):
            del self.running[job_id]
            return []
        started = status.get('started')
        limit = spec.time_limit
        common = {
            'id': job_id, 'user': spec.user or '', 'gpus': spec.gpus,
            'end': estimated_end(job, spec, status, now),
            'due': started + spec.time if started and spec.time else None,
            'limit': started + limit if started and limit else None}
        ids = status.get('gpus') or []
        # Its GPUs as the worker names them, where the queue knows those
        # names; else as the queue planned them.
        known = workers.get(where, {}).get('gpus', ())
        if not ids or not set(ids) <= set(known):
            ids = placed[0][1]
        return [dict(common, worker=w, held=held, own_task=own)
                for w, held, own in spec.holding(placed, where, ids)]

    def _workers(self):
        """The workers' GPUs by the ids jobs get, and the GPUs busy
        outside the queue (``cluster start --busy-mib``), both from each
        worker's last reading of who uses its GPUs."""
        workers = {}
        for address, ws in list(self.scheduler.workers.items()):
            use = (ws.metrics or {}).get(USE_METRIC)
            workers[address] = {
                'gpus': worker_ids(use, int(ws.resources.get('GPU', 0))),
                'cpus': int(ws.resources.get('CPU', 0))}
        busy = {address: outside for address, outside in
                busy_outside(self.scheduler).items()
                if outside and address in workers}
        return workers, busy

    def _unpin(self):
        """Let Dask rerun anywhere that fits a started job whose worker
        died: its task is pinned to that worker, and Dask's loose
        restrictions do not apply beside resource ones (it would wait in
        ``no-worker`` for ever). A training job then resumes from its
        checkpoint, a command job is told it was lost, as before the
        queue."""
        live = set(self.scheduler.workers)
        for job_id in list(self.running):
            key = KEY_PREFIX + job_id
            task = self.scheduler.tasks.get(key)
            if task is None or task.state != 'no-worker' or \
                    not task.worker_restrictions or \
                    task.worker_restrictions & live:
                continue
            self.scheduler.set_restrictions({key: None})
            self.scheduler.transitions(
                {key: 'processing'}, stimulus_id=f'dasktrain-queue-{key}')

    def _others(self, workers, running):
        """GPUs Dask tasks hold that the queue did not start (a scale-out
        job's ranks queue for theirs as tasks), as running jobs of unknown
        end: the queue never hands them out twice."""
        others = []
        for address, ws in list(self.scheduler.workers.items()):
            # a gang's ranks hold theirs as Dask tasks of their own
            ours = sum(r['gpus'] for r in running if r['worker'] == address
                       and (r.get('own_task') or
                            self._task_on(r['id']) is ws))
            extra = int(ws.used_resources.get('GPU', 0)) - ours
            if extra <= 0:
                continue
            taken = {g for r in running if r['worker'] == address
                     for g in r['held']}
            free = [g for g in workers[address]['gpus'] if g not in taken]
            held = free[-extra:]
            others.append({'id': f'other Dask tasks on {address}',
                           'user': '', 'gpus': len(held), 'worker': address,
                           'held': held, 'end': None})
        return others

    def _task_on(self, job_id):
        task = self.scheduler.tasks.get(KEY_PREFIX + job_id)
        return None if task is None else task.processing_on

    async def _start(self, job_id, placed, queued):
        """Hand the job to Dask as one task: on its planned worker with its
        planned GPUs; a gang's (its driver's, holding no GPU) with where
        its ranks go."""
        from distributed import fire_and_forget
        folder = self.folders[job_id]
        job = next(j for j in queued if j['id'] == job_id)
        client = await self._client()
        future = client.submit(run_job, folder, placed,
                               key=KEY_PREFIX + job_id, pure=False,
                               workers=[placed[0][0]],
                               allow_other_workers=True,
                               resources=job['resources'])
        fire_and_forget(future)  # runs on without this client's interest
        # Held until handed over: a failure above leaves it queued here.
        del self.folders[job_id]
        self.running[job_id] = (folder, placed, job['resources'])
        # Its end from now on, not from the next plan: its --time counts
        # from now until its worker records its start.
        self.view[job_id] = {'end': job['time'] and time.time() + job['time'],
                             'overdue': False, 'reason': None}
        logger.info('dasktrain queue: %s starts on %s', job_id, ', '.join(
            f'{w} (GPUs {",".join(g) or "none"})' for w, g in placed))

    async def _client(self):
        if self.client is None:
            from distributed import Client
            self.client = await Client(
                self.scheduler.address, asynchronous=True,
                security=client_security(self.scheduler.security),
                set_as_default=False, name='dasktrain-queue')
        return self.client

    def _end(self, job_id, why, now):
        if job_id in self.running:  # its time limit: stopped as a cancel is
            folder = Path(self.running[job_id][0])
            if not (folder / 'cancel').exists():
                (folder / 'cancel').write_text(why)
            return
        folder = Path(self.folders.pop(job_id))
        update_status(folder, state='failed', ended=now, error=why)
        try:
            self.scheduler.log_event(EVENTS, Job(job_id, folder).summary())
        except Exception:  # monitoring never stops the queue
            pass


def client_security(security):
    """The TLS settings of a client inside the scheduler process, from the
    scheduler's own (its certificate serves as a client's too); None
    without TLS."""
    cert = getattr(security, 'tls_scheduler_cert', None)
    if not cert:
        return None
    from distributed.security import Security
    return Security(tls_ca_file=security.tls_ca_file, tls_client_cert=cert,
                    tls_client_key=security.tls_scheduler_key,
                    require_encryption=True)


def _queued(folders):
    """The jobs of ``folders`` ({id: folder}) still queued, in submission
    order, as the planner wants them; the states of the jobs they run
    after; the ids no longer queued; ``{id: complaint or None}``. A job
    whose files cannot be read is left out of this plan (logged once) and
    stays held: the others are planned as if it were not there. Reads
    files only (it runs in a thread)."""
    queued, states, gone, told = [], {}, [], {}
    for job_id, folder in folders.items():
        job = Job(job_id, Path(folder))
        try:
            spec, status = job.spec(), job.recorded()
            told[job_id] = None
            if status['state'] != 'queued' or \
                    (job.folder / 'cancel').exists():
                gone.append(job_id)
                continue
            after = list(spec.after)
            for dep in after:
                states.setdefault(dep, _state(job.folder.parent / dep))
            queued.append({'id': job_id, 'user': spec.user or '',
                           'gpus': spec.gpus, 'after': after,
                           'ranks': spec.workers,
                           'after_any': spec.after_any, 'time': spec.time,
                           'submitted': spec.submitted,
                           'resources': spec.task_resources()})
        except Exception as e:  # JobError: its files; anything else
            told[job_id] = f'left out of the plan: {e}'
    queued.sort(key=lambda j: j['submitted'])
    return (queued, {k: v for k, v in states.items() if v is not None},
            gone, told)


def _state(folder):
    try:
        return Job(Path(folder).name, Path(folder)).recorded()['state']
    except JobError:
        return None


def estimated_end(job, spec, status, now):
    """When a running job is expected to end (seconds since the epoch;
    None: unknown): a training job from its measured epoch times (mean
    over the epochs logged, from the log's last write), any job from its
    ``--time`` after its start otherwise (after ``now`` while its worker
    has not yet recorded its start).

    Examples
    --------
    >>> estimated_end(job, job.spec(), {'started': 100.0},
    ...               now=200.0)  # doctest: +SKIP
    3700.0
    """
    rows = job.log_rows(stale=LOG_STALE)
    epochs = spec.epochs
    elapsed = row_number(rows[-1], 'elapsed_time') if rows else None
    if epochs and elapsed:
        per_epoch = elapsed / max(rows[-1]['epoch'], 1)
        try:  # never a symlink's target (a user's out/ in a shared cluster)
            written = os.lstat(job.folder / 'out' / 'log').st_mtime
        except OSError:
            written = now
        return written + per_epoch * max(epochs - rows[-1]['epoch'], 0)
    planned = spec.time
    return (status.get('started') or now) + planned if planned else None
