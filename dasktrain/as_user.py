"""How a process starts as someone: ``Popen``'s keywords for a user's
credentials, umask and working folder (:func:`popen_options`), the same
for a forked process (:func:`become`), their resource limits (the
submitter's, :data:`RLIMITS`, :func:`capped` to what the process may
have), dying with the thread that started it; why a start failed, in
words. Whom a process runs as is its caller's decision: the keeper
(:mod:`dasktrain.keeper`) applies it with these.
"""
import functools
import os
import resource

from dasktrain.spawn import die_with_parent


def popen_options(user, cwd=None, rlimits=None):
    """``subprocess.Popen`` keywords that start a program in ``cwd`` as
    ``user`` (anything with ``uid``, ``gid``, ``groups``; None: as this
    process), dying with the thread that started it, with ``rlimits``
    (``{name: [soft, hard]}``, :func:`capped` to what it may have).

    As another user: its groups, umask 077, and a ``preexec_fn`` that runs
    after CPython's ``setgroups``/``setregid``/``setreuid``: the kernel
    clears ``PR_SET_PDEATHSIG`` when credentials change, so it is set
    after them; and ``cwd`` is entered as the user (a folder they cannot
    enter is refused by the kernel, not entered by root).
    """
    if user is None:
        return {'cwd': cwd, 'preexec_fn': functools.partial(
            _enter, None, rlimits)}
    return {'user': user.uid, 'group': user.gid,
            'extra_groups': list(user.groups), 'umask': 0o077,
            'preexec_fn': functools.partial(_enter, cwd, rlimits)}


def _enter(cwd, rlimits=None):
    die_with_parent()
    for name, wanted in (rlimits or {}).items():
        which = getattr(resource, f'RLIMIT_{name.upper()}', None)
        if which is None:
            continue
        try:
            resource.setrlimit(which, capped(wanted,
                                             resource.getrlimit(which)))
        except (OSError, ValueError):  # what it had stays
            pass
    if cwd is not None:
        os.chdir(cwd)


# The limits a submitter's process had that its job gets (Slurm's
# PropagateResourceLimits=ALL).
RLIMITS = ('as', 'core', 'cpu', 'data', 'fsize', 'memlock', 'nofile',
           'nproc', 'rss', 'stack')


def capped(wanted, current):
    """The ``(soft, hard)`` limit a program gets that asks for ``wanted``
    where it has ``current`` (each a pair, -1 for unlimited): as asked,
    but a hard limit only ever lowered (the program is no longer root
    when it is set).

    >>> capped((1024, 4096), (1024, 524288)), capped((-1, -1), (8, 64))
    ((1024, 4096), (64, 64))
    >>> capped((100, -1), (-1, -1))
    (100, -1)
    """
    def low(a, b):
        return b if a < 0 else a if b < 0 else min(a, b)
    hard = low(wanted[1], current[1])
    return low(wanted[0], hard), hard


def own_rlimits():
    """``{name: [soft, hard]}`` of this process's :data:`RLIMITS` (what a
    submitter's request carries)."""
    found = {}
    for name in RLIMITS:
        which = getattr(resource, f'RLIMIT_{name.upper()}', None)
        if which is not None:
            found[name] = list(resource.getrlimit(which))
    return found


def cannot_start(program, user, error, cwd=None):
    """Why ``program`` did not start (``error`` from ``Popen``), in
    words; as ``user`` (None: this process's)."""
    if isinstance(error, OSError):
        who = f' as {user.name}' if user else ''
        return f'cannot start {program}{who}: {error.strerror}'
    return f'cannot start {program}: {user.name} cannot enter {cwd}'


def become(user, cwd=None):
    """Make this process ``user``'s (None: stay the keeper's user): its
    groups, gid and uid, umask 077, and dying with the keeper again (a
    change of credentials clears it); then enter ``cwd``."""
    if user is not None:
        os.setgroups(list(user.groups))
        os.setgid(user.gid)
        os.setuid(user.uid)
        os.umask(0o077)
        die_with_parent()
    if cwd is not None:
        os.chdir(cwd)
