"""``dasktrain ctl``: steer a running run or job from a terminal, as
ChainerUI's buttons do: take a snapshot, set a hyperparameter, stop; now
or ``--at epoch=N`` / ``iteration=N``. It writes the command into the
run's ``OUT/commands`` (:mod:`dasktrain.training.commandfile`) and says what
the run did and when, once it answered.

A job is steered by its submitter only (the check ``cancel`` makes); a
run folder by whoever may write it."""
import os
import socket
import time
from pathlib import Path

from dasktrain.commands import Command, add_jobs_dir, printable
from dasktrain.errors import plural

ACTIONS = {'snapshot': 'take_snapshot', 'set': 'adjust_hyperparams',
           'stop': 'stop'}


def parse_at(text):
    """``--at``'s ``epoch=N`` or ``iteration=N`` as ChainerUI's schedule;
    ValueError naming what it takes.

    >>> parse_at('epoch=3')
    {'key': 'epoch', 'value': 3}
    """
    key, _, value = text.partition('=')
    if key not in ('epoch', 'iteration') or not value.isdigit():
        raise ValueError(f'--at takes epoch=N or iteration=N, got {text!r}')
    return {'key': key, 'value': int(value)}


def parse_values(words):
    """``set``'s ``NAME=VALUE`` words as ``{name: float}``; ValueError
    naming the word that is not one.

    >>> parse_values(['lr=0.01', 'momentum=0.9'])
    {'lr': 0.01, 'momentum': 0.9}
    """
    values = {}
    for word in words:
        name, _, value = word.partition('=')
        try:
            values[name] = float(value)
        except ValueError:
            raise ValueError(f'set takes NAME=VALUE with a number, e.g. '
                             f'lr=0.01; got {word!r}') from None
        if not name.isidentifier():
            raise ValueError(f'set takes NAME=VALUE, e.g. lr=0.01; got '
                             f'{word!r}')
    return values


def describe(name, answer, out):
    """What the run did, in words, from its ``answer`` (a response)."""
    when = answer.get('executed_at', '')[11:19]
    where = (f"at iteration {answer.get('iteration')} "
             f"({plural(answer.get('epoch'), 'epoch')} done), {when}")
    body = answer.get('body') or {}
    if name == 'take_snapshot':
        return (f"snapshot {body.get('path')} {where}; until the next "
                f'checkpoint it is also {Path(out) / "checkpoint.npz"}, '
                'which --resume continues from')
    if name == 'adjust_hyperparams':
        changed = ', '.join(f'{k} {a:g} -> {b:g}' for k, (a, b) in
                            body.get('changed', {}).items())
        return f"{changed} ({body.get('optimizer')}) {where}"
    return (f"stopped {where}; final checkpoint {body.get('path')} "
            f'(`dasktrain train --resume --out {out}` continues)')


class Ctl(Command):
    name = 'ctl'
    help = ('steer a running run or job: take a snapshot, set a '
            'hyperparameter (set lr=0.01), or stop it; now or --at '
            'epoch=N / iteration=N')

    def add_arguments(self, parser):
        parser.add_argument('target', metavar='RUN_OR_JOB',
                            help="a run's folder (its --out) or a job id "
                                 'from `dasktrain jobs`')
        parser.add_argument('action', choices=tuple(ACTIONS))
        parser.add_argument('values', nargs='*', metavar='NAME=VALUE',
                            help='set: the hyperparameters to change '
                                 '(lr, momentum, beta1, ...)')
        parser.add_argument('--at', default=None,
                            metavar='epoch=N|iteration=N',
                            help='act once N epochs are done, or after '
                                 'iteration N (default: at once)')
        parser.add_argument('--timeout', type=float, default=60.0,
                            metavar='S', help='seconds to wait for the '
                            "run's answer (default: %(default)s)")
        add_jobs_dir(parser)

    def run(self, args):
        from dasktrain.jobs.job import JobError
        from dasktrain.training import commandfile as steering
        try:
            schedule = parse_at(args.at) if args.at else None
            values = parse_values(args.values)
        except ValueError as e:
            args.command_parser.error(str(e))
        if (args.action == 'set') != bool(values):
            args.command_parser.error(
                'set takes NAME=VALUE, e.g. set lr=0.01' if values == {}
                else f'{args.action} takes no NAME=VALUE')
        out, job = self.target(args.target, args.jobs_dir)
        name = ACTIONS[args.action]
        gone = self.check_running(out, job, name, schedule)
        what = f"{args.action}{' ' + ' '.join(args.values) if values else ''}"
        reason = refusal(run_settings(out, job), progress(out, job), values,
                         schedule)
        if reason:  # what the run would answer later, said now
            raise JobError(f'{args.target}: {what} refused: {reason}')
        body = {'hyperparam': values} if values else None
        try:
            if job is not None:  # a queued job of your own has none yet
                out.mkdir(mode=0o700, exist_ok=True)
            key = steering.request(out, name, body, schedule)
        except ValueError as e:
            raise JobError(f'{e}; fix or remove it first') from None
        except OSError as e:
            raise JobError(f'cannot write {out / steering.COMMANDS} '
                           f'({e.strerror or e})') from None
        if schedule:
            print(f"{args.target}: {what} at {schedule['key']} "
                  f"{schedule['value']} requested; the run answers in "
                  f'{out / steering.COMMANDS} when it acts')
            return 0
        answer = steering.wait(out, key, args.timeout, gone)
        if answer is None:
            reason = gone() or (f'no answer within {args.timeout:g} s')
            raise JobError(f'{args.target}: {reason}; the command waits in '
                           f'{out / steering.COMMANDS}')
        if answer.get('status') != steering.SUCCESS:
            message = (answer.get('body') or {}).get('message') or \
                'no reason given'
            raise JobError(f'{args.target}: {what} refused: {message}')
        print(printable(f'{args.target}: {describe(name, answer, out)}'))
        if name == 'stop' and job is not None:
            self.wait_end(job, args.timeout)
        return 0

    @staticmethod
    def target(target, jobs_dir):
        """``(run folder, job or None)`` of ``target``: a run's folder, a
        job's folder, or a job id (JobError where there is none, or the
        job is someone else's)."""
        from dasktrain.jobs import current_user
        from dasktrain.jobs.client.route import find
        from dasktrain.jobs.job import Job, JobError
        path = Path(target)
        if path.is_dir() and not (path / 'job.json').exists():
            return path, None
        neither = JobError(f'no run folder and no job named {target!r}: '
                           "give a run's folder (its --out) or a job id "
                           '(`dasktrain jobs` lists them)')
        if path.is_dir():
            job = Job(path.name, path)
        elif os.sep in target:  # a path, and no job id has one
            raise neither
        else:
            try:
                job = find(target, jobs_dir)
            except JobError as e:
                if str(e).startswith('no job '):
                    raise neither from None
                raise
        owner, me = job.spec().user, current_user()
        if owner not in (None, me):
            raise JobError(f'job {job.id} was submitted by {owner}; only '
                           f'{owner} can steer it (you are {me})')
        return job.folder / 'out', job

    @staticmethod
    def check_running(out, job, name, schedule):
        """Refuse (JobError) a command no run can take now; the callable
        saying why the run can no longer answer, while waiting."""
        from dasktrain.jobs.job import DONE, JobError
        from dasktrain.training import commandfile as steering
        if job is not None:
            state = job.status()['state']
            if state in DONE:
                raise JobError(f'job {job.id} is {state}; nothing to steer')
            if state == 'queued' and schedule is None and name != \
                    'adjust_hyperparams':
                hint = (f'`dasktrain cancel {job.id}` takes it off the '
                        'queue' if name == 'stop' else
                        'it has nothing to snapshot yet')
                raise JobError(f'job {job.id} is queued, not running: '
                               f'{hint}')

            def job_gone():
                state = job.status()['state']
                return f'job {job.id} {state}' if state in DONE else None
            return job_gone
        status = steering.run_status(out)
        if status != 'running':
            said = 'no run has trained there' if status is None else \
                'its run has stopped'
            raise JobError(f'{out} is not running ({said}); `dasktrain '
                           f'train --resume --out {out}` continues a run')
        holder = _holder(out)
        if holder:
            raise JobError(f'{out} is not running: {holder}')
        return lambda: steering.run_status(out) != 'running' and \
            f'{out} stopped' or _holder(out)

    @staticmethod
    def wait_end(job, timeout):
        """After a stop: the job's state once it ends (within
        ``timeout``)."""
        from dasktrain.jobs.job import DONE
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = job.status()
            if status['state'] in DONE:
                ending = status.get('ending')
                print(f"job {job.id}: {status['state']}"
                      f"{f' ({ending})' if ending else ''}")
                return
            time.sleep(0.2)


def run_settings(out, job):
    """The run's settings, a TrainConfig: a job's as submitted, a run
    folder's from ``OUT/args`` (each resume's changes applied); None for
    a command job, or a folder without dasktrain's ``args`` (a Trainer
    script's)."""
    import dataclasses
    import json

    from dasktrain.config import ConfigError, TrainConfig
    from dasktrain.jobs.job import JobError
    from dasktrain.training.outdir import recorded_settings
    try:
        settings = job.spec().config if job is not None else \
            recorded_settings(out)
    except JobError:
        return None
    if not isinstance(settings, dict):
        return None
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        return TrainConfig.from_json(json.dumps(
            {k: v for k, v in settings.items() if k in names}))
    except (ConfigError, TypeError, ValueError):
        return None


def progress(out, job):
    """``(epochs completed, iteration)`` of the run as its log says,
    ``(0, 0)`` before its first epoch's row."""
    from dasktrain.files import read_json
    from dasktrain.jobs.job import DEPTH, LOG_LIMIT, JobError, log_rows_of
    try:
        rows = job.log_rows() if job is not None else log_rows_of(
            read_json(Path(out) / 'log', limit=LOG_LIMIT, depth=DEPTH))
    except (JobError, OSError, ValueError):  # unknown: the run tells
        rows = []
    if not rows:
        return 0, 0
    iteration = rows[-1].get('iteration')
    return rows[-1]['epoch'], iteration if type(iteration) is int else 0


def refusal(config, done, values, schedule):
    """Why a dasktrain run (``config``, its settings; None: not one, a
    Trainer script's, whose extension has rules of its own) will refuse
    a command, known now, or None: a hyperparameter its optimizer lacks
    or a value it cannot take (:class:`~dasktrain.training.hyperparams.
    Hyperparameters`' check), an epoch or iteration already passed
    (``done``: epochs completed and iteration, as its log says), an
    epoch it never reaches.

    >>> from dasktrain.config import TrainConfig
    >>> print(refusal(TrainConfig(), (3, 300), {}, {'key': 'epoch',
    ...                                             'value': 2}))
    epoch 2 has passed: the run has completed 3 epochs (iteration 300)
    >>> print(refusal(TrainConfig(), (3, 300), {}, {'key': 'epoch',
    ...                                             'value': 30}))
    epoch 30 never comes: the run trains 20 epochs
    >>> refusal(None, (3, 300), {}, {'key': 'iteration', 'value': 301})
    """
    if config is None:
        return None
    epochs, iteration = done
    if schedule is not None:
        key, value = schedule['key'], schedule['value']
        if key == 'epoch' and value < epochs or \
                key == 'iteration' and value < iteration:
            return (f'{key} {value} has passed: the run has completed '
                    f'{plural(epochs, "epoch")} (iteration {iteration})')
        if key == 'epoch' and value > config.epochs:
            return (f'epoch {value} never comes: the run trains '
                    f'{plural(config.epochs, "epoch")}')
    if values:
        from dasktrain.training.commandfile import Refused
        from dasktrain.training.hyperparams import Hyperparameters
        from dasktrain.training.loop import make_optimizer
        try:
            Hyperparameters([make_optimizer(config)]).check(
                {'hyperparam': values})
        except Refused as e:
            return str(e)
    return None


def _holder(out):
    """Why the run said to train in ``out`` is gone, where its lock names
    a process of this machine that is no more; else None."""
    try:
        words = (Path(out) / 'run.lock').read_text().split()
    except OSError:
        return None
    if len(words) != 4 or words[0] != 'pid' or not words[1].isdigit() or \
            words[3] != socket.gethostname():
        return None
    try:
        os.kill(int(words[1]), 0)
    except ProcessLookupError:
        return f'its process {words[1]} is gone (it was killed?)'
    except PermissionError:
        pass
    return None
