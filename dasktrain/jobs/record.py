"""A job's ``job.json`` read back typed, once: :class:`JobRecord`, what the
job was asked to be, its fields and its format's version checked
(:data:`VERSION`), and its methods, which answer every question a job's
kind decides (a command or a training run; one process or a gang of
ranks across workers): what it runs (:meth:`~JobRecord.program`), what
its own task holds (:meth:`~JobRecord.task_resources`,
:attr:`~JobRecord.gpus_here`), where it holds GPUs while it runs
(:meth:`~JobRecord.holding`), how its program's ending becomes its state
(:meth:`~JobRecord.end`). Nothing outside them asks which kind a job is,
but the queue's plan, which places a gang's ranks.

:func:`~dasktrain.jobs.folder.create` writes ``job.json`` (with
:data:`VERSION`); anyone reads it back with
:meth:`dasktrain.jobs.job.Job.spec`.
"""
import dataclasses
import json

from dasktrain.jobs.ending import job_end
from dasktrain.jobs.fields import NUMBER, JobError, checked
from dasktrain.spawn import python

VERSION = 1  # job.json's format: a folder of another is refused
# The module a training job's program runs: ``python -m TRAIN_JOB FOLDER``.
TRAIN_JOB = 'dasktrain.jobs.worker.train_job'
COLLECTIVE_TIMEOUT = 300.0  # s: TrainConfig's default

# job.json's keys: key -> (what it must be, required).
FIELDS = {'version': (int, False), 'id': (str, False),
          'submitted': (NUMBER, True), 'name': (str, False),
          'user': (str, False), 'host': (str, False), 'gpus': (int, True),
          'workers': (int, False), 'scheduler': (str, False),
          'notify': (str, False), 'after': (list, False),
          'after_any': (bool, False), 'time': (NUMBER, False),
          'time_limit': (NUMBER, False), 'uid': (int, False),
          'gid': (int, False), 'command': (list, False), 'cwd': (str, False),
          'grace': (NUMBER, False), 'requeue': (bool, False),
          'config': (dict, False), 'module': (str, False),
          'mem': (int, False), 'rlimits': (dict, False),
          'trial': (dict, False)}


@dataclasses.dataclass(frozen=True)
class JobProgram:
    """What a job runs: ``argv`` in ``cwd``, given ``stdin`` (text or
    None); ``said``: its start in words, for the job's log."""
    argv: list
    cwd: str
    stdin: str | None
    said: str


@dataclasses.dataclass(frozen=True)
class JobRecord:
    """A job's ``job.json``, checked (see the module); ``data``: the file
    as written (what a shared cluster's socket returns, what recovery
    writes again with another scheduler).

    Examples
    --------
    >>> r = JobRecord.of({'version': 1, 'submitted': 1.0, 'gpus': 2,
    ...                   'workers': 3, 'config': {'epochs': 5}})
    >>> r.epochs, r.gpus_here, r.task_resources(), r.gpus_in_all([])
    (5, 0, None, 6)
    >>> r.gpus_asked()
    '2 x 3'
    >>> c = JobRecord.of({'version': 1, 'submitted': 1.0, 'gpus': 0,
    ...                   'command': ['true'], 'cwd': '/tmp'})
    >>> c.epochs, c.gpus_here, c.task_resources(), c.program('/j', None).argv
    (None, 0, {'CPU': 1}, ['true'])
    """
    data: dict = dataclasses.field(repr=False)
    # who asked, and when
    submitted: float = 0.0
    id: str | None = None
    name: str | None = None
    user: str | None = None
    uid: int | None = None
    gid: int | None = None
    # what it holds, for how long, where it queues
    gpus: int = 0
    workers: int | None = None
    mem: int | None = None
    after_any: bool = False
    after: list = dataclasses.field(default_factory=list)
    time: float | None = None
    time_limit: float | None = None
    rlimits: dict = dataclasses.field(default_factory=dict)
    scheduler: str | None = None
    notify: str | None = None
    host: str | None = None
    # what runs
    command: list | None = None
    cwd: str | None = None
    requeue: bool = False
    grace: float | None = None
    config: dict | None = None
    module: str | None = None
    trial: dict | None = None

    @classmethod
    def of(cls, data, where='job.json'):
        """The record of ``data`` (a decoded ``job.json``): something to
        run, ``gpus`` >= 0, ``after`` job ids, a command of strings, a
        config with its epochs, this format's :data:`VERSION`; JobError
        in one line otherwise.

        >>> JobRecord.of({'submitted': 'x', 'gpus': 0, 'command': ['t']})
        Traceback (most recent call last):
        ...
        dasktrain.jobs.fields.JobError: job.json has submitted='x', not a \
time in seconds
        >>> JobRecord.of({'submitted': 1.0, 'gpus': 0, 'command': ['t']})
        Traceback (most recent call last):
        ...
        dasktrain.jobs.fields.JobError: job.json is of no known format \
(version None; this dasktrain reads version 1): submit the job again
        """
        checked(data, FIELDS, where, more=lambda data: [] if 'command' in
                data or 'config' in data else ['config'])
        if data['gpus'] < 0 or (data.get('workers') is not None and
                                data['workers'] < 1):
            raise JobError(f'{where} has gpus={data["gpus"]}, workers='
                           f'{data.get("workers")}')
        if 'command' in data and not (data['command'] and all(
                isinstance(a, str) for a in data['command'])):
            raise JobError(f'{where} has a command that is not strings')
        if 'config' in data and \
                type(data['config'].get('epochs')) is not int:
            raise JobError(f'{where} lacks config.epochs')
        if not all(isinstance(a, str) for a in data.get('after') or ()):
            raise JobError(f'{where} has after that is not job ids')
        if data.get('version') != VERSION:
            raise JobError(f'{where} is of no known format (version '
                           f'{data.get("version")}; this dasktrain reads '
                           f'version {VERSION}): submit the job again')
        known = {k: v for k, v in data.items() if k in FIELDS and
                 k != 'version' and v is not None}
        known['after'] = list(known.get('after', ()))
        return cls(dict(data), **known)

    # ----------------------------------------------- what its kind decides

    @property
    def gang(self):
        """Whether it is a training job across workers (a gang): its
        ranks hold its GPUs, ``gpus`` each, not its task."""
        return self.workers is not None

    @property
    def epochs(self):
        """A training job's epochs; None for a command."""
        return None if self.config is None else self.config['epochs']

    @property
    def on_worker_loss(self):
        """What a gang does when a rank's worker dies ('continue': the
        ranks left go on from the last checkpoint; 'wait': the job ends,
        to be requeued)."""
        return (self.config or {}).get('on_worker_loss') or 'continue'

    @property
    def collective_timeout(self):
        """Seconds a gang's collective waits for a peer."""
        return float((self.config or {}).get('collective_timeout') or
                     COLLECTIVE_TIMEOUT)

    @property
    def gpus_here(self):
        """GPUs the job's own task holds on its worker: its ``gpus``, none
        for a gang."""
        return 0 if self.gang else self.gpus

    def task_resources(self):
        """The Dask resources of the job's task: its GPUs, else a CPU
        slot; None for a gang's (its ranks' tasks hold theirs)."""
        if self.gang:
            return None
        return {'GPU': self.gpus} if self.gpus else {'CPU': 1}

    def gpus_in_all(self, held):
        """GPUs it holds while it runs, its task holding ``held``: a
        gang's ranks, ``gpus`` each."""
        return self.gpus * self.workers if self.gang else len(held)

    def gpus_asked(self):
        """Its GPUs as asked, in words: ``'2'``, or ``'2 x 3'`` for a
        gang of 3 ranks of 2 each."""
        return f'{self.gpus} x {self.workers}' if self.gang else \
            str(self.gpus)

    def holding(self, placed, worker, ids):
        """Where it holds GPUs while it runs, ``[(worker, GPU ids, whether
        a Dask task of a rank of its own holds them there)]``: a gang's
        ranks where the queue ``placed`` them (``[(worker, ids)]``); else
        its task's ``worker`` and ``ids``."""
        if self.gang:
            return [(w, list(held), True) for w, held in placed]
        return [(worker, list(ids), False)]

    def program(self, folder, user):
        """What it runs in its ``folder`` as ``user`` (None: this
        process's user): its command, or its training program (given this
        record on standard input where it runs as its submitter, who
        cannot read root's ``job.json``). JobError for a module that is
        not dasktrain's (``job.json`` names code)."""
        if self.command is not None:
            argv = list(self.command)
            return JobProgram(argv, self.cwd, None,
                              f'in {self.cwd}: {" ".join(argv)}')
        module = self.module or TRAIN_JOB
        if not module.startswith('dasktrain.'):
            raise JobError(f'{module!r} is not ours')
        return JobProgram(python(module, folder) +
                          (['--spec-stdin'] if user else []), str(folder),
                          json.dumps(self.data) if user else None,
                          'starting')

    def end(self, code, stopped=None, reason=None, failure=None, oom=False,
            last=None):
        """Its :class:`~dasktrain.jobs.ending.JobEnd` where its program
        ended so (:func:`~dasktrain.jobs.ending.job_end`'s arguments);
        ``last()``: its output's last line, a training program's one-line
        error (a command's is not asked)."""
        training = self.command is None
        if failure is None and training and last is not None:
            failure = last()
        return job_end(code, training, stopped, reason, failure, oom)
