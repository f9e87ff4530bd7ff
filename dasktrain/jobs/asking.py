"""Asking the scheduler what it knows of jobs: Dask's task states, and the
queue's view of each job it holds (position, waiting reason, estimates):
:func:`scheduler_answer`, :func:`scheduler_states`, :func:`ask_scheduler`,
:class:`SchedulerPoller` (``jobs --watch``), and :func:`scheduler_view`,
what a task state means in the jobs table's words; :func:`job_rows`, the
jobs table's rows from the job files and that answer, and
:func:`running_jobs`, the running jobs ``dasktrain gpus`` shows (both
for a cluster of your own and for a shared cluster's front door).

Owns asking only: it changes nothing on the scheduler or in a job's
files.
"""
import threading

from dasktrain.cluster.local import connect
from dasktrain.jobs.dispatch import HELD, answer
from dasktrain.jobs.records import DONE, JobError, list_jobs


def scheduler_answer(keys, client):
    """What the scheduler knows of each job key: ``{key: {'task': Dask's
    task state, or 'held' while the queue holds it, 'position', 'reason',
    'start', 'end', 'overdue': the queue's view}}`` (see
    :func:`~dasktrain.jobs.dispatch.answer`); a key it does not hold is
    missing."""
    return client.run_on_scheduler(answer, keys=list(keys))


def scheduler_states(keys, client):
    """What the scheduler knows of each job key ('no-worker', 'held',
    ...)."""
    return {k: v['task'] for k, v in scheduler_answer(keys, client).items()}


def scheduler_view(state, task):
    """What the scheduler's ``task`` state (None: it holds no such task)
    means for a job whose files say ``state``, in the jobs table's words.

    Examples
    --------
    >>> scheduler_view('queued', 'processing')  # on a worker, starting
    'starting'
    >>> scheduler_view('queued', 'no-worker')
    'no worker fits'
    >>> scheduler_view('running', None)
    'lost: dasktrain requeue'
    >>> scheduler_view('queued', 'held')  # in the queue, in order
    'queued'
    """
    if task is None:
        return 'lost: dasktrain requeue'
    if task == HELD:
        return 'queued'
    if task == 'processing':
        return 'starting' if state == 'queued' else 'running'
    return {'no-worker': 'no worker fits', 'queued': 'waiting',
            'waiting': 'waiting', 'released': 'waiting',
            'memory': 'ended', 'erred': 'ended',
            'forgotten': 'ended'}.get(task, task)


def ask_scheduler(keys, address, timeout=3):
    """What the scheduler at ``address`` knows of ``keys``
    (:func:`scheduler_answer`), if it answers within ``timeout`` seconds;
    None when it does not.

    Examples
    --------
    >>> ask_scheduler([job.key], job.spec()['scheduler'])  # doctest: +SKIP
    {'dasktrain-job-tiny-20250101-120000-1a2b3c': {'task': 'held', ...}}
    """
    try:
        with connect(address, timeout=timeout) as client:
            return scheduler_answer(keys, client)
    except Exception:  # unreachable: the files alone still tell
        return None


class SchedulerPoller:
    """``jobs --watch``'s view of the scheduler: one client for the whole
    watch, asked in a daemon thread, so that neither a slow connect nor a
    scheduler that stopped answering delays a refresh or Ctrl-C.

    :meth:`ask` never blocks: it returns the last answer (``{}`` until the
    first, None while unreachable) and names the keys for the next one.

    Examples
    --------
    >>> poller = SchedulerPoller(interval=2.0)  # doctest: +SKIP
    >>> poller.ask([job.key], job.spec()['scheduler'])  # doctest: +SKIP
    {'dasktrain-job-...': {'task': '-'}}
    >>> poller.stop()  # doctest: +SKIP
    """

    def __init__(self, interval):
        self.interval = interval
        # (keys asked, the scheduler's answer), or None while unreachable
        self.answer, self.wanted = (set(), {}), ([], None)
        self.stopped = threading.Event()
        self.client = None
        threading.Thread(target=self._poll, name='jobs-watch-scheduler',
                         daemon=True).start()

    def ask(self, keys, address):
        self.wanted = (keys, address)
        if self.answer is None:
            return None
        asked, known = self.answer
        # a job the scheduler was not asked about yet: '-', not 'unknown'
        return {k: known.get(k, {'task': 'unknown'}) if k in asked
                else {'task': '-'} for k in keys}

    def _poll(self):
        address = None
        while not self.stopped.is_set():
            keys, wanted = self.wanted
            try:
                if keys and (self.client is None or wanted != address):
                    self._close()
                    address = wanted
                    self.client = connect(address, timeout=3)
                if keys:
                    self.answer = (set(keys),
                                   scheduler_answer(keys, self.client))
            except Exception:  # unreachable: the files alone still tell
                self.answer = None
                self._close()
            self.stopped.wait(self.interval)
        self._close()

    def _close(self):
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close(timeout=1)
            except Exception:  # already gone: nothing to close
                pass

    def stop(self):
        self.stopped.set()


def job_rows(jobs_dir=None, ask=None):
    """The jobs table's rows, oldest first: ``(rows, unreadable)``, each
    row a dict (``id``, ``name``, ``user``, ``state`` (and ``ending``,
    how a finished job ended, where it says: a stop command's), ``gpus``,
    ``progress``, ``accuracy``, ``submitted``, ``started``, ``ended``,
    ``seen``: what the scheduler knows in words, ``view``: the queue's
    position, reason and estimates), and ``[(id, reason)]`` of the job
    folders that cannot be read (one bad folder hides no other).

    ``ask(keys, address)`` says what the scheduler at ``address`` knows
    of those job keys (None: unreachable); without it the rows come from
    the job folders only."""
    jobs, unreadable = [], []
    for job in list_jobs(jobs_dir):
        try:
            jobs.append((job, job.spec(), job.status()))
        except JobError as e:
            unreadable.append((job.id, str(e)))
    live = [(j, spec) for j, spec, s in jobs if s['state'] not in DONE]
    known = {}
    if live and ask is not None:
        known = ask([j.key for j, _ in live], live[0][1].get('scheduler'))
    rows = []
    for job, spec, s in jobs:
        view = (known or {}).get(job.key) or {}
        rows.append({
            'id': job.id, 'name': str(spec.get('name', '-')),
            'user': str(spec.get('user', '-')), 'state': s['state'],
            'ending': s.get('ending'),
            'gpus': ','.join(s['gpus']) if s.get('gpus') else
            str(spec.get('gpus', '-')),
            'progress': f"{s['epoch']}/{s['epochs']}" if s['epochs']
            else '-', 'accuracy': s['accuracy'],
            'submitted': spec['submitted'], 'started': s.get('started'),
            'ended': s.get('ended'),
            'seen': '-' if s['state'] in DONE else 'unreachable'
            if known is None else scheduler_view(s['state'],
                                                 view.get('task')),
            'view': {k: v for k, v in view.items() if k != 'task'}})
    return rows, unreadable


def running_jobs(jobs_dir, address, board):
    """Summaries of the running jobs on the scheduler at ``address``: the
    monitor's (``board``), with those the jobs dir holds."""
    found = {j['id']: j for j in board if j.get('state') == 'running'}
    for job in list_jobs(jobs_dir):
        try:
            summary = job.summary()
            if summary['state'] == 'running' and \
                    job.spec().get('scheduler') == address:
                found[job.id] = summary
        except JobError:
            continue
    return list(found.values())
