"""One job request: what a submitter asks of the queue, checked once, the
same in the submitter's process, on the wire and in a shared cluster's
scheduler.

A :class:`JobRequest` holds the queue's fields once (GPUs, name,
``notify``, ``after``, ``after_any``, ``time``, ``time_limit``) and what
runs, its *program*: a :class:`Program` (any command, ``submit --
PROGRAM``) or a :class:`Training` (a TrainConfig, which the job's worker
runs as a program of its own, ``python -m dasktrain.jobs.worker.train_job``).
Both carry the submitter's environment (a program its folder too): a
job never runs in its worker's environment.

``Training.of(config)`` and ``Program.of(argv)`` are made in the
submitter's process (as that user: the user's model and data files are
read there, as bytes; a shared cluster's root never opens a path a user
names); :meth:`JobRequest.from_wire` checks every field of a request
that came over a shared cluster's socket (types, sizes, names: the kit
of :mod:`~dasktrain.jobs.fields`) and
:meth:`JobRequest.wire` is its inverse. What the queue then checks
against the cluster (:meth:`~JobRequest.check_fits`, by
:mod:`~dasktrain.jobs.fits`, and the jobs ``after`` names) is asked here
too, for both kinds of cluster.
"""
import base64
import binascii
import dataclasses
import json
import os
import re
from pathlib import Path

from dasktrain.as_user import own_rlimits
from dasktrain.errors import argument
from dasktrain.jobs.fields import (
    MAX_TEXT,
    JobError,
    absolute_path,
    after_ids,
    environment,
    fail,
    flag,
    job_id,
    parse_size,
    parse_time,
    rlimits,
    seconds,
    text,
)
from dasktrain.jobs.fits import check_fits
from dasktrain.jobs.record import TRAIN_JOB
from dasktrain.notify import check_target
from dasktrain.parallel.gpus import gpu_ids

MAX_MEM = 2 ** 50  # bytes: a --mem beyond any machine is a typo
FILES = {'model': 'model', 'dataset': 'data'}  # request key -> folder
_FILE = re.compile(r'[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}\.py')
TRAINING_GRACE = 10.0  # s a training job's stop waits before SIGKILL


# ------------------------------------------------------ the programs

@dataclasses.dataclass(frozen=True)
class Program:
    """Any program: ``command`` (argv, no shell) run in ``cwd`` with
    ``env``; ``grace`` seconds between a stop's SIGTERM and its SIGKILL
    (None: the cluster's longest, ``cluster start --max-grace``);
    ``requeue``: start it again if its worker dies (it resumes by itself),
    else it ends ``lost``."""
    command: list
    cwd: str
    env: dict
    grace: float | None = None
    requeue: bool = False

    @classmethod
    def of(cls, argv, env=None, cwd=None, grace=None, requeue=False):
        """The program ``argv`` as its submitter runs it now: their
        folder (``cwd``, default the working directory, made absolute)
        and environment, plus ``env``. JobError naming the argument."""
        if isinstance(argv, str) or not argv or \
                not all(isinstance(a, str) for a in argv):
            raise JobError(f'a command job needs a program and its '
                           f'arguments as a list of strings, got {argv!r}')
        if grace is not None and not (
                isinstance(grace, (int, float)) and grace >= 0):
            raise JobError(f'{argument("grace")} must be seconds >= 0, got '
                           f'{grace!r}')
        cwd = os.path.abspath(cwd or os.getcwd())
        if not os.path.isdir(cwd):
            raise JobError(f'the job would run in {cwd}, which is not a '
                           'folder')
        return cls(list(argv), cwd, dict(os.environ, **(env or {})),
                   None if grace is None else float(grace), bool(requeue))

    kind = 'program'  # its key on the wire
    workers = None
    uses_cupy = False  # a program's GPUs are its own business

    @property
    def label(self):
        return Path(self.command[0]).name

    def check(self, gpus):
        """Nothing to check against ``gpus``: a program sees its GPUs."""

    def spec(self, folder, gpus):
        """Its keys of the job's ``job.json``, and the files to write
        (none)."""
        return {'command': list(self.command), 'cwd': self.cwd,
                'grace': self.grace, 'requeue': self.requeue}, {}

    def wire(self):
        return {'command': list(self.command), 'cwd': self.cwd,
                'env': dict(self.env), 'grace': self.grace,
                'requeue': self.requeue}

    @classmethod
    def from_wire(cls, message):
        command = message.get('command')
        if not isinstance(command, list) or not command or \
                len(command) > 65536:
            fail('command must be a non-empty list of strings')
        return cls([text(a, 'command', MAX_TEXT) for a in command],
                   absolute_path(message.get('cwd')),
                   environment(message.get('env')),
                   seconds(message.get('grace'), 'grace', zero=True),
                   flag(message.get('requeue', False), 'requeue'))


@dataclasses.dataclass(frozen=True)
class Training:
    """A training run: ``config`` (a TrainConfig as JSON, its paths
    absolute), the submitter's ``env``, the user's ``files`` (``{'model' |
    'dataset': (file name, bytes)}``, as they were at submit); ``module``:
    the ``dasktrain`` module the job's program runs (``python -m MODULE
    FOLDER``: :data:`~dasktrain.jobs.record.TRAIN_JOB`, or a
    search's trial), with ``extra`` keys for its ``job.json``."""
    config: dict
    env: dict
    files: dict = dataclasses.field(default_factory=dict)
    module: str = TRAIN_JOB
    extra: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, config, env=None, module=TRAIN_JOB, extra=None):
        """The run ``config`` as its submitter asks for it: the user's
        model and data checked and made absolute, their files read now
        (editing one later changes no job), their environment. JobError
        naming the argument."""
        from dasktrain.data.datasets import resolve_spec
        from dasktrain.data.datasets import spec_file as dataset_file
        from dasktrain.userspec import is_spec, spec_file
        if is_spec(config.model):  # the user's model: one line if wrong
            from dasktrain.training.models import resolve_model  # Chainer
            config = config.replace(model=resolve_model(config.model,
                                                        config.model_args))
        # The job runs in its own folder: every path made absolute here.
        config = config.replace(dataset=resolve_spec(config.dataset),
                                data_dir=os.path.abspath(config.data_dir))
        files = {}
        for key, source in (('model', spec_file(config.model)
                             if is_spec(config.model) else None),
                            ('dataset', dataset_file(config.dataset))):
            if source is not None:
                try:
                    files[key] = (source.name, source.read_bytes())
                except OSError as e:
                    raise JobError(f'cannot read {argument(key)} file '
                                   f'{source} ({e.strerror})') from None
        return cls(json.loads(config.to_json()),
                   dict(os.environ, **(env or {})), files, module,
                   dict(extra or {}))

    kind = 'training'  # its key on the wire

    def train_config(self):
        """The TrainConfig; JobError if it is not one."""
        from dasktrain.config import ConfigError, TrainConfig
        try:
            return TrainConfig.from_json(json.dumps(self.config))
        except (ConfigError, TypeError, ValueError) as e:
            raise JobError(f'config: {e}') from None

    @property
    def label(self):
        from dasktrain.userspec import is_spec, split_spec
        model = self.config.get('model', '')
        return split_spec(model)[1] if is_spec(model) else model

    @property
    def workers(self):
        """Its ranks across workers (None: one process)."""
        return self.config.get('workers')

    @property
    def uses_cupy(self):
        """Whether it trains on the GPUs it holds: its own ``devices``
        (if any) name GPUs (``--devices cpu`` trains on the CPU whatever
        it holds)."""
        devices = self.config.get('devices')
        return not devices or bool(gpu_ids(devices))

    def check(self, gpus):
        """:func:`check_devices` of its config."""
        check_devices(self.train_config(), gpus)

    def spec(self, folder, gpus):
        """Its keys of the job's ``job.json`` (the config with its paths
        into ``folder``, where the job runs; its worker resumes it from
        its checkpoint) and the user's files ``{relative path: bytes}``."""
        from dasktrain.userspec import split_spec
        config = self.train_config()
        if not os.path.isabs(config.data_dir):
            raise JobError(f'{argument("data_dir")} must be absolute here, '
                           f'got {config.data_dir!r}')
        files, changes = {}, {}
        for key, (name, data) in self.files.items():
            where = f'{FILES[key]}/{name}'
            files[where] = data
            changes[key] = f'{Path(folder) / where}:' \
                f'{split_spec(getattr(config, key), key)[1]}'
        config = config.replace(out=str(Path(folder) / 'out'), resume=True,
                                progress=True, **changes)
        if config.workers is not None:  # every rank holds `gpus`
            config = config.replace(gpus_per_worker=gpus)
        return {'config': json.loads(config.to_json()),
                'module': self.module, 'grace': TRAINING_GRACE,
                'requeue': True, **self.extra}, files

    def wire(self):
        return {'config': self.config, 'env': dict(self.env),
                'module': self.module, 'extra': self.extra,
                'files': {key: {'name': name,
                                'data': base64.b64encode(data).decode()}
                          for key, (name, data) in self.files.items()}}

    @classmethod
    def from_wire(cls, message):
        if not isinstance(message.get('config'), dict):
            fail('config must be a JSON object (a TrainConfig)')
        module = text(message.get('module', TRAIN_JOB), 'module', 200)
        if not re.fullmatch(r'dasktrain(\.[a-z_]+)+', module):
            fail(f'module must be one of dasktrain\'s, got {module!r}'[:200])
        extra = message.get('extra') or {}
        if not isinstance(extra, dict) or set(extra) - {'trial'}:
            fail('extra takes trial only')
        return cls(message['config'], environment(message.get('env')),
                   _files(message.get('files') or {}), module, extra)


def _files(files):
    """``{'model' | 'dataset': {'name': 'x.py', 'data': base64}}`` ->
    ``{key: (name, bytes)}``."""
    if not isinstance(files, dict) or set(files) - set(FILES):
        fail(f'files takes {" and ".join(FILES)} only')
    decoded = {}
    for key, entry in files.items():
        if not isinstance(entry, dict) or set(entry) != {'name', 'data'} or \
                not isinstance(entry['name'], str) or \
                not _FILE.fullmatch(entry['name']) or \
                not isinstance(entry['data'], str):
            fail(f'files.{key} must be {{"name": "file.py", "data": '
                 'base64}')
        try:
            data = base64.b64decode(entry['data'], validate=True)
        except (binascii.Error, ValueError):
            fail(f'files.{key}.data is not base64')
        decoded[key] = (entry['name'], data)
    return decoded


def check_devices(config, gpus):
    """Refuse a run (a TrainConfig) whose own ``devices`` name GPUs other
    than the ``gpus`` it holds (the queue picks which GPUs a job gets),
    or whose ``gpus_per_worker`` contradicts them.

    Examples
    --------
    >>> from dasktrain.config import TrainConfig
    >>> check_devices(TrainConfig(devices=('@cupy:2', '@cupy:3')), gpus=2)
    >>> check_devices(TrainConfig(devices=('@cupy:0',)), gpus=0)
    Traceback (most recent call last):
    ...
    dasktrain.jobs.fields.JobError: devices 0 names 1 GPU but 0 were...
    """
    from dasktrain.parallel.gpus import GpuError, place_devices
    if config.workers is not None and \
            config.gpus_per_worker not in (None, gpus):
        raise JobError(f'{argument("gpus_per_worker")} '
                       f'{config.gpus_per_worker} contradicts '
                       f'{argument("gpus")} {gpus} (GPUs per worker of a '
                       'job across workers): pass one of them')
    if config.devices is None:
        return
    try:  # with workers: per rank, each holding `gpus`
        place_devices(config.devices, range(gpus))
    except GpuError as e:
        raise JobError(str(e)) from None


# ---------------------------------------------------------- the request

PROGRAMS = {c.kind: c for c in (Program, Training)}  # what runs, by key


@dataclasses.dataclass(frozen=True)
class JobRequest:
    """A job as its submitter asks for it (see the module).

    Parameters
    ----------
    program : Program or Training
        What runs.
    gpus : int, default 1
        GPUs it holds (0: a CPU slot). A training job across workers
        (its config's ``workers``) holds them on every rank.
    name : str, optional
        A label for listings; default the program's, or the model's.
    notify : str, optional
        Told when it ends (a webhook URL or ``mailto:``); default the
        cluster's.
    after : list of str
        Job ids it starts after, once they finished (with ``after_any``:
        once they ended, however).
    time, time_limit : float, optional
        Seconds it is expected to run (its estimated end), and may run
        (stopped, failed, once past).
    mem : int, optional
        Bytes its processes may use together (its cgroup's ``memory.max``).
    rlimits : dict
        Its submitter's resource limits, ``{name: [soft, hard]}``.

    Examples
    --------
    >>> request = JobRequest(Program(['true'], '/tmp', {}), gpus=0,
    ...                      time=parse_time('2h'))
    >>> JobRequest.from_wire(request.wire()) == request
    True
    """
    program: Program | Training
    gpus: int = 1
    name: str | None = None
    notify: str | None = None
    after: list = dataclasses.field(default_factory=list)
    after_any: bool = False
    time: float | None = None
    time_limit: float | None = None
    mem: int | None = None
    rlimits: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if type(self.gpus) is not int or not 0 <= self.gpus <= 4096:
            raise JobError(f'{argument("gpus")} must be an int >= 0, got '
                           f'{self.gpus!r}')
        if self.mem is not None and not (type(self.mem) is int and
                                         0 < self.mem <= MAX_MEM):
            raise JobError(f'{argument("mem")} must be bytes > 0, got '
                           f'{self.mem!r}')
        if self.after_any and not self.after:
            raise JobError(f'{argument("after_any")} needs '
                           f'{argument("after")} ID[,ID]')
        self.program.check(self.gpus)

    @classmethod
    def of(cls, program, gpus=1, name=None, notify=None, after=None,
           after_any=False, time=None, time_limit=None, mem=None):
        """A request from a submitter's arguments (``after`` a list or
        ``'ID,ID'``; durations as seconds or words such as ``2h``; ``mem``
        bytes or words such as ``8G``), each checked, with this process's
        resource limits; JobError naming the argument."""
        return cls(program, gpus, name, check_target(notify),
                   after_ids(after), bool(after_any),
                   None if time is None else parse_time(time, 'time'),
                   None if time_limit is None else
                   parse_time(time_limit, 'time_limit'),
                   None if mem is None else parse_size(mem, 'mem'),
                   own_rlimits())

    @property
    def label(self):
        return self.name or self.program.label

    @property
    def workers(self):
        """Ranks of a training job across workers; None otherwise."""
        return self.program.workers

    def wire(self):
        """The request as a shared cluster's socket carries it."""
        return {'gpus': self.gpus, 'name': self.name, 'notify': self.notify,
                'after': list(self.after), 'after_any': self.after_any,
                'time': self.time, 'time_limit': self.time_limit,
                'mem': self.mem, 'rlimits': dict(self.rlimits),
                self.program.kind: self.program.wire()}

    @classmethod
    def from_wire(cls, message):
        """The request in ``message`` (a decoded JSON object) with every
        field checked; RequestError naming the first field that is wrong,
        or one too many."""
        extra = set(message) - set(FIELDS)
        if extra:
            fail(f'submit takes no {sorted(extra)[0]}')
        kinds = [k for k in PROGRAMS if k in message]
        if len(kinds) != 1:
            fail('submit takes a program or a training, one of them')
        if not isinstance(message[kinds[0]], dict):
            fail(f'{kinds[0]} must be a JSON object')
        gpus = message.get('gpus')
        if type(gpus) is not int or not 0 <= gpus <= 4096:
            fail('gpus must be an int >= 0')
        after = message.get('after') or []
        if not isinstance(after, list) or len(after) > 1000:
            fail('after must be a list of job ids')
        return cls(PROGRAMS[kinds[0]].from_wire(message[kinds[0]]), gpus,
                   text(message.get('name'), 'name', 200, True),
                   check_target(text(message.get('notify'), 'notify',
                                     4096, True)),
                   [job_id(a) for a in after],
                   flag(message.get('after_any', False), 'after_any'),
                   seconds(message.get('time'), 'time'),
                   seconds(message.get('time_limit'), 'time_limit'),
                   message.get('mem'), rlimits(message.get('rlimits') or {}))

    def check_after(self, root):
        """JobError unless every job ``after`` names is in the jobs dir
        ``root``."""
        for dep in self.after:
            if not (Path(root) / dep / 'job.json').exists():
                raise JobError(f'{argument("after")}: no job {dep!r} in '
                               f'{root}; `dasktrain jobs` lists them')

    def check_fits(self, resources, unusable=None):
        """Refuse a job no worker can ever run: more GPUs (or CPU slots,
        for ``gpus=0``) than any worker of ``resources`` (``{address:
        {'GPU': n, 'CPU': m}}``) offers; for a job across workers, fewer
        such workers than its ranks. ``unusable``: ``{address: line}`` of
        the workers whose machine has GPUs CuPy cannot use
        (:data:`~dasktrain.jobs.worker.gpu_use.UNUSABLE_METRIC`): a
        training job on GPUs does not count them, and a refusal says
        why."""
        check_fits(resources, self.workers, self.gpus, unusable,
                   self.needs_cupy)

    @property
    def needs_cupy(self):
        """Whether it trains with dasktrain on the GPUs it holds: a
        training job holding GPUs, whose own ``devices`` (if any) name
        GPUs (``--devices cpu`` trains on the CPU whatever it holds)."""
        return bool(self.gpus) and self.program.uses_cupy


FIELDS = ('gpus', 'name', 'notify', 'after', 'after_any', 'time',
          'time_limit', 'mem', 'rlimits', *PROGRAMS)
