"""A shared cluster: one queue for a whole lab of Unix users, started by
root (``sudo dasktrain cluster start --shared``), each job run as its
submitter. Its machine-wide place (:func:`shared_dir`: ``--shared-dir``,
``$DASKTRAIN_SHARED_DIR``, default ``/var/lib/dasktrain``):

=================  =========  ==========================================
path               mode       what
=================  =========  ==========================================
``./``             root 0755  the place itself
``cluster.json``   root 0644  the public record: the front door's socket,
                              the cluster's owner, addresses for display
``queue.sock``     0666       the front door (served by the scheduler,
                              :mod:`dasktrain.jobs.scheduler.socket_server`)
``jobs/``          root 0711  job folders: traversable, not listable
``private/``       root 0700  the cluster's own record (pids, settings),
                              its TLS keys (0600), logs, worker space
=================  =========  ==========================================

No ordinary user ever connects to Dask (Dask runs pickled code: a user
holding its key would be root); users talk to the front door only.

Owns that layout, its modes, the root check, the public record and
starting and stopping a shared cluster on top of
:mod:`~dasktrain.cluster.local`; serving the socket and running jobs as
their submitters are :mod:`dasktrain.jobs`'.
"""
import collections
import os
import socket
import stat
import time
from pathlib import Path

from dasktrain.cluster.local import (
    HOME_ENV,
    ClusterError,
    start_cluster,
    stop_cluster,
)
from dasktrain.files import write_json

SHARED_ENV = 'DASKTRAIN_SHARED_DIR'
DEFAULT = '/var/lib/dasktrain'
# Set in a shared cluster's own processes only: the scheduler serves the
# front door of this folder, and the cluster's owner (SUDO_UID) may act on
# every job.
SERVE_ENV = 'DASKTRAIN_SHARED_SERVE'
OWNER_ENV = 'DASKTRAIN_SHARED_OWNER'
# The Dask web routes a shared scheduler serves: its metrics, health and
# dashboard, not ``info`` (workers' logs, call stacks) nor ``proxy``.
HTTP_ROUTES = ['distributed.http.scheduler.prometheus',
               'distributed.http.health', 'distributed.http.statics']
NEEDS_ROOT = ('a shared cluster runs each job as its submitter, which needs '
              'root: start it with sudo, or leave out --shared for a '
              'cluster of your own')

Layout = collections.namedtuple('Layout', 'root record socket jobs private')
Layout.__doc__ = """The paths of a shared cluster's place (see the
module)."""


def shared_dir(path=None, env=None):
    """``path``, else ``$DASKTRAIN_SHARED_DIR``, else ``/var/lib/dasktrain``.

    >>> shared_dir(env={})
    PosixPath('/var/lib/dasktrain')
    """
    env = os.environ if env is None else env
    return Path(path or env.get(SHARED_ENV) or DEFAULT)


def layout(root):
    """The :class:`Layout` of the shared place ``root``.

    >>> layout('/srv/q').socket
    PosixPath('/srv/q/queue.sock')
    """
    root = Path(root)
    return Layout(root, root / 'cluster.json', root / 'queue.sock',
                  root / 'jobs', root / 'private')


def check_root(euid=None):
    """ClusterError (one line) unless this process (``euid``) is root."""
    if (os.geteuid() if euid is None else euid) != 0:
        raise ClusterError(NEEDS_ROOT)


PRIVATE_PYTHON_ENV = 'DASKTRAIN_SHARED_PRIVATE_PYTHON'


_ASK = object()


def check_install(env=None, problem=_ASK):
    """ClusterError (one line) unless every user can run this Python and
    read this dasktrain: each training job runs as its submitter with
    them. ``$DASKTRAIN_SHARED_PRIVATE_PYTHON=1`` in ``env`` starts anyway
    (a queue of command jobs that bring their own Python); ``problem``:
    :func:`dasktrain.shared_install.install_problem`'s line or None (default:
    asked of this process).

    >>> check_install({}, problem=None)
    >>> check_install({}, problem='other users cannot run /root/py: ...')
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    dasktrain.cluster.local.ClusterError: other users cannot run ... \
`sudo dasktrain cluster start --shared` (install-shared links it into \
/usr/local/bin, on sudo's PATH)
    """
    env = os.environ if env is None else env
    if env.get(PRIVATE_PYTHON_ENV) == '1':
        return
    if problem is _ASK:
        from dasktrain.shared_install import install_problem
        problem = install_problem()
    if problem:
        raise ClusterError(
            f'{problem}, and a shared cluster runs each training job as its '
            'submitter with it: install dasktrain for every user (`sudo '
            'make install-shared PREFIX=/opt/dasktrain` in its clone, '
            'docs/security.md) and start that one: `sudo dasktrain '
            'cluster start --shared` (install-shared links it into '
            '/usr/local/bin, on sudo\'s PATH)')


def check_root_only(root, problem=_ASK):
    """ClusterError (one line, naming the path, its owner and mode) where
    a user other than root can change the code the cluster's root
    processes run (:func:`dasktrain.shared_install.root_only_problem`,
    or ``problem``) or a folder above the shared place ``root`` (they
    could swap it for theirs); whatever
    ``$DASKTRAIN_SHARED_PRIVATE_PYTHON`` says."""
    from dasktrain.writers import opening, words
    if problem is _ASK:
        from dasktrain.shared_install import root_only_problem
        problem = root_only_problem()
    if problem is None:
        found = opening(Path(root).parent, {0})
        if found is not None:
            problem = (f'the shared place {root} lies where users other '
                       f'than root can change it: {words(found)}')
    if problem:
        raise ClusterError(f'{problem}; a shared cluster runs as root with '
                           "it: make it root's alone (chown root, chmod "
                           'go-w), or install and place it elsewhere')


def owner_uid(env=None):
    """The uid of who ran ``sudo dasktrain cluster start --shared``
    (``$SUDO_UID``), None without sudo (systemd: root alone owns it).

    >>> owner_uid({'SUDO_UID': '1000'}), owner_uid({})
    (1000, None)
    """
    env = os.environ if env is None else env
    text = env.get('SUDO_UID', '')
    return int(text) if text.isdigit() and int(text) != 0 else None


def _folder(path, mode):
    """``path``, made if missing, root's and ``mode`` exactly; a folder
    someone else owns is refused (they could swap what root writes)."""
    path.mkdir(mode=mode, exist_ok=True)
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != 0:
        raise ClusterError(f'{path} must be a folder of root\'s (it is '
                           f'owned by uid {found.st_uid}): a shared '
                           'cluster keeps every user\'s jobs there')
    os.chmod(path, mode)


def prepare(root):
    """The shared place ``root`` made (or checked) as the module says;
    its :class:`Layout`. ClusterError unless run as root."""
    check_root()
    found = layout(root)
    found.root.parent.mkdir(parents=True, exist_ok=True)
    check_root_only(found.root)
    _folder(found.root, 0o755)
    _folder(found.jobs, 0o711)
    _folder(found.private, 0o700)
    return found


def write_record(where, state, owner=None):
    """The public record of the shared cluster ``state`` (what
    :func:`~dasktrain.cluster.local.start_cluster` returned) in
    ``where.record``, 0644, written whole."""
    write_json(where.record, public_record(where, state, owner), indent=2,
               mode=0o644)


def public_record(where, state, owner=None):
    """What every local user may read of a shared cluster: no TLS paths,
    no pids, no ``--notify`` URL (a secret).

    >>> sorted(public_record(layout('/q'), {'scheduler': 'tls://a:1',
    ...                      'dashboard': 'http://a:2/status'}))[:4]
    ['dashboard', 'host', 'jobs', 'owner']
    """
    return {'socket': str(where.socket), 'jobs': str(where.jobs),
            'scheduler': state['scheduler'],
            'dashboard': state.get('dashboard'), 'host': socket.gethostname(),
            'owner': owner, 'owner_name': _name(owner),
            'started': state.get('started', time.time())}


def _name(uid):
    import pwd
    try:
        return None if uid is None else pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def read_record(path=None, env=None):
    """The public record of the shared cluster in :func:`shared_dir`
    (``path``), or None where there is none."""
    import json
    try:
        record = json.loads(layout(shared_dir(path, env)).record.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and \
        isinstance(record.get('socket'), str) else None


def start_shared(root=None, **start):
    """Start a shared cluster in the place ``root``
    (:func:`shared_dir`): its processes as root, umask 077, serving the
    front door; record it. ``start``: as
    :func:`~dasktrain.cluster.local.start_cluster`'s. Returns its state
    with ``shared`` (its :class:`Layout`) and ``owner`` (SUDO_UID or
    None)."""
    where = prepare(shared_dir(root))
    owner = owner_uid()
    env = {SERVE_ENV: str(where.root), HOME_ENV: str(where.private),
           SHARED_ENV: str(where.root),
           # the jobs layer's $DASKTRAIN_JOBS_DIR: the monitor's job board
           'DASKTRAIN_JOBS_DIR': str(where.jobs),
           # No Dask page that shows logs, stacks or proxies: the
           # dashboard is every user's, without a login.
           'DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES': repr(HTTP_ROUTES)}
    if owner is not None:
        env[OWNER_ENV] = str(owner)
    state = start_cluster(folder=where.private, env=env, umask=0o077,
                          shared=True, **start)
    try:
        _wait_for_door(where, start.get('timeout', 60))
        write_record(where, state, owner)
    except BaseException:
        stop_cluster(where.private)
        raise
    return dict(state, shared=where, owner=owner)


def _wait_for_door(where, timeout):
    """Until the scheduler serves the front door's socket."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(2)
                s.connect(str(where.socket))
                return
        except OSError:
            time.sleep(0.2)
    raise ClusterError(f"the scheduler did not open the queue's socket "
                       f'{where.socket} within {timeout:.0f} s; see the '
                       f'logs in {where.private / "logs"}')


def stop_shared(root=None):
    """Stop the shared cluster of the place ``root``; its socket goes, its
    public record stays (users' clients then say, in one line, that the
    machine's shared queue is not there, rather than fall back to a
    cluster of their own). Returns
    :func:`~dasktrain.cluster.local.stop_cluster`'s state."""
    check_root()
    where = layout(shared_dir(root))
    try:
        return stop_cluster(where.private)
    finally:
        where.socket.unlink(missing_ok=True)
