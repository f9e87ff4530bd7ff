"""The one rank driver: a job of N ranks on a Dask cluster, for ``train``'s
ranks (:mod:`~dasktrain.run.train`) and ``dasktrain launch``'s
(:mod:`~dasktrain.run.launch`) alike.

:class:`Driver` starts one long Dask task per rank (a rank body: the
training loop in the worker's thread, or a program under its keeper),
relays the events the ranks send on the job's topic to the caller in
order, in the caller's thread, and watches the tasks until they end:
:meth:`Driver.watch` says whether they all finished, a worker they were
pinned to is gone, or a rank failed; then the one to blame, the first
failure that is not only a lost peer's echo (a broken connection, a
collective timeout), once the others have had :data:`SETTLE` seconds to
show theirs. :meth:`Driver.stop` sets the job's stop flag (a Dask
Event); each rank notices it through :class:`Stop`, a rank's own watch
that also notices its task cancelled. What to do with an outcome (resume
from a checkpoint, an exit status) is the caller's.
"""
import logging
import queue
import threading
import time
from typing import NamedTuple

from dasktrain.parallel.comm.base import ECHO_PHRASES

logger = logging.getLogger(__name__)

POLL = 0.1  # s between looks at the ranks' tasks and events
SETTLE = 1.0  # s after a first failure for the root one to show
PATIENCE = 5.0  # s an echo of a lost peer waits for its cause
# A failure for a lost peer, by its class in a traceback or its words.
ECHOES = ('PeerLost', 'CollectiveError', 'CommClosedError',
          'StreamClosed') + ECHO_PHRASES


class Outcome(NamedTuple):
    """How a job of ranks ended: ``kind`` 'done' (``value``: each rank's
    result), 'lost' (the addresses of its workers that are gone),
    'failed' (the :class:`Failure` to blame) or 'interrupted' (its
    driver was told to stop them)."""
    kind: str
    value: object


class Failure(NamedTuple):
    """A rank that failed: its ``rank``, the ``error`` its task raised
    (None where it returned a failure, or its task was lost), its
    ``result`` (a dict, or None), ``seen``, when it ended, and ``why``
    where its task was lost or cancelled."""
    rank: int
    error: BaseException | None
    result: dict | None
    seen: float
    why: str | None = None

    def echo(self):
        """Whether it only failed because a peer was gone."""
        from dasktrain.parallel.comm import CollectiveError
        if isinstance(self.error, CollectiveError):
            return True
        last = (self.result or {}).get('last') or ''
        return any(name in last for name in ECHOES)


def blame(failures):
    """The failure to name: the first to end that is not a peer's echo.

    >>> a = Failure(0, None, {'last': 'PeerLost: rank 1'}, 1.0)
    >>> b = Failure(1, None, {'last': 'ValueError: x'}, 2.0)
    >>> blame([a, b]).rank
    1
    >>> c = Failure(1, None, {'last': 'dasktrain train: error: rank 0 '
    ...             'closed its connection during a barrier: its worker '
    ...             'died or its training failed'}, 1.0)
    >>> d = Failure(0, None, {'last': 'error: OUT holds a run'}, 2.0)
    >>> blame([c, d]).rank  # the one line of a rank whose peer went
    0
    """
    return min(failures, key=lambda f: (f.echo(), f.seen))


def stop_event(client, name):
    """The Dask Event that tells job ``name``'s ranks to stop."""
    from distributed import Event
    return Event(f'{name}-stop', client=client)


class Stop:
    """A rank's watch: set once the driver cancels the rank's task or
    (with ``event``) stops the job (its stop Event), noticed every
    ``every`` seconds in a daemon thread of the rank's; :meth:`is_set`
    costs nothing.

    Examples
    --------
    >>> with Stop(name) as stop:  # doctest: +SKIP
    ...     while not stop.is_set(): ...
    """

    def __init__(self, name, every=0.5, event=True):
        from distributed import get_worker
        from distributed.worker import thread_state
        self.worker, self.key = get_worker(), thread_state.key
        self.event = stop_event(self.worker.client, name) if event \
            else None
        self.every, self.done = every, threading.Event()
        self.set = threading.Event()
        threading.Thread(target=self._watch, daemon=True,
                         name=f'dasktrain-stop-{self.key}').start()

    def is_set(self):
        return self.set.is_set()

    def cancelled(self):
        task = self.worker.state.tasks.get(self.key)
        return task is None or task.state == 'cancelled'

    def _watch(self):
        while not self.done.is_set() and not self.set.is_set():
            try:
                if self.cancelled() or (self.event is not None and
                                        self.event.is_set()):
                    self.set.set()
            except Exception:  # the scheduler gone: the job is over
                self.set.set()
            self.done.wait(self.every)

    def close(self):
        self.done.set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Driver:
    """The driver of job ``name``'s ranks on ``client``'s cluster (see the
    module); ``relay(event)`` gets each event a rank sends, in order.
    Used as a context manager: on exit the ranks are stopped and
    cancelled, and the Dask Variables named ``{name}/...`` in ``variables``
    deleted."""

    def __init__(self, client, name, relay, variables=()):
        self.client, self.name, self.relay = client, name, relay
        self.variables = list(variables)
        self.inbox = queue.SimpleQueue()
        self.futures, self.workers = [], []

    def __enter__(self):
        # Pushed to us as they come: polling get_events would fetch the
        # topic's whole log (up to 1,000 events) at every look.
        self.client.subscribe_topic(self.name, self.inbox.put)
        return self

    def __exit__(self, *exc):
        from distributed import Variable
        try:
            self.relay_events()
        finally:
            self.client.unsubscribe_topic(self.name)
            self.stop(0)
            for name in self.variables:
                try:
                    Variable(f'{self.name}/{name}',
                             client=self.client).delete()
                except Exception:  # the scheduler gone: nothing to delete
                    pass

    def start(self, body, args, workers, resources):
        """One task ``body(*args[rank])`` per rank, pinned to its worker of
        ``workers`` (None: anywhere), holding ``resources[rank]`` (Dask's
        resources, or None)."""
        self.workers = list(workers)
        for rank, worker in enumerate(self.workers):
            placed = {} if worker is None else {
                'workers': [worker], 'allow_other_workers': False}
            self.futures.append(self.client.submit(
                body, *args[rank], key=f'{self.name}-rank{rank}',
                resources=resources[rank], pure=False, retries=0, **placed))
        return self.futures

    def relay_events(self):
        """Relay every event received so far, in order."""
        while True:
            try:
                _, event = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.relay(event)

    def watch(self, failed=None, interrupt=None):
        """Relay the ranks' events until their tasks end; an
        :class:`Outcome`. ``failed(result)``: whether a rank that returned
        ``result`` failed (default: none that returns does);
        ``interrupt()``, called at every look: whether to stop watching
        now (the ranks are the caller's to stop)."""
        from dasktrain.cluster.local import worker_info
        failures, first = {}, None
        while True:
            self.relay_events()
            if interrupt is not None and interrupt():
                return Outcome('interrupted', None)
            states = [f.status for f in self.futures]
            now = time.monotonic()
            for rank, future in enumerate(self.futures):
                if rank in failures or states[rank] == 'pending':
                    continue
                if states[rank] in ('lost', 'cancelled'):
                    failures[rank] = Failure(
                        rank, None, None, now,
                        f'its Dask task was {states[rank]}')
                elif states[rank] == 'error':
                    failures[rank] = Failure(rank, future.exception(), None,
                                             now)
                elif failed is not None and failed(future.result()):
                    failures[rank] = Failure(rank, None, future.result(),
                                             now)
            if all(s == 'finished' for s in states) and not failures:
                return Outcome('done', [f.result() for f in self.futures])
            pinned = [w for w in self.workers if w is not None]
            if pinned:
                alive = set(worker_info(self.client))
                lost = [w for w in pinned if w not in alive]
                if lost:
                    return Outcome('lost', lost)
            if failures:
                first = first or now
                ended = all(s != 'pending' for s in states)
                roots = [f for f in failures.values() if not f.echo()]
                if ended or now - first > PATIENCE or \
                        (roots and now - first >= SETTLE):
                    return Outcome('failed', blame(failures.values()))
            time.sleep(POLL)

    def stop(self, within):
        """Tell the ranks to stop, wait up to ``within`` seconds for their
        tasks to end, then cancel those that have not."""
        if not self.futures:
            return
        try:
            stop_event(self.client, self.name).set()
        except Exception:  # the scheduler gone: the ranks go with it
            pass
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and \
                any(f.status == 'pending' for f in self.futures):
            time.sleep(POLL)
        self.client.cancel(self.futures, force=True)
        try:
            stop_event(self.client, self.name).clear()
        except Exception:
            pass
