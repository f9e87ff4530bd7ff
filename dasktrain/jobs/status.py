"""What the scheduler knows of jobs, in the jobs table's words: a task
state read for a job (:func:`scheduler_view`), the jobs table's rows
from the job files and the scheduler's answer (:func:`job_rows`), and the
running jobs ``dasktrain gpus`` shows (:func:`running_jobs`): for a
cluster of your own and for a shared cluster's socket alike. It changes
nothing, and asks no one: the answer is given to it (``ask``, see
:func:`dasktrain.jobs.scheduler.query.ask_scheduler`).
"""
from dasktrain.jobs.job import DONE, JobError, list_jobs

HELD = 'held'  # the task state of a job the queue holds (no Dask task yet)


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
