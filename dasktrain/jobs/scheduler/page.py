"""The live jobs page: a read-only view of the queue and of each job's loss
and accuracy curves, on the Dask scheduler's web server.

Three GET routes, added by :func:`add_routes` (the scheduler's preload,
:mod:`~dasktrain.jobs.scheduler.preload`, calls it): ``/dasktrain/jobs``
(the page), ``/dasktrain/api/jobs`` (every job's summary from the job
board) and
``/dasktrain/api/jobs/<id>/log`` (a known job's ``out/log``, ChainerUI's
format, cut to the curves' keys). The page polls the two every
:data:`POLL_MS` and draws with SVG.

The page itself is package data: ``page.html``, whose ``{script}`` is
``page.js``; then ``{nonce}`` and ``{poll}`` are filled in per response.

Nothing here acts on a job: any other method is refused (405). The page
holds no data when served; its script puts every job's fields into the
document as text (``textContent``, never HTML), control characters
escaped, and a per-response nonce in its Content-Security-Policy keeps
any other script from running.

Whoever reaches the dashboard's port sees the page, without a login. So
a ``private`` one (a shared cluster's) shows what anyone may see of any
job (:data:`PRIVATE_FIELDS`: id, name, user, state, GPUs, worker,
times, the queue's estimates), nothing of its output: no progress,
accuracy, curves (the log route answers 404) nor error; each user sees
those of their own jobs with ``dasktrain jobs``, ``logs`` and ``result``.
"""
import functools
import json
import math
import secrets
from importlib import resources
from pathlib import Path

from tornado.web import HTTPError, RequestHandler

from dasktrain.jobs.job import Job

POLL_MS = 2000
CURVE_KEYS = ('epoch', 'main/loss', 'validation/main/loss', 'main/accuracy',
              'validation/main/accuracy')
PUBLIC = ('id', 'name', 'user', 'state', 'ending', 'gpus', 'workers',
          'gpus_asked', 'held', 'worker', 'epochs', 'submitted', 'started',
          'ended', 'error', 'attempts', 'row')
PATH = '/dasktrain/jobs'
# What a private page shows of every job.
PRIVATE_FIELDS = ('id', 'name', 'user', 'state', 'ending', 'gpus',
                  'workers', 'gpus_asked', 'held', 'worker', 'submitted',
                  'started', 'ended', 'attempts')
QUEUE = ('position', 'reason', 'start', 'end', 'overdue')  # the queue's


def add_routes(application, board, queue=None, private=False):
    """Serve the page and its data from ``application`` (a tornado
    Application: the scheduler's ``http_application``); ``board`` holds
    the jobs' summaries (``summaries()`` and ``jobs``, by id); ``queue``
    (a :class:`~dasktrain.jobs.scheduler.dispatch.Dispatcher`, optional)
    what the queue last decided of each job (``view``: position, waiting
    reason, estimated start or end); ``private``: show nothing of a
    job's output (see the module).

    Examples
    --------
    >>> add_routes(scheduler.http_application, board)  # doctest: +SKIP
    """
    args = {'board': board, 'queue': queue, 'private': private}
    application.add_handlers(r'.*$', [
        (PATH, PageHandler, args),
        (r'/dasktrain/api/jobs', JobsHandler, args),
        (r'/dasktrain/api/jobs/([^/]+)/log', LogHandler, args),
    ])


@functools.cache
def page_template():
    """``page.html`` with ``page.js`` in its script; ``{nonce}`` and
    ``{poll}`` still to fill in."""
    files = resources.files(__package__)
    html = files.joinpath('page.html').read_text(encoding='utf-8')
    return html.replace('{script}', files.joinpath('page.js')
                        .read_text(encoding='utf-8'))


def _clean(value):
    """``value`` with non-finite floats as None: JSON has no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class _Handler(RequestHandler):
    def initialize(self, board, queue=None, private=False):
        self.board, self.queue, self.private = board, queue, private

    def set_default_headers(self):
        self.set_header('Cache-Control', 'no-store')
        self.set_header('X-Content-Type-Options', 'nosniff')
        self.set_header('X-Frame-Options', 'DENY')

    def send_json(self, value):
        self.set_header('Content-Type', 'application/json; charset=UTF-8')
        self.finish(json.dumps(_clean(value), allow_nan=False))


class JobsHandler(_Handler):
    async def get(self):
        view = self.queue.view if self.queue is not None else {}
        fields = PRIVATE_FIELDS if self.private else PUBLIC
        fresh = getattr(self.board, 'fresh', None)
        jobs = await fresh() if fresh else self.board.summaries()
        self.send_json({'private': self.private, 'jobs': [
            {**{k: job.get(k) for k in fields},
             **{k: view.get(job['id'], {}).get(k) for k in QUEUE}}
            for job in jobs]})


class LogHandler(_Handler):
    def get(self, job_id):
        job = self.board.jobs.get(job_id)
        if job is None or self.private:
            raise HTTPError(404)
        # Not trained an epoch yet, mid-rename, or not a regular file of
        # the job's user (a symlink planted in a shared cluster): none.
        rows = Job(job_id, Path(job['folder'])).log_rows()
        self.send_json([{k: r.get(k) for k in CURVE_KEYS}
                        for r in rows if isinstance(r, dict)])


class PageHandler(_Handler):
    def get(self):
        nonce = secrets.token_urlsafe(16)
        self.set_header('Content-Security-Policy', (
            "default-src 'none'; connect-src 'self'; style-src "
            f"'unsafe-inline'; script-src 'nonce-{nonce}'; base-uri 'none';"
            " form-action 'none'; frame-ancestors 'none'"))
        self.set_header('Content-Type', 'text/html; charset=UTF-8')
        self.finish(page_template().replace('{nonce}', nonce)
                    .replace('{poll}', str(POLL_MS)))
