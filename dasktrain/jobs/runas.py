"""Who a job's child process runs as, and what of it root may touch.

In a cluster of your own a job's child runs as the worker's user, as
before. In a shared cluster (a ``job.json`` with ``uid``, which only
root can write) the worker is root and the child runs as the job's
submitter, as Slurm's slurmd does: :func:`dasktrain.keeper.popen_options`
gives
``subprocess.Popen`` the user, the primary group and the user's groups
(``os.getgrouplist``), umask 077, and a ``preexec_fn`` that runs
*after* CPython's ``setgroups``/``setregid``/``setreuid``
(``Modules/_posixsubprocess.c``: ``preexec_fn`` comes last): the
kernel clears ``PR_SET_PDEATHSIG`` when credentials change, so
:func:`dasktrain.spawn.die_with_parent` must come after them to hold;
and the folder the job runs in is entered as the user (a folder they
cannot enter is refused by the kernel, not entered by root).

Its environment (:func:`environment`) is the recorded one for a program
or the worker's minus the cluster's own settings (``--notify`` URL, its
state folder, Dask's) for a training run, with ``HOME``, ``USER`` and
``LOGNAME`` of the user. What a user controls (``output.log``) is
opened by root without following a symlink (:func:`open_output`).

Owns those decisions; running the job is
:mod:`~dasktrain.jobs.worker`'s.
"""
import collections
import os
import pwd
import stat

from dasktrain.files import read_regular
from dasktrain.jobs.records import JobError

User = collections.namedtuple('User', 'uid gid name home shell groups')
User.__doc__ = "A job's submitter as this worker's password database says."
# The cluster's own settings: never a user's job's.
PRIVATE = ('DASKTRAIN_NOTIFY', 'DASKTRAIN_HOME', 'DASKTRAIN_SHARED_SERVE',
           'DASKTRAIN_SHARED_OWNER', 'DASKTRAIN_SHARED_DIR',
           'DASKTRAIN_JOBS_DIR')
PRIVATE_PREFIXES = ('DASK_', 'SUDO_')


def job_user(spec):
    """The :class:`User` a job of ``spec`` (its ``job.json``) runs as, or
    None: a job of a cluster of your own runs as the worker's user.
    JobError where this worker knows no such uid (machines of a shared
    cluster share their users, e.g. through LDAP)."""
    uid = spec.get('uid')
    if uid is None:
        return None
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        raise JobError(f'uid {uid} ({spec.get("user")}) has no entry in '
                       "this worker's password database; the machines of "
                       'a shared cluster must share their users') from None
    gid = spec.get('gid', entry.pw_gid)
    return User(uid, gid, entry.pw_name, entry.pw_dir, entry.pw_shell,
                os.getgrouplist(entry.pw_name, gid))


def environment(env, user, recorded=False):
    """The child's environment: ``env`` (the recorded one where
    ``recorded``, else the worker's without :data:`PRIVATE`) with
    ``user``'s ``HOME``, ``USER`` and ``LOGNAME``; ``env`` as it is
    without a user.

    >>> u = User(1001, 1001, 'ann', '/home/ann', '/bin/sh', [1001])
    >>> environment({'PATH': '/bin', 'DASK_X': '1', 'USER': 'root'}, u)
    {'PATH': '/bin', 'USER': 'ann', 'HOME': '/home/ann', 'LOGNAME': 'ann'}
    """
    if user is None:
        return dict(env)
    if not recorded:
        env = {k: v for k, v in env.items() if k not in PRIVATE and
               not k.startswith(PRIVATE_PREFIXES)}
    return dict(env, USER=user.name, HOME=user.home, LOGNAME=user.name)


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


def last_line(folder, user, size=8192):
    """The last line of the job's ``output.log`` ('' if none), read from
    its end only (a user may have made it huge)."""
    path = os.path.join(folder, 'output.log')
    try:
        length = os.lstat(path).st_size
        data = read_regular(path, None if user is None else user.uid,
                            max(length - size, 0), size)
    except OSError:
        return ''
    lines = data.decode('utf-8', 'replace').strip().splitlines()
    return lines[-1] if lines else ''
