"""Whom a job runs as, and what of it root may touch.

In a cluster of your own a job runs as the worker's user. In a shared
cluster (a ``job.json`` with ``uid``, which only root can write) the
worker is root and the job runs as its submitter, as Slurm's slurmd
does: :func:`job_user` is that user as this worker's password database
knows them, with their groups (``os.getgrouplist``); the keeper starts
the program as them (:func:`dasktrain.as_user.popen_options`). What a
user controls (``output.log``) is opened by root without following a
symlink (:func:`open_output`), and read from its end only
(:func:`last_line`).
"""
import collections
import os
import pwd
import stat

from dasktrain.files import read_regular
from dasktrain.jobs.job import JobError

User = collections.namedtuple('User', 'uid gid name home shell groups')
User.__doc__ = "A job's submitter as this worker's password database says."


def job_user(spec):
    """The :class:`User` a job of ``spec`` (its
    :class:`~dasktrain.jobs.record.JobRecord`) runs as, or
    None: a job of a cluster of your own runs as the worker's user.
    JobError where this worker knows no such uid (machines of a shared
    cluster share their users, e.g. through LDAP)."""
    uid = spec.uid
    if uid is None:
        return None
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        raise JobError(f'uid {uid} ({spec.user}) has no entry in '
                       "this worker's password database; the machines of "
                       'a shared cluster must share their users') from None
    gid = entry.pw_gid if spec.gid is None else spec.gid
    return User(uid, gid, entry.pw_name, entry.pw_dir, entry.pw_shell,
                os.getgrouplist(entry.pw_name, gid))


def open_output(folder, user):
    """``output.log`` of the job in ``folder``, for appending: made if
    missing (the user's, 0600, in a shared cluster), never through a
    symlink; a file object."""
    path = os.path.join(folder, 'output.log')
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        if user is not None:
            os.fchown(fd, user.uid, user.gid)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise JobError(f'{path} is not a regular file')
    return os.fdopen(fd, 'ab')


def last_line(folder, user, size=8192, name='output.log'):
    """The last line of the job's ``output.log`` (or another of its logs,
    ``name``; '' if none), read from its end only (a user may have made
    it huge)."""
    path = os.path.join(folder, name)
    try:
        length = os.lstat(path).st_size
        data = read_regular(path, None if user is None else user.uid,
                            max(length - size, 0), size)
    except OSError:
        return ''
    lines = data.decode('utf-8', 'replace').strip().splitlines()
    return lines[-1] if lines else ''
