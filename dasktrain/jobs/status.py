"""What the scheduler knows of jobs, in the jobs table's words: a task
state read for a job (:func:`scheduler_view`), the jobs table's rows
from the job files and the scheduler's answer (:func:`job_rows`), and the
running jobs ``dasktrain gpus`` shows (:func:`running_jobs`): for a
cluster of your own and for a shared cluster's socket alike. It changes
nothing, and asks no one: the answer is given to it (``ask``, see
:func:`dasktrain.jobs.scheduler.query.ask_scheduler`).
"""
import time

from dasktrain.jobs.job import DONE, JobError, list_jobs, row_number

HELD = 'held'  # the task state of a job the queue holds (no Dask task yet)
RECENT = 86400.0  # s: `jobs` shows the jobs that ended this recently
PER_PAGE = 100    # rows of one page of `jobs`
# What anyone may see of anyone's job; the rest (progress, accuracy, its
# error: what its program wrote or said) is its owner's and the
# cluster's owners'.
PUBLIC = ('id', 'name', 'user', 'state', 'ending', 'gpus', 'submitted',
          'started', 'ended', 'seen', 'view')


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
            if job.folder.is_dir():  # else purged meanwhile: gone
                unreadable.append((job.id, str(e)))
    live = [(j, spec) for j, spec, s in jobs if s['state'] not in DONE]
    known = {}
    if live and ask is not None:
        known = ask([j.key for j, _ in live], live[0][1].scheduler)
    rows = []
    for job, spec, s in jobs:
        view = (known or {}).get(job.key) or {}
        rows.append({
            'id': job.id, 'name': str(spec.name or '-'),
            'user': str(spec.user or '-'), 'state': s['state'],
            'ending': s.get('ending'),
            'gpus': ','.join(s['gpus']) if s.get('gpus') else
            str(spec.gpus),
            'progress': f"{s['epoch']}/{s['epochs']}" if s['epochs']
            else '-', 'accuracy': s['accuracy'],
            'submitted': spec.submitted, 'started': s.get('started'),
            'ended': s.get('ended'),
            'seen': '-' if s['state'] in DONE else 'unreachable'
            if known is None else scheduler_view(s['state'],
                                                 view.get('task')),
            'view': {k: v for k, v in view.items() if k != 'task'}})
    return rows, unreadable


def summary_rows(summaries, known=None):
    """The jobs table's rows (as :func:`job_rows` gives them, with each
    job's ``uid``) from the job board's ``summaries``, and ``[(id,
    reason)]`` of the jobs whose files cannot be read; ``known`` as
    :func:`job_rows`' ``ask`` answers (None: unreachable)."""
    rows, unreadable = [], []
    for s in summaries:
        if s['state'] == 'unreadable':
            unreadable.append((s['id'], s.get('error') or 'unreadable'))
            continue
        view = (known or {}).get('dasktrain-job-' + s['id']) or {}
        row = s.get('row') or {}
        epochs = s.get('epochs')
        rows.append({
            'id': s['id'], 'name': s['name'], 'user': s['user'],
            'uid': s.get('uid'), 'state': s['state'],
            'ending': s.get('ending'),
            'gpus': ','.join(s['held']) if s['held'] else str(s['gpus']),
            'progress': f"{row.get('epoch', 0)}/{epochs}" if epochs
            else '-',
            'accuracy': row_number(row, 'validation/main/accuracy'),
            'submitted': s['submitted'], 'started': s['started'],
            'ended': s['ended'],
            'seen': '-' if s['state'] in DONE else 'unreachable'
            if known is None else scheduler_view(s['state'],
                                                 view.get('task')),
            'view': {k: v for k, v in view.items() if k != 'task'}})
    return rows, unreadable


def public_row(row):
    """What anyone may see of a row of the jobs table (:data:`PUBLIC`).

    >>> public_row({'id': 'a', 'state': 'failed', 'progress': '3/9',
    ...             'accuracy': 0.9})['progress']
    '-'
    """
    return dict({k: row.get(k) for k in PUBLIC}, progress='-',
                accuracy=None)


def shown(rows, unreadable, everything=False, user=None, page=1,
          per_page=PER_PAGE, now=None):
    """The rows ``jobs`` shows: live jobs and those that ended in the last
    :data:`RECENT` seconds (``everything``: every job kept), of ``user``
    only where given, page ``page`` of ``per_page``; ``(rows, unreadable,
    counts)``, counts ``{'total', 'page', 'pages', 'older'}`` (``older``:
    ended jobs left out for their age).

    >>> rows = [{'id': str(i), 'user': 'a', 'state': 'finished',
    ...          'ended': 0.0} for i in range(3)]
    >>> shown(rows, [], now=10.0, per_page=2)[2]
    {'total': 3, 'page': 1, 'pages': 2, 'older': 0}
    >>> shown(rows, [], now=1e6)[2]['older']
    3
    """
    now = time.time() if now is None else now
    picked = [r for r in rows if user is None or r.get('user') == user]
    recent = [r for r in picked if everything or r['state'] not in DONE or
              r.get('ended') is None or r['ended'] >= now - RECENT]
    pages = max(1, -(-len(recent) // per_page))
    page = min(max(page, 1), pages)
    return (recent[(page - 1) * per_page:page * per_page],
            [] if user is not None else list(unreadable),
            {'total': len(recent), 'page': page, 'pages': pages,
             'older': len(picked) - len(recent)})


def running_jobs(jobs_dir, address, board):
    """Summaries of the running jobs on the scheduler at ``address``: the
    monitor's (``board``), with those the jobs dir holds."""
    found = {j['id']: j for j in board if j.get('state') == 'running'}
    for job in list_jobs(jobs_dir):
        try:
            summary = job.summary()
            if summary['state'] == 'running' and \
                    job.spec().scheduler == address:
                found[job.id] = summary
        except JobError:
            continue
    return list(found.values())
