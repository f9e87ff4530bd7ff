"""The job board: the latest summary of every job the scheduler has heard
of, kept from the Dask events jobs send on
:data:`~dasktrain.jobs.job.EVENTS` (queued, running, each epoch, the
end) and checked against the job files again when asked
(:meth:`JobBoard.fresh`); what the jobs page, the metrics, a shared
cluster's jobs table and ``dasktrain gpus`` read.
"""
import asyncio
import math
import os
import time

from distributed.diagnostics.plugin import SchedulerPlugin

from dasktrain.jobs.job import EVENTS, STATES, JobError, list_jobs, log_rows_of
from dasktrain.jobs.scheduler.outside_use import BOARD

SUMMARY_KEYS = {'id', 'folder', 'name', 'user', 'gpus', 'workers',
                'gpus_in_all', 'gpus_asked', 'epochs', 'submitted', 'state',
                'held', 'started', 'ended', 'row', 'epoch_seconds'}
FRESH = 2.0  # s: the files are read again at most this often


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def checked_summary(msg):
    """``msg`` (an event's) if it is a whole summary every reader can use:
    its keys, their types, a flat last row; None otherwise.

    >>> checked_summary({'id': 'x'}) is None
    True
    """
    if not isinstance(msg, dict) or not SUMMARY_KEYS <= msg.keys():
        return None
    strings = ('id', 'folder', 'name', 'user', 'gpus_asked')
    if not all(isinstance(msg[k], str) for k in strings) or \
            msg['state'] not in STATES + ('unreadable',) or \
            type(msg['gpus']) is not int or \
            type(msg['gpus_in_all']) is not int or \
            not _number(msg['submitted']) or \
            not isinstance(msg['held'], (list, tuple)) or \
            not all(v is None or _number(v) for v in (
                msg['started'], msg['ended'], msg['epoch_seconds'])) or \
            not (msg['epochs'] is None or type(msg['epochs']) is int) or \
            not (msg['workers'] is None or type(msg['workers']) is int):
        return None
    msg = dict(msg, held=[str(g) for g in msg['held']])
    if msg['row'] is not None:
        rows = log_rows_of([msg['row']])
        msg['row'] = rows[0] if rows else None
    for key in ('error', 'ending'):
        if msg.get(key) is not None and not isinstance(msg[key], str):
            msg[key] = str(msg[key])
    if type(msg.get('uid')) is not int:
        msg['uid'] = None
    return msg


class JobBoard(SchedulerPlugin):
    """The latest summary of every job the scheduler has heard of.

    Each event on :data:`~dasktrain.jobs.job.EVENTS` replaces the job's
    summary whole (a summary is a job's complete state, so no event depends
    on an earlier one), once checked (:func:`checked_summary`); the jobs
    dir is read at start for the jobs queued or run before this
    scheduler, and again by :meth:`fresh`: a job whose files cannot be
    read is one ``unreadable`` summary, a job purged is gone.
    """
    name = BOARD

    def __init__(self, jobs_dir=None):
        self.jobs_dir = jobs_dir
        self.read_at, self.reading = 0.0, None
        self.heard = {}  # {id: summary} told while a reading is under way
        self.jobs = self._read({})

    def log_event(self, topic, msg):
        # Whole summaries only: a scrape must never fail on a stray event.
        if topic == EVENTS:
            msg = checked_summary(msg)
            if msg is not None:
                self.jobs[msg['id']] = msg
                if self.reading is not None:
                    self.heard[msg['id']] = msg

    def summaries(self):
        """Every job, oldest first."""
        return sorted(self.jobs.values(), key=lambda j: j['submitted'])

    def _read(self, known):
        """Every job's summary from its files (in a thread): its request
        and recorded status, and its last log row as its events told it;
        where none did (a job of before this scheduler: a cluster
        restarted), as its log says, read as ``dasktrain jobs`` and the
        log route read it (bounded, a regular file of the job's user)."""
        found = {}
        for job in list_jobs(self.jobs_dir):
            try:
                before = known.get(job.id) or {}
                told = before.get('row') is not None
                summary = job.summary(rows=not told)
                if told:
                    summary['row'] = before['row']
                    summary['epoch_seconds'] = before.get('epoch_seconds')
            except JobError as e:  # damaged: one row that says why
                if not os.path.lexists(job.folder):  # purged meanwhile
                    continue
                summary = job.damaged(e)
            except Exception as e:  # never a reason to lose the others
                summary = job.damaged(f'{type(e).__name__}: {e}')
            found[job.id] = summary
        return found

    async def fresh(self, age=FRESH):
        """The summaries, read from the job files again if they were read
        more than ``age`` seconds ago (one reading at a time, in a
        thread: the scheduler's loop goes on meanwhile)."""
        if time.monotonic() - self.read_at > age:
            if self.reading is None:
                self.heard = {}
                self.reading = asyncio.ensure_future(
                    asyncio.to_thread(self._read, dict(self.jobs)))
                self.reading.add_done_callback(self._done)
            await asyncio.shield(self.reading)
        return self.summaries()

    def _done(self, reading):
        self.reading = None
        heard, self.heard = self.heard, {}
        if not reading.cancelled() and reading.exception() is None:
            # What an event told during the reading is newer than the
            # files it may have read before (a job queued meanwhile is
            # not lost); a job purged meanwhile stays gone.
            jobs = reading.result()
            for job_id, msg in heard.items():
                if job_id in jobs or os.path.isdir(msg['folder']):
                    jobs[job_id] = msg
            self.jobs = jobs
            self.read_at = time.monotonic()
