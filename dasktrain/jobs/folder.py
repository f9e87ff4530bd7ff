"""A job's folder made whole from a checked :class:`~dasktrain.jobs.request.
JobRequest` and who asked (:class:`Who`): the one place that writes a new
job, for a cluster of your own (the submitter's process writes it) and
for a shared one (root writes it in the scheduler, for the user the
kernel named).

The folder is written in a hidden temp folder and renamed into place once
whole: readers never see half a job, and a failure (a full disk) leaves
nothing behind. A cluster of your own: the folder is 0700, yours. A
shared cluster: the folder is root's, 0711 (its submitter reaches what is
theirs in it, nobody lists it); ``job.json``, ``status.json`` and
``env.json`` (the submitter's environment, secrets included) are root's,
0600 (the uid a job runs as comes from root's files only);
``output.log`` is made by root (``O_EXCL|O_NOFOLLOW``) and handed to the
submitter, 0600; ``out/`` (and ``model/``, ``data/``: the user's copied
files) are the submitter's, 0700.
"""
import collections
import json
import os
import pwd
import shutil
import time
from pathlib import Path

from dasktrain.errors import argument
from dasktrain.files import write_json
from dasktrain.jobs.job import (
    NEW_STATUS,
    JobError,
    current_host,
    new_job_id,
    user_name,
)
from dasktrain.jobs.record import VERSION

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


def create(root, request, who, scheduler):
    """Write the job ``request`` (a checked
    :class:`~dasktrain.jobs.request.JobRequest`) asks for into the jobs
    dir ``root``, for ``who``, queued on ``scheduler`` (its address);
    returns ``(job id, folder, spec)``, ``spec`` being its ``job.json``."""
    root = Path(root)
    program = request.program
    job_id = new_job_id(request.label)
    folder = root / job_id
    spec = {'version': VERSION, 'id': job_id, 'name': request.label,
            'user': who.user,
            'host': who.host, 'gpus': request.gpus,
            'workers': request.workers, 'scheduler': scheduler,
            'submitted': time.time(), 'notify': request.notify,
            'after': list(request.after), 'after_any': request.after_any,
            'time': request.time, 'time_limit': request.time_limit,
            'mem': request.mem, 'rlimits': dict(request.rlimits)}
    if who.shared:
        spec.update(uid=who.uid, gid=who.gid)
    more, files = program.spec(folder, request.gpus)
    spec.update(more)
    _write(root, folder, spec, files, program.env, who)
    return job_id, folder, spec


def _write(root, folder, spec, files, env, who):
    tmp = root / f'.{folder.name}.tmp'
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(mode=0o700)
        for name, data in files.items():
            (tmp / name).parent.mkdir(mode=0o700, exist_ok=True)
            _new_file(tmp / name, data)
        _new_file(tmp / ENV_FILE, json.dumps(env).encode())
        write_json(tmp / 'job.json', spec, mode=0o600)
        write_json(tmp / 'status.json', NEW_STATUS, mode=0o600)
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
