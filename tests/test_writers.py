"""Who besides the users trusted with a path can change what it holds:
the rule as a pure function over a table of owners and modes (its
examples, the cases a lab's machines hold), then on this machine's real
folders."""
import doctest
import os
import stat

import pytest

from dasktrain import writers

DIR, FILE, LINK = 0o40000, 0o100000, 0o120000
#: path -> (mode, uid, gid); uid 51001 is ann (group 51001 hers alone),
#: 51002 eve; group 51050 is staff (ann and eve).
TABLE = {
    '/': (DIR | 0o755, 0, 0),
    '/tmp': (DIR | 0o1777, 0, 0),
    '/tmp/ann': (DIR | 0o700, 51001, 51001),
    '/tmp/eves': (DIR | 0o755, 51002, 51002),
    '/tmp/ann-upg': (DIR | 0o775, 51001, 51001),
    '/tmp/staff': (DIR | 0o775, 51001, 51050),
    '/tmp/open': (DIR | 0o777, 51001, 51001),
    '/tmp/link': (LINK | 0o777, 51002, 51002),  # -> /tmp/ann, eve's link
    '/usr': (DIR | 0o755, 0, 0),
    '/usr/local': (DIR | 0o2775, 0, 51050),
    '/usr/local/lib': (DIR | 0o755, 0, 0),
    '/opt': (DIR | 0o755, 0, 0),
    '/opt/dt': (DIR | 0o755, 0, 0),
    '/opt/dt/bin': (DIR | 0o755, 0, 0),
    '/opt/dt/bin/python': (FILE | 0o775, 0, 51050),
}


def _opening(path, trusted):
    def lstat(p):
        mode, uid, gid = TABLE[p]
        return os.stat_result((mode, 0, 0, 0, uid, gid, 0, 0, 0, 0))
    return writers.opening(
        path, trusted, lstat=lstat,
        real=lambda p: {'/tmp/link': '/tmp/ann'}.get(p, p),
        private=lambda gid, uid: gid == uid == 51001)


def test_examples():
    result = doctest.testmod(writers)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize('path, trusted, found', [
    ('/tmp/ann', {0, 51001}, None),          # hers, in a sticky /tmp
    ('/tmp/ann-upg', {0, 51001}, None),      # her own group may write
    ('/tmp/eves', {0, 51001}, ('/tmp/eves', 'owned by uid 51002')),
    ('/tmp/staff', {0, 51001}, ('/tmp/staff', 'writable by the group '
                                              'gid 51050')),
    ('/tmp/open', {0, 51001}, ('/tmp/open', 'writable by every user')),
    ('/tmp/link', {0, 51001}, None),         # the link's folder is sticky
    ('/usr/local/lib', {0}, ('/usr/local', 'writable by the group gid 51050')),
    ('/opt/dt/bin/python', {0}, ('/opt/dt/bin/python',
                                 'writable by the group gid 51050')),
    ('/opt/dt/bin', {0}, None),
])
def test_who_else_can_change_a_path(path, trusted, found):
    got = _opening(path, trusted)
    assert (got and (got[0], got[2])) == found


def test_this_machines_folders(tmp_path):
    # A folder of root's in the test's own: root's alone, until anyone
    # may write it.
    folder = tmp_path / 'mine'
    folder.mkdir(mode=0o700)
    if os.geteuid() != 0 or writers.opening(tmp_path, {0}) is not None:
        pytest.skip('needs root, in a temporary folder of root\'s')
    assert writers.opening(folder, {0}) is None
    os.chmod(folder, 0o777)
    place, found, why = writers.opening(folder, {0})
    assert (place, why) == (str(folder), 'writable by every user')
    assert writers.words((place, found, why)) == (
        f'{folder} (drwxrwxrwx, owner root, group root) is writable by '
        'every user')
    assert stat.S_IMODE(found.st_mode) == 0o777
