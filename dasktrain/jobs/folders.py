"""A job's folder made whole from a request: the one place that turns what
a submitter asked for (a training run or a program, the user's own files
as bytes, the queue's options) and who asked (:class:`Who`) into a job
folder, for a cluster of your own (written by the submitter's process)
and for a shared one (written by root in the scheduler's front door, for
the user the kernel named).

The folder is written in a hidden temp folder and renamed into place once
whole: readers never see half a job, and a failure (a full disk) leaves
nothing behind. A cluster of your own: the folder is 0700, yours. A
shared cluster: the folder is root's, 0711 (its submitter reaches what is
theirs in it, nobody lists it); ``job.json``, ``status.json`` and
``env.json`` are root's, 0600 (the uid a job runs as comes from root's
files only); ``output.log`` is made by root (``O_EXCL|O_NOFOLLOW``) and
handed to the submitter, 0600; ``out/`` (and ``model/``, ``data/``: the
user's copied files) are the submitter's, 0700.

Owns the spec's shape and the folder's files and modes; checking a
request is :mod:`~dasktrain.jobs.protocol`'s and
:mod:`~dasktrain.jobs.submit`'s, queueing it theirs too.
"""
import collections
import json
import os
import pwd
import shutil
import time
from pathlib import Path

from dasktrain.config import ConfigError, TrainConfig
from dasktrain.errors import argument
from dasktrain.files import write_json
from dasktrain.jobs.protocol import FILES
from dasktrain.jobs.records import (
    JobError,
    current_host,
    new_job_id,
    user_name,
)
from dasktrain.userspec import is_spec, split_spec

PROGRAM = 'program'  # job.json's kind of a command job
ENV_FILE = 'env.json'  # the submitter's environment: theirs, or root's

Who = collections.namedtuple('Who', 'uid gid user host shared')
Who.__doc__ = """A job's submitter: uid, primary gid, user name, host, and
whether the job runs in a shared cluster (as that user, by root)."""


def me():
    """This process's user, for a job of a cluster of your own."""
    return Who(os.getuid(), os.getgid(), user_name(os.getuid()),
               current_host(), False)


def submitter(uid):
    """The user ``uid`` (from the kernel) as a shared cluster records
    them: their password database entry (LDAP too, through NSS); JobError
    for a uid without one."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        raise JobError(f'uid {uid} has no entry in the password database; '
                       'a shared cluster runs jobs of known users '
                       'only') from None
    return Who(uid, entry.pw_gid, entry.pw_name, current_host(), True)


def create(root, request, options, who, scheduler, extra=None):
    """Write the job ``request`` asks for into the jobs dir ``root``;
    returns ``(job id, folder, spec)``.

    ``request``: ``kind`` ('train' or 'program'), ``name``, ``gpus``,
    ``notify``; a training run's ``config`` (a TrainConfig's dict; its
    ``data_dir`` absolute) and ``files`` (``{'model' | 'dataset':
    (file name, bytes)}``: the user's files as they were at submit); a
    program's ``command``, ``cwd``, ``env``, ``grace``, ``requeue``.
    ``options``: the queue's keys (``after``, ``time``, ...), checked.
    ``scheduler``: the address it is queued on. ``extra``: more keys.
    """
    root = Path(root)
    program = request['kind'] == PROGRAM
    label = request.get('name') or (
        Path(request['command'][0]).name if program else
        _model_name(request['config'].get('model', '')))
    job_id = new_job_id(label)
    folder = root / job_id
    spec = {'id': job_id, 'name': label, 'user': who.user, 'host': who.host,
            'gpus': request['gpus'], 'workers': None,
            'scheduler': scheduler, 'submitted': time.time(),
            'notify': request.get('notify'), **options, **(extra or {})}
    if who.shared:
        spec.update(uid=who.uid, gid=who.gid)
    files, env = {}, None
    if program:
        spec.update(kind=PROGRAM, command=list(request['command']),
                    cwd=request['cwd'], grace=float(request['grace']),
                    requeue=bool(request['requeue']))
        env = request['env']
    else:
        config, files = _training(request, folder)
        spec.update(workers=config.workers,
                    config=json.loads(config.to_json()))
    _write(root, folder, spec, files, env, who)
    return job_id, folder, spec


def _model_name(model):
    return split_spec(model)[1] if is_spec(model) else model


def _training(request, folder):
    """The job's TrainConfig (paths into its folder) and its files
    ``{relative path: bytes}``."""
    try:
        config = TrainConfig.from_json(json.dumps(request['config']))
    except (ConfigError, TypeError, ValueError) as e:
        raise JobError(f'config: {e}') from None
    if not os.path.isabs(config.data_dir):
        raise JobError(f'{argument("data_dir")} must be absolute here, got '
                       f'{config.data_dir!r}')
    files, changes = {}, {}
    for key, (name, data) in (request.get('files') or {}).items():
        where = f'{FILES[key]}/{name}'
        files[where] = data
        spec = getattr(config, key)
        changes[key] = f'{folder / where}:{split_spec(spec, key)[1]}'
    # Paths as the submitter meant them: the job runs in its folder.
    config = config.replace(out=str(folder / 'out'), resume=True,
                            progress=True, **changes)
    if config.workers is not None:  # every rank holds `gpus`
        config = config.replace(gpus_per_worker=request['gpus'])
    return config, files


def _write(root, folder, spec, files, env, who):
    tmp = root / f'.{folder.name}.tmp'
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(mode=0o700)
        for name, data in files.items():
            (tmp / name).parent.mkdir(mode=0o700, exist_ok=True)
            _new_file(tmp / name, data)
        if env is not None:
            _new_file(tmp / ENV_FILE, json.dumps(env).encode())
        write_json(tmp / 'job.json', spec, mode=0o600)
        write_json(tmp / 'status.json', {
            'state': 'queued', 'attempts': 0, 'gpus': None,
            'worker': None, 'started': None, 'ended': None,
            'error': None}, mode=0o600)
        if who.shared:
            _hand_over(tmp, files, who)
        os.rename(tmp, folder)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise JobError(f'cannot write the job to {root}: {e.strerror} '
                       f'({argument("path")} names the jobs dir)') from None


def _new_file(path, data, mode=0o600):
    """A new file (never an existing one, never through a symlink)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                 | os.O_CLOEXEC, mode)
    with os.fdopen(fd, 'wb') as f:
        f.write(data)


def _hand_over(tmp, files, who):
    """A shared cluster's folder: ``output.log``, ``out/`` and the user's
    copied files are the submitter's; the folder is traversable."""
    _new_file(tmp / 'output.log', b'')
    (tmp / 'out').mkdir(mode=0o700)
    mine = {tmp / 'output.log', tmp / 'out'} | \
        {tmp / name for name in files} | \
        {(tmp / name).parent for name in files}
    for path in mine:
        os.chown(path, who.uid, who.gid, follow_symlinks=False)
    os.chmod(tmp, 0o711)
