"""Steering a running run: ChainerUI's ``commands`` file, read, agreed on by
every rank, and answered.

The protocol is ChainerUI 0.11's (its ``CommandsExtension`` and its server,
``POST /api/v1/projects/P/results/R/commands``), so that ChainerUI's own
buttons act on a dasktrain run unmodified:

* ``OUT/.chainerui_commands`` holds ``{"job_status": "running"}`` while the
  run trains and ``"stopped"`` once it ended; ChainerUI's server takes
  commands for a running run only.
* ``OUT/commands`` is a JSON list of commands, each ``{"name", "request",
  "response"}``. A request is ``{"created_at", "status": "OPEN", "body",
  "schedule"}``, its schedule None (at once) or ``{"key": "epoch" |
  "iteration", "value": N}``; the run answers each with ``{"executed_at",
  "epoch", "iteration", "elapsed_time", "status": "SUCCESS" | "FAILURE",
  "body"}``. Writers replace the whole file (a temp file renamed).

The commands: ``take_snapshot``, ``adjust_hyperparams`` (body
``{"optimizer": NAME, "hyperparam": {"lr": 0.01, ...}}``) and ``stop``.
A command scheduled at epoch N acts once the run has completed N epochs
(at the end of epoch N, or at once during epoch N + 1), one at iteration
N after iteration N, as ChainerUI's extension decides; one whose epoch or
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
is scheduled for. A file that is not ChainerUI's list is one warning, and
the run goes on.

Owns the files' format, the decisions (when a command acts, what an
adjustment may change: :class:`Hyperparameters`) and the answers; what a
command does to the run (a checkpoint, the optimizers) is the loop's
(:mod:`~dasktrain.training.loop`).
"""
import contextlib
import dataclasses
import datetime
import fcntl
import json
import math
import os
import time
import uuid
from pathlib import Path

from dasktrain.files import read_regular, write_json

COMMANDS = 'commands'           # ChainerUI's CommandItem.DEFAULT_FILE_NAME
STATE = '.chainerui_commands'   # ChainerUI's CommandsState file
NAMES = ('take_snapshot', 'adjust_hyperparams', 'stop')
SUCCESS, FAILURE = 'SUCCESS', 'FAILURE'
MAX_BYTES = 1 << 20   # a commands file larger than this is not read
POLL_SECONDS = 1.0    # between polls of a job of several ranks


class Refused(Exception):
    """A command the run answers FAILURE, with the reason."""


def snapshot_name(iteration):
    """ChainerUI's name of a snapshot (it lists files named so).

    >>> snapshot_name(120)
    'snapshot_iter_120'
    """
    return f'snapshot_iter_{iteration}'


def entry_key(entry):
    """What identifies a command in the file however often it is rewritten:
    its name and request (which holds its creation time).

    >>> entry_key({'name': 'stop', 'request': {'created_at': 't'},
    ...            'response': None})
    '{"name": "stop", "request": {"created_at": "t"}}'
    """
    return json.dumps({'name': entry.get('name'),
                       'request': entry.get('request')}, sort_keys=True)


# ------------------------------------------------------------ the files

def read_commands(out):
    """``(entries, problem)``: the list ``OUT/commands`` holds (``[]``
    when there is none), or ``(None, why)`` when the file is not ChainerUI's
    list of commands (not JSON, not a list, larger than
    :data:`MAX_BYTES`, not a regular file)."""
    path = Path(out) / COMMANDS
    try:
        data = read_regular(path, limit=MAX_BYTES + 1)
    except FileNotFoundError:
        return [], None
    except OSError as e:
        return None, f'cannot be read ({e.strerror or e})'
    if len(data) > MAX_BYTES:
        return None, f'is larger than {MAX_BYTES // 2 ** 20} MiB'
    if not data.strip():
        return [], None
    try:
        entries = json.loads(data)
    except ValueError as e:
        return None, f'is not JSON ({e})'
    if not isinstance(entries, list):
        return None, (f'holds a {type(entries).__name__}, not a list of '
                      'commands')
    return entries, None


def signature(out):
    """What changes whenever ``OUT/commands`` is replaced or written (None
    while there is none): the run reads the file again only then."""
    try:
        st = os.stat(Path(out) / COMMANDS)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


@contextlib.contextmanager
def writing(out):
    """Hold the lock dasktrain's writers of ``OUT/commands`` take (a
    ``flock`` on the folder itself, no file of its own): ``dasktrain ctl``
    and the run never lose each other's changes. ChainerUI's server takes
    none; the run keeps what it did in memory, so a command is never done
    twice however the file is rewritten. Where the filesystem cannot lock,
    no lock."""
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)


def write_state(out, status):
    """``OUT/.chainerui_commands`` saying the run is ``status``
    ('running' or 'stopped'), as ChainerUI's CommandsState writes it."""
    write_json(Path(out) / STATE, {'job_status': status})


def run_status(out):
    """'running', 'stopped', or None (no run of this folder has said)."""
    try:
        state = json.loads(read_regular(Path(out) / STATE, limit=4096))
    except (OSError, ValueError):
        return None
    status = state.get('job_status') if isinstance(state, dict) else None
    return status if isinstance(status, str) else None


def request(out, name, body=None, schedule=None):
    """Append a command to ``OUT/commands`` as ChainerUI's server does
    (with an ``id`` of its own in the request, to find its answer); its
    :func:`entry_key`. ValueError if the file is not a list of commands."""
    now = datetime.datetime.now().isoformat()
    entry = {'name': name,
             'request': {'created_at': now, 'status': 'OPEN', 'body': body,
                         'schedule': schedule, 'id': uuid.uuid4().hex},
             'response': None}
    with writing(out):
        entries, problem = read_commands(out)
        if entries is None:
            raise ValueError(f'{Path(out) / COMMANDS} {problem}')
        write_json(Path(out) / COMMANDS, entries + [entry])
    return entry_key(entry)


def response(out, key):
    """The response to the command ``key`` (:func:`request`'s), or None
    while it has none (or the file cannot be read now)."""
    entries, _ = read_commands(out)
    for entry in entries or ():
        if isinstance(entry, dict) and entry_key(entry) == key:
            answer = entry.get('response')
            return answer if isinstance(answer, dict) else None
    return None


# ------------------------------------------------------- the decisions

@dataclasses.dataclass
class Command:
    """A request the run will act on: its ``key`` (:func:`entry_key`),
    ``name``, ``body``, and ``schedule``: None, or ('epoch' or
    'iteration', N)."""
    key: str
    name: str
    body: object = None
    schedule: tuple | None = None

    def words(self):
        """How the command reads to a user.

        >>> Command('k', 'stop', schedule=('epoch', 3)).words()
        'stop at epoch 3'
        """
        when = f' at {self.schedule[0]} {self.schedule[1]}' \
            if self.schedule else ''
        return f'{self.name}{when}'


def parse(entry):
    """The :class:`Command` of one entry of ``OUT/commands``; Refused with
    the reason for one the run cannot take; None for an entry answered
    already (or one that asks nothing: ChainerUI's ``request`` None).

    >>> parse({'name': 'stop', 'request': {'schedule': {'key': 'epoch',
    ...        'value': 2}}, 'response': None}).schedule
    ('epoch', 2)
    >>> parse({'name': 'rewind', 'request': {}, 'response': None})
    Traceback (most recent call last):
    ...
    dasktrain.training.steering.Refused: rewind is not a command of this \
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
    return Command(entry_key(entry), name, request_.get('body'), schedule)


def when(command, epoch, iteration):
    """'now', 'later', or the reason it can no longer act, for
    ``command`` at a poll after ``epoch`` completed epochs and
    ``iteration`` iterations (ChainerUI's rule: epoch N acts while the
    completed epochs are N; iteration N at iteration N).

    >>> c = Command('k', 'stop', schedule=('epoch', 2))
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
                f'had completed {epoch} epochs, iteration {iteration})')
    return (f'iteration {value} passed before the run read this command (it '
            f'was at iteration {iteration})')


# Hyperparameters whose values lie in [0, 1), > 0 or >= 0; others: finite.
_FRACTIONS = ('momentum', 'beta1', 'beta2', 'beta', 'rho', 'alpha')
_POSITIVE = ('eps', 'eta', 'final_lr')
_NON_NEGATIVE = ('weight_decay_rate',)


class Hyperparameters:
    """The optimizer hyperparameters an ``adjust_hyperparams`` request may
    change, in the run's words: the optimizer's own float hyperparameters
    (``optimizer.hyperparam``) and ``lr``, the run's learning rate (Adam's
    ``alpha``, as ``--lr`` is). A change applies to every optimizer of the
    run (one per replica in ipm).

    Parameters
    ----------
    optimizers : sequence of chainer.Optimizer
        The run's, the master's first; they share their hyperparameters.

    Examples
    --------
    >>> import chainer
    >>> hp = Hyperparameters([chainer.optimizers.Adam(alpha=0.001)])
    >>> hp.check({'hyperparam': {'lr': 0.01, 'beta1': None}})
    {'lr': 0.01}
    >>> hp.check({'hyperparam': {'momentum': 0.5}})
    Traceback (most recent call last):
    ...
    dasktrain.training.steering.Refused: this run's optimizer is Adam, \
which has no momentum; it takes lr (its alpha), alpha, beta1, beta2, eps, \
eta, weight_decay_rate
    """

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)
        master = self.optimizers[0]
        self.name = type(master).__name__
        values = master.hyperparam.get_dict()
        # Floats, but AdaBound's (final_lr, gamma: Adam's, unused unless
        # adabound): what a request may change.
        self.native = [k for k, v in values.items()
                       if isinstance(v, (int, float)) and
                       not isinstance(v, bool) and
                       k not in ('final_lr', 'gamma')]
        self.rate = 'lr' if 'lr' in values else \
            'alpha' if 'alpha' in values else None

    def _native(self, name):
        return self.rate if name == 'lr' else name

    def names(self):
        """The names a request may use, in words."""
        names = list(self.native)
        if self.rate not in (None, 'lr'):
            names.insert(0, f'lr (its {self.rate})')
        return ', '.join(names)

    def values(self):
        """The values in force, by the names a request may use."""
        values = self.optimizers[0].hyperparam.get_dict()
        found = {k: values[k] for k in self.native}
        if self.rate is not None:
            found['lr'] = values[self.rate]
        return found

    def check(self, body):
        """``{name: value}`` that ``body`` (``adjust_hyperparams``'s)
        asks to change, in the run's words (``lr`` for the learning rate);
        Refused with the reason for a request the run cannot do. Values
        given as null are not changed (ChainerUI's form sends its empty
        fields so)."""
        if not isinstance(body, dict) or \
                not isinstance(body.get('hyperparam'), dict):
            raise Refused('its body must be {"optimizer": NAME, '
                          '"hyperparam": {"lr": 0.01, ...}}')
        asked = {k: v for k, v in body['hyperparam'].items()
                 if v is not None}
        named = body.get('optimizer')
        other = named is not None and named != self.name
        changes = {}
        for name, value in asked.items():
            native = self._native(name)
            if native is None or native not in self.native:
                raise Refused(f"this run's optimizer is {self.name}, "
                              f'which has no {name}; it takes '
                              f'{self.names()}')
            if other and name != 'lr':
                raise Refused(f"this run's optimizer is {self.name}, not "
                              f'{named}: only lr, the learning rate every '
                              f'run has, applies across optimizers')
            changes['lr' if native == self.rate else name] = \
                _checked(name if native != self.rate else 'lr', value)
        if not changes:
            raise Refused(f'it asks for no change; give a value for one of '
                          f'{self.names()}')
        return changes

    def apply(self, changes):
        """Set ``changes`` (as :meth:`check` returns them) on every
        optimizer; the values in force before, by the same names."""
        before = self.values()
        for optimizer in self.optimizers:
            for name, value in changes.items():
                setattr(optimizer.hyperparam, self._native(name), value)
        return {k: before[k] for k in changes}

    def answer(self):
        """The response body ChainerUI shows ("last value" of each)."""
        return {'optimizer': self.name, 'hyperparam': self.values()}


def _checked(name, value):
    """``value`` for the hyperparameter ``name``, or Refused naming both.

    >>> _checked('momentum', 0.5), _checked('lr', 1)
    (0.5, 1.0)
    >>> _checked('lr', 0)
    Traceback (most recent call last):
    ...
    dasktrain.training.steering.Refused: lr must be a finite number > 0, \
got 0
    """
    def wrong(expected):
        return Refused(f'{name} must be {expected}, got {json.dumps(value)}')
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        raise wrong('a finite number')
    if name in _FRACTIONS and not 0 <= value < 1:
        raise wrong('a number in [0, 1)')
    if (name == 'lr' or name in _POSITIVE) and not value > 0:
        raise wrong('a finite number > 0')
    if name in _NON_NEGATIVE and value < 0:
        raise wrong('a number >= 0')
    return float(value)


# ------------------------------------------------------------ the polls

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
        (Refused otherwise): :meth:`Hyperparameters.check`.
    warn : callable
        ``warn(line)``: tell the user (a file that cannot be read, a
        command refused).
    poll_seconds : float, default :data:`POLL_SECONDS`
        About how long between polls of a job of several ranks.
    """

    def __init__(self, out, comm, check, warn, poll_seconds=POLL_SECONDS):
        self.out, self.comm, self.check = Path(out), comm, check
        self.warn, self.poll_seconds = warn, poll_seconds
        self.lead = comm.rank == 0
        self.next_poll = 0
        self.seen = object()     # the file's signature when last read
        self.pending = {}        # key: Command, not yet acted on
        self.answered = {}       # key: response written (again if lost)
        self.warned = None       # the problem last warned of
        self.last = None         # (iteration, time) of the last poll

    def start(self):
        """The run has started: ChainerUI may send commands (rank 0 says
        so in ``OUT/.chainerui_commands``)."""
        if self.lead:
            write_state(self.out, 'running')

    def due(self, iteration):
        """Whether every rank polls after ``iteration`` (the same answer on
        every rank)."""
        return iteration >= self.next_poll

    def poll(self, epoch, iteration, elapsed=0.0):
        """The :class:`Action` list every rank carries out now, after
        ``epoch`` completed epochs and ``iteration`` iterations (a
        collective of the job's ranks); ``elapsed``: the run's seconds, for
        the answers."""
        decided = None
        if self.lead:
            decided = self._decide(epoch, iteration, elapsed)
        actions, self.next_poll = self.comm.bcast(decided) \
            if self.comm.size > 1 else decided
        return [Action(**a) for a in actions]

    def _decide(self, epoch, iteration, elapsed):
        self._read(epoch, iteration, elapsed)
        actions, refused = [], {}
        for key, command in list(self.pending.items()):
            state = when(command, epoch, iteration)
            if state == 'later':
                continue
            del self.pending[key]
            if state != 'now':
                refused[key] = (command, state)
                continue
            try:
                changes = self.check(command.body) \
                    if command.name == 'adjust_hyperparams' else None
            except Refused as e:
                refused[key] = (command, str(e))
                continue
            actions.append(dataclasses.asdict(Action(
                key, command.name, command.words(), changes)))
        for command, reason in refused.values():
            self.warn(f'iteration {iteration}: {command.words()} refused: '
                      f'{reason}')
        self._respond({key: _response(FAILURE, {'message': reason}, epoch,
                                      iteration, elapsed)
                       for key, (_, reason) in refused.items()})
        return actions, self._next(iteration)

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
            key: _response(FAILURE, {'message': reason}, epoch, iteration,
                           elapsed) for key, reason in bad.items()}})

    def answer(self, action, status, body, epoch, iteration, elapsed=0.0):
        """Rank 0 writes the response to ``action`` (done, or FAILURE with
        ``body['message']``); other ranks do nothing."""
        if self.lead:
            self._respond({action.key: _response(status, body, epoch,
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
        self._respond({key: _response(
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

    >>> _too_late(Command('k', 'stop', schedule=('epoch', 5)), 3, 60,
    ...           'its 3 epochs done')
    'the run ended (its 3 epochs done) at epoch 3, iteration 60: epoch 5 \
never came'
    """
    where = f'the run ended ({why}) at epoch {epoch}, iteration {iteration}'
    if command.schedule is None:
        return f'{where} before it read this command'
    return f'{where}: {command.schedule[0]} {command.schedule[1]} never came'


def _response(status, body, epoch, iteration, elapsed):
    """A response as ChainerUI's ``CommandItem.set_response`` writes it."""
    return {'executed_at': datetime.datetime.now().isoformat(),
            'epoch': epoch, 'iteration': iteration,
            'elapsed_time': float(elapsed), 'status': status, 'body': body}
