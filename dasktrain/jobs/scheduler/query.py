"""The scheduler's answer about jobs, asked from any process that reaches
its Dask: Dask's task states, and the queue's view of each job it holds
(position, waiting reason, estimates), as
:func:`~dasktrain.jobs.scheduler.dispatch.answer` gives it on the
scheduler: :func:`scheduler_answer`, :func:`scheduler_states`,
:func:`ask_scheduler` (None when it does not answer in time) and
:class:`SchedulerPoller` (``jobs --watch``: never blocks a refresh). It
changes nothing.
"""
import threading

from dasktrain.cluster.local import connect
from dasktrain.jobs.scheduler.dispatch import answer


def scheduler_answer(keys, client):
    """What the scheduler knows of each job key: ``{key: {'task': Dask's
    task state, or 'held' while the queue holds it, 'position', 'reason',
    'start', 'end', 'overdue': the queue's view}}`` (see
    :func:`~dasktrain.jobs.scheduler.dispatch.answer`); a key it does not
    hold is missing."""
    return client.run_on_scheduler(answer, keys=list(keys))


def scheduler_states(keys, client):
    """What the scheduler knows of each job key ('no-worker', 'held',
    ...)."""
    return {k: v['task'] for k, v in scheduler_answer(keys, client).items()}


def ask_scheduler(keys, address, timeout=3):
    """What the scheduler at ``address`` knows of ``keys``
    (:func:`scheduler_answer`), if it answers within ``timeout`` seconds;
    None when it does not.

    Examples
    --------
    >>> ask_scheduler([job.key], job.spec().scheduler)  # doctest: +SKIP
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
    >>> poller.ask([job.key], job.spec().scheduler)  # doctest: +SKIP
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
