"""Steering a running run: ChainerUI's commands, agreed on by every rank
of its job, carried out at the same iteration, and answered.

The protocol is ChainerUI 0.11's (its ``CommandsExtension`` and its server,
``POST /api/v1/projects/P/results/R/commands``; the files:
:mod:`~dasktrain.training.commandfile`), so that ChainerUI's own buttons
act on a dasktrain run unmodified. The commands: ``take_snapshot``,
``adjust_hyperparams`` (body ``{"optimizer": NAME, "hyperparam": {"lr":
0.01, ...}}``, :mod:`~dasktrain.training.hyperparams`) and ``stop``. A
command scheduled at epoch N acts once the run has completed N epochs (at
the end of epoch N, or at once during epoch N + 1), one at iteration N
after iteration N, as ChainerUI's extension decides; one whose epoch or
iteration has passed, or that the run cannot do, is answered FAILURE with
its reason in ``body.message`` (ChainerUI leaves those unanswered or
answers SUCCESS having done nothing). Unlike ChainerUI's extension, a run
does not delete ``OUT/commands`` when it starts: what was asked while a
queued job waited, or between attempts, acts when it runs.

Across the ranks of a job, rank 0 alone reads the file and answers; what
to do is broadcast at *polls* that every rank reaches at the same
iteration (:class:`Steering`), so every rank applies a command at the
same iteration and the replicas never diverge. A run of one process polls
after every iteration (a ``stat`` of the file); a job of several ranks
about every :data:`POLL_SECONDS`, and at exactly the iteration a command
is scheduled for; one whose ranks always have a sum in flight between two
steps (double buffering) at each epoch's end, where it plans what is
scheduled at an iteration of the next epoch. A file that is not
ChainerUI's list is one warning, and the run goes on.

Owns when a command acts and its answer; what a command does to the run
(a checkpoint, the optimizers) is :mod:`~dasktrain.training.control`'s.
"""
import contextlib
import dataclasses
import json
import time
from pathlib import Path

from dasktrain.errors import plural
from dasktrain.files import write_json
from dasktrain.training.commandfile import (
    COMMANDS,
    FAILURE,
    Refused,
    entry_key,
    new_response,
    read_commands,
    signature,
    write_state,
    writing,
)

NAMES = ('take_snapshot', 'adjust_hyperparams', 'stop')
POLL_SECONDS = 1.0    # between polls of a job of several ranks


@dataclasses.dataclass
class SteeringRequest:
    """A request the run will act on: its ``key`` (:func:`entry_key`),
    ``name``, ``body``, and ``schedule``: None, or ('epoch' or
    'iteration', N)."""
    key: str
    name: str
    body: object = None
    schedule: tuple | None = None

    def words(self):
        """How the command reads to a user.

        >>> SteeringRequest('k', 'stop', schedule=('epoch', 3)).words()
        'stop at epoch 3'
        """
        when = f' at {self.schedule[0]} {self.schedule[1]}' \
            if self.schedule else ''
        return f'{self.name}{when}'


def parse(entry):
    """The :class:`SteeringRequest` of one entry of ``OUT/commands``;
    Refused with the reason for one the run cannot take; None for an
    entry answered already (or one that asks nothing: ChainerUI's
    ``request`` None).

    >>> parse({'name': 'stop', 'request': {'schedule': {'key': 'epoch',
    ...        'value': 2}}, 'response': None}).schedule
    ('epoch', 2)
    >>> parse({'name': 'rewind', 'request': {}, 'response': None})
    Traceback (most recent call last):
    ...
    dasktrain.training.commandfile.Refused: rewind is not a command of this \
run; it takes take_snapshot, adjust_hyperparams, stop
    """
    if entry.get('response') is not None or entry.get('request') is None:
        return None
    name, request_ = entry.get('name'), entry['request']
    if not isinstance(request_, dict):
        raise Refused(f'its request is a {type(request_).__name__}, not '
                      'an object')
    if name not in NAMES:
        raise Refused(f'{name} is not a command of this run; it takes '
                      f'{", ".join(NAMES)}')
    schedule = request_.get('schedule')
    if schedule is not None:
        value = schedule.get('value') if isinstance(schedule, dict) else None
        if not isinstance(schedule, dict) or \
                schedule.get('key') not in ('epoch', 'iteration') or \
                not isinstance(value, int) or isinstance(value, bool) or \
                value < 0:
            raise Refused(f'schedule {json.dumps(schedule)} is not '
                          '{"key": "epoch" or "iteration", "value": N >= 0}')
        schedule = (schedule['key'], value)
    return SteeringRequest(entry_key(entry), name, request_.get('body'),
                           schedule)


def when(command, epoch, iteration):
    """'now', 'later', or the reason it can no longer act, for
    ``command`` at a poll after ``epoch`` completed epochs and
    ``iteration`` iterations (ChainerUI's rule: epoch N acts while the
    completed epochs are N; iteration N at iteration N).

    >>> c = SteeringRequest('k', 'stop', schedule=('epoch', 2))
    >>> when(c, 1, 40), when(c, 2, 80), when(c, 3, 120)[:13]
    ('later', 'now', 'epoch 2 ended')
    """
    if command.schedule is None:
        return 'now'
    kind, value = command.schedule
    at = epoch if kind == 'epoch' else iteration
    if at == value:
        return 'now'
    if at < value:
        return 'later'
    if kind == 'epoch':
        return (f'epoch {value} ended before the run read this command (it '
                f'had completed {plural(epoch, "epoch")}, iteration '
                f'{iteration})')
    return (f'iteration {value} passed before the run read this command (it '
            f'was at iteration {iteration})')


@dataclasses.dataclass
class Action:
    """A command every rank carries out now: ``changes`` for
    ``adjust_hyperparams`` (checked on rank 0)."""
    key: str
    name: str
    words: str
    changes: dict | None = None


class Steering:
    """A run's side of the commands file, on every rank of its job.

    Every rank calls :meth:`due` after each iteration, and :meth:`poll`
    when it says so and at each epoch's end: rank 0 reads the file (when
    it changed), answers what it must refuse, and broadcasts the actions
    due now and the iteration of the next poll; every rank gets the same
    list at the same iteration. Rank 0 answers each action
    (:meth:`answer`) once it is done.

    Parameters
    ----------
    out : str or Path
        The run's folder.
    comm : communicator
        The job's (:class:`~dasktrain.parallel.comm.Solo` for a run of
        one process, which polls after every iteration, collective-free).
    check : callable
        ``check(body)``: the changes an ``adjust_hyperparams`` body asks
        (Refused otherwise): :meth:`~dasktrain.training.hyperparams.
        Hyperparameters.check`.
    warn : callable
        ``warn(line)``: tell the user (a file that cannot be read, a
        command refused).
    poll_seconds : float, default :data:`POLL_SECONDS`
        About how long between polls of a job of several ranks.
    between_steps : bool, default True
        Whether the ranks may poll between two steps of an epoch: not
        where a collective is still in flight there (double buffering's
        sum of the last step). Then they poll at each epoch's end only,
        where a command scheduled at an iteration of the next epoch is
        planned, to act at exactly that iteration.
    """

    def __init__(self, out, comm, check, warn, poll_seconds=POLL_SECONDS,
                 between_steps=True):
        self.out, self.comm, self.check = Path(out), comm, check
        self.warn, self.poll_seconds = warn, poll_seconds
        self.between_steps = between_steps or comm.size == 1
        self.lead = comm.rank == 0
        self.next_poll = 0
        self.plan = {}           # iteration: [action], known to every rank
        self.planned = set()     # keys of pending commands planned
        self.seen = object()     # the file's signature when last read
        self.pending = {}        # key: SteeringRequest, not yet acted on
        self.answered = {}       # key: response written (again if lost)
        self.warned = None       # the problem last warned of
        self.last = None         # (iteration, time) of the last poll

    def start(self):
        """The run has started: ChainerUI may send commands (rank 0 says
        so in ``OUT/.chainerui_commands``)."""
        if self.lead:
            write_state(self.out, 'running')

    def due(self, iteration):
        """Whether every rank polls after ``iteration`` within an epoch
        (the same answer on every rank)."""
        return iteration in self.plan or \
            (self.between_steps and iteration >= self.next_poll)

    def poll(self, epoch, iteration, elapsed=0.0, boundary=True):
        """The :class:`Action` list every rank carries out now, after
        ``epoch`` completed epochs and ``iteration`` iterations;
        ``boundary``: at an epoch's end or the run's start, where every
        rank polls (within an epoch: when :meth:`due`). ``elapsed``: the
        run's seconds, for the answers. A collective of the job's ranks,
        but for what was planned."""
        planned = self.plan.pop(iteration, [])
        if self.lead:
            for action in planned:
                self.pending.pop(action['key'], None)
                self.planned.discard(action['key'])
        if not (boundary or self.between_steps):
            return [Action(**a) for a in planned]
        decided = None
        if self.lead:
            decided = self._decide(epoch, iteration, elapsed)
        actions, plan, self.next_poll = self.comm.bcast(decided) \
            if self.comm.size > 1 else decided
        for at, action in plan:
            self.plan.setdefault(at, []).append(action)
        return [Action(**a) for a in planned + actions]

    def _decide(self, epoch, iteration, elapsed):
        self._read(epoch, iteration, elapsed)
        actions, plan, refused = [], [], {}
        for key, command in list(self.pending.items()):
            state = when(command, epoch, iteration)
            if key in self.planned or state == 'later' and (
                    self.between_steps or command.schedule[0] == 'epoch'):
                continue
            if state != 'later':
                del self.pending[key]
            if state not in ('now', 'later'):
                refused[key] = (command, state)
                continue
            try:
                changes = self.check(command.body) \
                    if command.name == 'adjust_hyperparams' else None
            except Refused as e:
                self.pending.pop(key, None)
                refused[key] = (command, str(e))
                continue
            action = dataclasses.asdict(Action(
                key, command.name, command.words(), changes))
            if state == 'now':
                actions.append(action)
            else:  # an iteration ahead, no poll between steps: planned
                self.planned.add(key)
                plan.append((command.schedule[1], action))
        for command, reason in refused.values():
            self.warn(f'iteration {iteration}: {command.words()} refused: '
                      f'{reason}')
        self._respond({key: new_response(FAILURE, {'message': reason},
                                         epoch, iteration, elapsed)
                       for key, (_, reason) in refused.items()})
        return actions, plan, self._next(iteration)

    def _next(self, iteration):
        """The iteration of the next poll: the next one alone; in a job of
        several ranks about :attr:`poll_seconds` ahead, or a scheduled
        command's iteration if sooner."""
        now = time.monotonic()
        steps = 1
        if self.comm.size > 1 and self.last is not None and \
                iteration > self.last[0]:
            per_step = (now - self.last[1]) / (iteration - self.last[0])
            steps = max(1, min(10_000, int(self.poll_seconds /
                                           max(per_step, 1e-6))))
        self.last = (iteration, now)
        at = [c.schedule[1] for c in self.pending.values()
              if c.schedule and c.schedule[0] == 'iteration' and
              c.schedule[1] > iteration]
        return min([iteration + steps] + at)

    def _read(self, epoch, iteration, elapsed):
        """Take the new commands of ``OUT/commands`` (rank 0), when it
        changed; answer those it cannot parse; warn once of a file that is
        not a list of commands."""
        found = signature(self.out)
        if found == self.seen:
            return
        self.seen = found
        entries, problem = read_commands(self.out)
        if entries is None:
            if problem != self.warned:
                self.warned = problem
                self.warn(f'warning: {self.out / COMMANDS} {problem}: its '
                          'commands are ignored until it is fixed '
                          '(ChainerUI writes a JSON list of commands)')
            return
        self.warned = None
        bad, lost = {}, {}
        for entry in entries:
            if not isinstance(entry, dict):
                continue  # nothing to answer in: left as it is
            key = entry_key(entry)
            if key in self.answered:
                if entry.get('response') is None:
                    lost[key] = self.answered[key]  # a writer dropped it
                continue
            try:
                command = parse(entry)
            except Refused as e:
                bad[key] = str(e)
                continue
            if command is not None:
                self.pending.setdefault(key, command)
        for reason in bad.values():
            self.warn(f'iteration {iteration}: a command in '
                      f'{self.out / COMMANDS} refused: {reason}')
        self._respond({**lost, **{
            key: new_response(FAILURE, {'message': reason}, epoch,
                              iteration, elapsed)
            for key, reason in bad.items()}})

    def answer(self, action, status, body, epoch, iteration, elapsed=0.0):
        """Rank 0 writes the response to ``action`` (done, or FAILURE with
        ``body['message']``); other ranks do nothing."""
        if self.lead:
            self._respond({action.key: new_response(status, body, epoch,
                                                    iteration, elapsed)})

    def _respond(self, responses):
        """Write ``responses`` ({key: response}) into the entries they
        answer, the file read again just before (what another writer
        added stays)."""
        if not responses:
            return
        self.answered.update(responses)
        with writing(self.out):
            entries, _ = read_commands(self.out)
            if not entries:
                return
            changed = False
            for entry in entries:
                if isinstance(entry, dict) and \
                        entry.get('response') is None:
                    key = entry_key(entry)
                    if key in responses:
                        entry['response'] = responses[key]
                        changed = True
            if changed:
                try:
                    write_json(self.out / COMMANDS, entries)
                except OSError as e:  # a full disk: the run goes on
                    self.warn(f'warning: cannot answer in '
                              f'{self.out / COMMANDS} '
                              f'({e.strerror or e})')
        self.seen = signature(self.out)

    def finish(self, epoch, iteration, why, elapsed=0.0):
        """The run ended (``why``, in words) after ``epoch`` epochs and
        ``iteration`` iterations: rank 0 answers every command still
        waiting as refused, and tells ChainerUI the run stopped."""
        if not self.lead:
            return
        self.seen = object()  # one last look at the file
        self._read(epoch, iteration, elapsed)
        self._respond({key: new_response(
            FAILURE, {'message': _too_late(command, epoch, iteration, why)},
            epoch, iteration, elapsed)
            for key, command in self.pending.items()})
        self.pending.clear()
        self.stopped()

    def stopped(self):
        """Tell ChainerUI the run no longer takes commands (rank 0)."""
        if self.lead:
            with contextlib.suppress(OSError):
                write_state(self.out, 'stopped')


def _too_late(command, epoch, iteration, why):
    """Why ``command`` never acted: the run ended (``why``) first.

    >>> _too_late(SteeringRequest('k', 'stop', schedule=('epoch', 5)), 3, 60,
    ...           'its 3 epochs done')
    'the run ended (its 3 epochs done) at epoch 3, iteration 60: epoch 5 \
never came'
    """
    where = f'the run ended ({why}) at epoch {epoch}, iteration {iteration}'
    if command.schedule is None:
        return f'{where} before it read this command'
    return f'{where}: {command.schedule[0]} {command.schedule[1]} never came'


