"""Who, besides the users trusted with it, can change what a path holds:
the rule over the owner, group and mode of the path and of every folder
above it, as a Unix user who wants another's files would use them.

A stranger changes ``/a/b/c`` if they own any of ``/``, ``/a``, ``/a/b``
or ``/a/b/c`` (an owner may chmod), or may write one of them: a folder
above lets them rename what it holds and put their own in its place (a
``sitecustomize.py`` in a run's folder, a module in root's ``sys.path``),
unless it is sticky (``/tmp``: only an entry's owner may rename it, and
the entry is checked next); ``c`` itself lets them plant a file or a
symlink among yours. A group's write counts as a stranger's unless the
group is its owner's own (their primary group, with no other member: the
group ``useradd`` makes for each user). A symlink on the way is its
folder's to change, and what it points to is checked too (the real
path, every folder of it).

:func:`opening` is that rule (standard library only: a shared install's
check runs it); :func:`words` says what it found in one line. Who is
trusted is the caller's: root alone for what root's processes import,
root and you for your run's output folder.
"""
import grp
import os
import pwd
import stat


def private_group(gid, uid):
    """Whether the group ``gid`` is the user ``uid``'s own: their primary
    group, with no member but them."""
    try:
        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except KeyError:
        return False
    return user.pw_gid == gid and set(group.gr_mem) <= {user.pw_name}


def _chain(path):
    """``path`` (absolute, normalised) and every folder above it, from
    ``/`` down.

    >>> _chain('/a/b')
    ['/', '/a', '/a/b']
    """
    parts = [p for p in path.split('/') if p]
    return ['/'] + ['/' + '/'.join(parts[:i + 1]) for i in range(len(parts))]


def _why(found, last, trusted, private):
    """Why a stranger can change a path whose ``lstat`` is ``found``
    (``last``: the path itself, not a folder above it), or None."""
    if found.st_uid not in trusted:
        return f'owned by {_user(found.st_uid)}'
    sticky = stat.S_ISDIR(found.st_mode) and found.st_mode & stat.S_ISVTX
    if found.st_mode & stat.S_IWOTH and (last or not sticky):
        return 'writable by every user'
    if found.st_mode & stat.S_IWGRP and (last or not sticky) and \
            not private(found.st_gid, found.st_uid):
        return f'writable by the group {_group(found.st_gid)}'
    return None


def opening(path, trusted, lstat=os.lstat, private=private_group,
            real=os.path.realpath):
    """The first place where someone not in ``trusted`` (uids) can change
    what ``path`` holds (see the module): ``(place, its lstat, why)``, or
    None where only they can. ``lstat``, ``private``, ``real``: the
    system's, or a test's table. OSError where a folder cannot be
    looked at (a missing one).

    Examples
    --------
    >>> import os
    >>> S = os.stat_result
    >>> table = {'/': S((0o40755, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    ...          '/tmp': S((0o41777, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    ...          '/tmp/run': S((0o40755, 0, 0, 0, 1001, 1001, 0, 0, 0, 0)),
    ...          '/lab': S((0o40775, 0, 0, 0, 0, 50, 0, 0, 0, 0))}
    >>> same = {'lstat': table.__getitem__, 'real': lambda p: p,
    ...         'private': lambda gid, uid: False}
    >>> opening('/tmp/run', {0, 1001}, **same) is None
    True
    >>> opening('/tmp/run', {0, 1002}, **same)[0]
    '/tmp/run'
    >>> opening('/lab', {0}, **same)[0]
    '/lab'
    """
    path = os.path.abspath(path)
    places = _chain(path)
    resolved = real(path)
    if resolved != path:
        places += [p for p in _chain(resolved) if p not in places]
    for place in places:
        found = lstat(place)
        if stat.S_ISLNK(found.st_mode):
            continue  # its folder's to change; its target follows
        why = _why(found, place in (path, resolved), trusted, private)
        if why:
            return place, found, why
    return None


def words(found):
    """``'/lab (drwxrwxr-x, owner root, group staff) is writable by the
    group staff'`` for what :func:`opening` returned."""
    place, st, why = found
    return (f'{place} ({stat.filemode(st.st_mode)}, owner '
            f'{_user(st.st_uid)}, group {_group(st.st_gid)}) is {why}')


def _user(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f'uid {uid}'


def _group(gid):
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f'gid {gid}'
