"""THE rank driver: a job of N ranks, wherever they run, as torchrun has
one agent for every kind of worker. ``train``'s ranks
(:mod:`~dasktrain.run.train`: the training loop in a worker's thread),
``dasktrain launch``'s (:mod:`~dasktrain.run.launch`: a program under
its keeper, on a worker or started here) and a gang's (the ranks of a
training job across a cluster's workers,
:mod:`~dasktrain.jobs.worker.gang`) are all driven by :class:`Driver`;
where its ranks meet (their rendezvous) is the caller's.

:meth:`Driver.start` starts one long Dask task per rank (a rank body);
:meth:`Driver.start_here` starts each rank's program as a child of this
process instead (:class:`Child`: no worker to start, as ``mpiexec``
starts them). Either way the driver relays the events the ranks send on
the job's topic (a child's output too) to the caller in order, in the
caller's thread, and watches the ranks until they end:
:meth:`Driver.watch` says how, a :class:`RunResult` (as torchrun's
``RunResult``, its :class:`RunState` as its ``WorkerState``): all
succeeded, a worker they were pinned to is gone, or a rank failed (the
one to blame: the first failure that is not only a lost peer's echo, a
broken connection or a collective timeout, once the others have had
:data:`SETTLE` seconds to show theirs). :meth:`Driver.stop` sets the
job's stop flag (a Dask Event); each rank notices it through
:class:`Stop`, a rank's own watch that also notices its task cancelled.
Every rank body returns a :class:`RankResult`. :func:`go_on` runs rounds
of ranks again after a lost worker, from the last checkpoint; what to
do with a result (an exit status, a job's state) is the caller's.
"""
import codecs
import dataclasses
import enum
import functools
import logging
import os
import queue
import subprocess
import threading
import time
from typing import NamedTuple

from dasktrain import keeper
from dasktrain.files import open_for_writing
from dasktrain.parallel.comm.base import ECHO_PHRASES
from dasktrain.spawn import Bell

logger = logging.getLogger(__name__)

POLL = 0.1  # s between looks at the ranks' tasks and events
IDLE = 1.0  # s at most between looks at ranks of this process (they wake us)
SETTLE = 1.0  # s after a first failure for the root one to show
PATIENCE = 5.0  # s an echo of a lost peer waits for its cause
# A failure for a lost peer, by its class in a traceback or its words.
ECHOES = ('PeerLost', 'CollectiveError', 'CommClosedError',
          'StreamClosed') + ECHO_PHRASES


@dataclasses.dataclass(frozen=True)
class RankResult:
    """What a rank body returns, whatever it ran: its ``rank``; its
    program's exit ``code`` (0 for a training rank that returned, and
    for a program its driver stopped: not its own failure); ``last``, its
    output's last line (its error, usually); ``why`` it ended other than
    by its program's own exit (it could not start, its worker died);
    ``log``, where its output is; ``ended``, when (``time.time()``);
    ``summary``, a training rank 0's summary."""
    rank: int
    code: int = 0
    last: str | None = None
    why: str | None = None
    log: str | None = None
    ended: float = 0.0
    summary: dict | None = None

    @classmethod
    def of(cls, rank, ended, log=None, last=None):
        """The result of rank ``rank`` whose program ended so (a
        :class:`~dasktrain.keeper.Ended`), its output in ``log``, its last
        line ``last``.

        >>> RankResult.of(1, keeper.Ended(2)).code
        2
        >>> RankResult.of(1, keeper.Ended(-15, stopped='stopped')).code
        0
        """
        if ended.error is not None:
            return cls(rank, keeper.CANNOT_START, None, ended.error, log,
                       ended.at)
        return cls(rank, 0 if ended.stopped else ended.code, last, None,
                   log, ended.at)


class Failure(NamedTuple):
    """A rank that failed: its ``rank`` (None: the job failed before any
    rank started, ``why`` says how), the ``error`` its task raised
    (None where it returned a failure, or its task was lost), its
    ``result`` (a :class:`RankResult`, or None), ``seen``, when it ended
    (``time.time()``), and ``why`` where its task was lost or
    cancelled."""
    rank: int | None
    error: BaseException | None
    result: RankResult | None
    seen: float
    why: str | None = None

    def lost_peer(self):
        """Whether it only failed because a peer was gone (its error is a
        lost peer's echo, not a cause)."""
        from dasktrain.parallel.comm import CollectiveError
        if isinstance(self.error, CollectiveError):
            return True
        last = (self.result.last if self.result else None) or ''
        return any(name in last for name in ECHOES)


def blame(failures):
    """The failure to name: the first to end that is not a peer's echo.

    >>> a = Failure(0, None, RankResult(0, 1, 'PeerLost: rank 1'), 1.0)
    >>> b = Failure(1, None, RankResult(1, 1, 'ValueError: x'), 2.0)
    >>> blame([a, b]).rank
    1
    >>> c = Failure(1, None, RankResult(1, 1, 'dasktrain train: error: '
    ...             'rank 0 closed its connection during a barrier: its '
    ...             'worker died or its training failed'), 1.0)
    >>> d = Failure(0, None, RankResult(0, 1, 'error: OUT holds a run'), 2.0)
    >>> blame([c, d]).rank  # the one line of a rank whose peer went
    0
    """
    return min(failures, key=lambda f: (f.lost_peer(), f.seen))


class RunState(enum.Enum):
    """How a job of ranks ended (torchrun's ``WorkerState``)."""
    SUCCEEDED = 'succeeded'  # every rank's task returned, none failed
    LOST = 'lost'  # a worker a rank was pinned to is gone
    FAILED = 'failed'  # a rank failed: the one to blame is named
    STOPPED = 'stopped'  # its caller told the driver to stop watching


@dataclasses.dataclass(frozen=True)
class RunResult:
    """A job of ranks' end: its ``state``; ``results``, each rank's
    :class:`RankResult` where its task returned (None where it did not);
    ``workers``, those its ranks were pinned to (None: anywhere);
    ``lost``, the addresses of those gone (:attr:`RunState.LOST`);
    ``failure``, the :class:`Failure` to blame (:attr:`RunState.FAILED`).
    """
    state: RunState
    results: tuple = ()
    workers: tuple = ()
    lost: tuple = ()
    failure: Failure | None = None


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


# ------------------------------------------------ a rank that is a program

def start_program(argv, env, grace, log, relay=None, cwd=None):
    """A rank's program under its keeper (:func:`dasktrain.keeper.start`),
    its output into ``log`` (a file open for binary writing, open until
    the readers end) and, with ``relay``, also to ``relay(stream, text)``
    as it comes: ``(kept, readers)``, the
    :class:`~dasktrain.keeper.KeptProgram` and the threads reading its
    output (none without ``relay``)."""
    pipe = subprocess.PIPE if relay else log
    kept = keeper.start(argv, env, grace, stdout=pipe, stderr=pipe, cwd=cwd)
    readers = []
    if relay is not None:
        lock = threading.Lock()  # stdout and stderr share the log
        readers = [_reader(stream, log, lock, functools.partial(relay, name))
                   for stream, name in ((kept.stdout, 'stdout'),
                                        (kept.stderr, 'stderr'))]
    return kept, readers


def _reader(stream, log, lock, send):
    """A thread copying ``stream`` to ``log`` and its text to ``send``
    (chunks as they come: a progress bar's ``\\r`` stays)."""
    # A character split between two reads is decoded once it is whole.
    decoder = codecs.getincrementaldecoder('utf-8')(errors='replace')

    def run():
        fd = stream.fileno()
        while True:
            data = os.read(fd, 65536)
            text = decoder.decode(data, final=not data)
            with lock:
                log.write(data)
                log.flush()
            if text:
                send(text)
            if not data:
                break
    thread = threading.Thread(target=run, daemon=True,
                              name='dasktrain-output')
    thread.start()
    return thread


def last_line(path):
    """The last non-empty line of a rank's log (its error, usually)."""
    try:
        with open(path, 'rb') as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            lines = f.read().decode(errors='replace').splitlines()
    except OSError:
        return None
    lines = [line.strip() for line in lines if line.strip()]
    return lines[-1][:300] if lines else None


class Child:
    """A rank started by this process (:meth:`Driver.start_here`): its
    program under its keeper, dying with this process, its output in
    ``log`` (rank 0's also relayed as it comes); watched by a thread of
    its own, it has a Dask future's face for :meth:`Driver.watch`
    (``status``, :meth:`result`)."""

    def __init__(self, argv, env, rank, log, grace, relay=None,
                 on_end=None):
        self.rank, self.log, self.grace = rank, log, grace
        self._on_end = on_end  # called once it has ended
        self.status, self.ended, self._result = 'pending', None, None
        self.stopping = threading.Event()
        self._bell = Bell()  # the stop, to its watch at once
        self._file = open_for_writing(log)  # never through a symlink
        try:
            self.kept, self.readers = start_program(
                argv, env, grace, self._file,
                relay if rank == 0 else None, cwd=os.getcwd())
        except BaseException:
            self._file.close()
            self._bell.close()
            raise
        self.thread = threading.Thread(target=self._wait, daemon=True,
                                       name=f'dasktrain-rank{rank}')
        self.thread.start()

    def _wait(self):
        try:  # woken by the exit or the stop: no look between
            ended = self.kept.watch(self.stopping.is_set, self.grace,
                                    poll=IDLE, bell=self._bell)
        finally:
            self._bell.close()
        for reader in self.readers:
            reader.join(5)
        self._file.close()
        self._result = RankResult.of(self.rank, ended, self.log,
                                     last_line(self.log))
        self.ended = ended.at
        self.status = 'finished'
        if self._on_end is not None:
            self._on_end()

    def result(self):
        return self._result

    def stop(self):
        """Its keeper stops every process of the rank (SIGTERM, SIGKILL
        after its grace), at once."""
        self.stopping.set()
        self._bell.ring()


class Driver:
    """The driver of job ``name``'s ranks (see the module), on
    ``client``'s cluster (None: ranks started here only); ``relay(event)``
    gets each event a rank sends, in order. Used as a context manager: on
    exit the ranks are stopped and cancelled, and the Dask Variables
    named ``{name}/...`` in ``variables`` deleted."""

    def __init__(self, client, name, relay, variables=()):
        self.client, self.name, self.relay = client, name, relay
        self.variables = list(variables)
        self.inbox = queue.SimpleQueue()
        self.futures, self.workers = [], []
        # set by a rank started here as it ends or writes: watch() looks
        # then, not only every POLL seconds
        self._woken = threading.Event()

    def __enter__(self):
        if self.client is not None:
            # Pushed to us as they come: polling get_events would fetch
            # the topic's whole log (up to 1,000 events) at every look.
            self.client.subscribe_topic(self.name, self.inbox.put)
        return self

    def __exit__(self, *exc):
        try:
            self.relay_events()
        finally:
            if self.client is not None:
                self.client.unsubscribe_topic(self.name)
            self.stop(0)
            if self.variables:  # a cluster's (ranks started here: none)
                from distributed import Variable
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

    def start_here(self, argv, envs, logs, grace):
        """Each rank's program ``argv`` a :class:`Child` of this process,
        with its environment of ``envs`` and its log of ``logs``; rank 0's
        output relayed as ``{'kind': 'output', 'stream', 'text'}``
        events. ``grace``: seconds between the SIGTERM and the SIGKILL of
        a stop."""
        def relay(stream, text):
            self.inbox.put((time.time(), {'kind': 'output',
                                          'stream': stream, 'text': text}))
            self._woken.set()
        self.workers = [None] * len(envs)
        for rank, (env, log) in enumerate(zip(envs, logs)):
            self.futures.append(Child(argv, env, rank, log, grace, relay,
                                      self._woken.set))
        return self.futures

    def relay_events(self):
        """Relay every event received so far, in order."""
        while True:
            try:
                _, event = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.relay(event)

    def results(self):
        """Each rank's :class:`RankResult` where its task returned, else
        None."""
        return tuple(f.result() if f.status == 'finished' else None
                     for f in self.futures)

    def watch(self, failed=None, interrupt=None):
        """Relay the ranks' events until they end; a :class:`RunResult`.
        ``failed(result)``: whether a rank that returned ``result`` failed
        (default: its code is not 0); ``interrupt()``, called at every
        look: whether to stop watching now (the ranks are the caller's to
        stop)."""
        from dasktrain.cluster.local import worker_info
        failed = failed or (lambda result: result.code != 0)
        failures, first = {}, None
        while True:
            self.relay_events()
            if interrupt is not None and interrupt():
                return self._result(RunState.STOPPED)
            states = [f.status for f in self.futures]
            now = time.monotonic()
            for rank, future in enumerate(self.futures):
                if rank in failures or states[rank] == 'pending':
                    continue
                seen = getattr(future, 'ended', None) or time.time()
                if states[rank] in ('lost', 'cancelled'):
                    failures[rank] = Failure(
                        rank, None, None, seen,
                        f'its Dask task was {states[rank]}')
                elif states[rank] == 'error':
                    failures[rank] = Failure(rank, future.exception(), None,
                                             seen)
                elif failed(future.result()):
                    failures[rank] = Failure(rank, None, future.result(),
                                             seen)
            if all(s == 'finished' for s in states) and not failures:
                return self._result(RunState.SUCCEEDED)
            pinned = [w for w in self.workers if w is not None]
            if pinned:
                alive = set(worker_info(self.client))
                lost = [w for w in pinned if w not in alive]
                if lost:
                    return self._result(RunState.LOST, lost=tuple(lost))
            if failures:
                first = first or now
                ended = all(s != 'pending' for s in states)
                roots = [f for f in failures.values() if not f.lost_peer()]
                if ended or now - first > PATIENCE or \
                        (roots and now - first >= SETTLE):
                    return self._result(RunState.FAILED,
                                        failure=blame(failures.values()))
            # Ranks of this process wake us as they end or write; Dask
            # tasks, a failure's settling and interrupt() need looks.
            here = interrupt is None and not failures and all(
                isinstance(f, Child) for f in self.futures)
            self._woken.wait(IDLE if here else POLL)
            self._woken.clear()

    def _result(self, state, **more):
        return RunResult(state, self.results(), tuple(self.workers), **more)

    def stop(self, within):
        """Tell the ranks to stop, wait up to ``within`` seconds for their
        tasks to end, then cancel those that have not (a child of this
        process is waited for until its keeper has stopped it)."""
        children = [f for f in self.futures if isinstance(f, Child)]
        for child in children:
            child.stop()
        for child in children:
            child.thread.join()
        tasks = [f for f in self.futures if not isinstance(f, Child)]
        if not tasks:
            return
        try:
            stop_event(self.client, self.name).set()
        except Exception:  # the scheduler gone: the ranks go with it
            pass
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and \
                any(f.status == 'pending' for f in tasks):
            time.sleep(POLL)
        # Those that ended keep their results (Driver.results).
        self.client.cancel([f for f in tasks if f.status != 'finished'],
                           force=True)
        try:
            stop_event(self.client, self.name).clear()
        except Exception:
            pass


def go_on(round_, plan, replan):
    """Run rounds of ranks until one loses no worker: ``round_(plan,
    attempt)`` (a :class:`RunResult`) for attempt 1, 2, ..., and after
    each round that lost a worker again with ``replan(plan, result)``
    (None: no more rounds); the last round's result and its attempt. As
    an elastic agent restarts its workers, the ranks go on from the last
    checkpoint."""
    attempt = 0
    while True:
        attempt += 1
        result = round_(plan, attempt)
        if result.state is not RunState.LOST:
            return result, attempt
        plan = replan(plan, result)
        if plan is None:
            return result, attempt
