"""How every process of a job is kept together, and ended all at once:
each job in a cgroup of its own where the machine gives one, else a
sweep by the job's marker.

A cgroup (v2) holds every process started inside it, whatever they do:
a process that leaves its session, double-forks, or forks and exits in
a loop (its pid always new) is still in it, and ``cgroup.kill`` ends all
of them at once, as Slurm's cgroup plugin and systemd's scopes do. So:

* the cluster owns a subtree (:func:`prepare`, at ``cluster start``: the
  cgroup v2 mount found in ``/proc/self/mountinfo``, wherever it is:
  ``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` beside cgroup v1's
  controllers), by default ``dasktrain`` beside the cgroup ``cluster
  start`` runs in (``--cgroup`` names another: a systemd unit's delegated
  one); each worker process a folder in it, ``worker-PID``;
* each attempt of a job runs in ``worker-PID/job-ID-N`` (:class:`Cgroup`):
  its keeper enters it, starts the program there (born inside: no race),
  and leaves; the job's memory (``memory.max``) and process count
  (``pids.max``) are capped there where those controllers are enabled;
* a stop is SIGTERM to every process in it, then ``cgroup.kill``; the
  job has ended only once ``cgroup.events`` says ``populated 0``, and only
  then are its GPUs and slot free.

Where no cgroup can be had (no cgroup v2, a folder this process may not
write, a kernel without ``cgroup.kill``), :class:`Containment` says so and
why, in one line (``cluster status`` shows it), and a job is ended by a
sweep (:func:`dasktrain.sweep.sweep`: by the keeper's tree and the
job's marker, read from ``/proc``). A process that empties its own
environment and leaves the keeper's tree (through a daemon that is not
the job's) escapes a sweep: only a cgroup holds that.

Owns the cgroup files and a cluster's marker prefix; finding processes
in ``/proc`` is :mod:`dasktrain.sweep`'s; whom a program runs as, and
when a job is stopped, are its callers'.
"""
import dataclasses
import errno
import json
import logging
import os
import time
from pathlib import Path

from dasktrain.sweep import PAUSE, marked, send, sweep

logger = logging.getLogger(__name__)

CONTAIN_ENV = 'DASKTRAIN_CONTAIN'  # a cluster's containment, as JSON
CLUSTER_ENV = 'DASKTRAIN_CLUSTER_MARK'  # a cluster's own mark: its tag
CONTROLLERS = ('memory', 'pids')  # what a job's limits need


@dataclasses.dataclass(frozen=True)
class Containment:
    """What keeps a cluster's jobs: ``kind`` 'cgroup' (its subtree
    ``root``, the ``controllers`` a job's cgroup may use) or 'sweep';
    ``why``: what is missing, in words (no cgroup, or a controller).

    >>> Containment('sweep', why='no cgroup v2 mount').words()
    'a sweep of its processes by marker (no cgroup v2 mount)'
    """
    kind: str
    root: str | None = None
    controllers: tuple = ()
    why: str | None = None

    def words(self):
        """One line for ``cluster status``."""
        if self.kind != 'cgroup':
            return f'a sweep of its processes by marker ({self.why})'
        limits = ', '.join(f'{c}.max' for c in self.controllers)
        text = f'a cgroup per job under {self.root}'
        if limits:
            text += f' (limits: {limits})'
        missing = [c for c in CONTROLLERS if c not in self.controllers]
        if missing:
            text += (f'; no {" or ".join(c + ".max" for c in missing)}: '
                     f'{self.why}')
        return text

    def limit_problem(self, mem=None, pids=None):
        """Why a job asking for ``mem`` bytes or ``pids`` processes at most
        cannot have that limit here, in one line; None if it can.

        >>> print(Containment('sweep', why='no cgroup v2').limit_problem(
        ...     mem=1))
        this cluster cannot cap a job's memory: no cgroup v2
        """
        for what, value, controller in (('memory', mem, 'memory'),
                                        ('processes', pids, 'pids')):
            if value is not None and controller not in self.controllers:
                return (f"this cluster cannot cap a job's {what}: "
                        f'{self.why}')
        return None

    def env(self):
        """This containment as ``$DASKTRAIN_CONTAIN`` holds it."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def of_env(cls, env=None):
        """The containment ``$DASKTRAIN_CONTAIN`` of ``env`` (default this
        process's) names; None where it names none."""
        text = (os.environ if env is None else env).get(CONTAIN_ENV)
        if not text:
            return None
        try:
            found = json.loads(text)
            return cls(str(found['kind']), found.get('root'),
                       tuple(found.get('controllers') or ()),
                       found.get('why'))
        except (ValueError, KeyError, TypeError):
            return None


# ------------------------------------------------------ finding cgroups

def mount_of(mountinfo):
    """``(mount point, root)`` of the cgroup v2 file system in
    ``mountinfo`` (``/proc/self/mountinfo``'s text), or None.

    >>> mount_of('41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - '
    ...          'cgroup2 cgroup2 rw\\n')
    ('/sys/fs/cgroup/unified', '/')
    >>> mount_of('25 1 0:22 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw\\n')
    """
    for line in mountinfo.splitlines():
        fields = line.split()
        if ' - ' not in line or len(fields) < 5:
            continue
        after = line.split(' - ', 1)[1].split()
        if after and after[0] == 'cgroup2':
            return _unescape(fields[4]), _unescape(fields[3])
    return None


def _unescape(field):
    """A mountinfo field with its octal escapes (``\\040``: a space)."""
    return field.encode().decode('unicode_escape') if '\\' in field \
        else field


def path_of(proc_cgroup):
    """This process's cgroup v2 path (``/proc/self/cgroup``'s ``0::``
    line), or None.

    >>> path_of('4:memory:/x\\n0::/system.slice/dasktrain.service\\n')
    '/system.slice/dasktrain.service'
    """
    for line in proc_cgroup.splitlines():
        if line.startswith('0::'):
            return line[3:]
    return None


def folder_of(mount, root, path):
    """The folder of cgroup ``path`` under the cgroup v2 ``mount`` whose
    own root is ``root`` (a container's cgroup namespace), or None where
    ``path`` lies outside it.

    >>> str(folder_of('/sys/fs/cgroup', '/', '/user.slice'))
    '/sys/fs/cgroup/user.slice'
    >>> folder_of('/sys/fs/cgroup', '/lxc/1', '/lxc/2') is None
    True
    """
    root = root.rstrip('/')
    if root and not (path == root or path.startswith(root + '/')):
        return None
    return Path(mount) / path[len(root):].lstrip('/')


def own_folder(pid='self'):
    """The folder of process ``pid``'s cgroup v2, or None."""
    try:
        found = mount_of(Path('/proc/self/mountinfo').read_text())
        path = path_of(Path(f'/proc/{pid}/cgroup').read_text())
    except OSError:
        return None
    if found is None or path is None:
        return None
    return folder_of(*found, path)


def _write(path, text):
    with open(path, 'w') as f:
        f.write(text)


def _words(error):
    return os.strerror(error.errno) if isinstance(error, OSError) and \
        error.errno else str(error)


def prepare(path=None, name='dasktrain'):
    """The :class:`Containment` of a cluster starting now: its subtree
    ``path`` (default ``name`` beside this process's own cgroup) made,
    proved (this process moves into a cgroup there and back), its
    :data:`CONTROLLERS` enabled where the cgroup above offers them; else
    'sweep' with the reason."""
    own = own_folder()
    if own is None:
        return Containment('sweep', why='no cgroup v2 mount here (cgroup '
                           'v1 only, or none)')
    root = Path(path) if path else own / name
    try:
        root.mkdir(exist_ok=True)
        if not (root / 'cgroup.kill').exists():
            return Containment('sweep', why='this kernel has no '
                               'cgroup.kill (Linux 5.14+)')
        probe = root / f'probe-{os.getpid()}'
        probe.mkdir(exist_ok=True)
        try:
            _write(probe / 'cgroup.procs', str(os.getpid()))
            _write(own / 'cgroup.procs', str(os.getpid()))
        finally:
            probe.rmdir()
    except OSError as e:
        return Containment('sweep', why=f'cannot use cgroup {root} '
                           f'({_words(e)})')
    controllers, why = _enable(root)
    return Containment('cgroup', str(root), controllers, why)


def _enable(root):
    """Enable :data:`CONTROLLERS` for the cgroups below ``root`` (asking
    the cgroup above it first); those enabled, and why not the others."""
    parent = root.parent
    try:
        offered = (parent / 'cgroup.controllers').read_text().split()
        enabled = (parent / 'cgroup.subtree_control').read_text().split()
    except OSError:
        offered = enabled = []
    why = None
    for c in CONTROLLERS:
        if c in offered and c not in enabled:
            try:
                _write(parent / 'cgroup.subtree_control', f'+{c}')
            except OSError as e:  # EBUSY: processes live there
                why = f'{parent} cannot hand down {c} ({_words(e)})'
    have = (root / 'cgroup.controllers').read_text().split()
    usable = [c for c in CONTROLLERS if c in have]
    for c in usable:
        try:
            _write(root / 'cgroup.subtree_control', f'+{c}')
        except OSError as e:
            why = f'{root} cannot hand down {c} ({_words(e)})'
            usable.remove(c)
    missing = [c for c in CONTROLLERS if c not in usable]
    if missing and why is None:
        why = (f'the cgroup v2 controller{"s" * (len(missing) > 1)} '
               f'{" and ".join(missing)} {"are" if len(missing) > 1 else "is"}'
               f' not enabled for {parent} (mounted under cgroup v1, or '
               'not delegated)')
    return tuple(usable), why if missing else None


def worker_folder(containment, pid=None):
    """The folder of this worker process's jobs in ``containment``'s
    subtree (made, its controllers handed down), or None."""
    if containment is None or containment.kind != 'cgroup':
        return None
    folder = Path(containment.root) / f'worker-{pid or os.getpid()}'
    folder.mkdir(exist_ok=True)
    for c in containment.controllers:
        try:
            _write(folder / 'cgroup.subtree_control', f'+{c}')
        except OSError:
            pass
    return folder


# ------------------------------------------------------- a job's cgroup

class Cgroup:
    """The cgroup of one job's attempt: ``path`` (a folder under the
    cgroup v2 mount)."""

    def __init__(self, path):
        self.path = Path(path)

    def create(self, mem=None, pids=None):
        """Make it (what a stale one of the same name held is killed
        first), with ``memory.max`` = ``mem`` bytes and ``pids.max`` =
        ``pids`` where given; the whole job is ended on an out-of-memory
        kill (``memory.oom.group``)."""
        if self.path.exists():
            self.end()
        self.path.mkdir()
        if mem is not None:
            _write(self.path / 'memory.max', str(int(mem)))
            if (self.path / 'memory.oom.group').exists():
                _write(self.path / 'memory.oom.group', '1')
        if pids is not None:
            _write(self.path / 'pids.max', str(int(pids)))
        return self

    def enter(self, pid=None):
        """Move process ``pid`` (default this one) into it."""
        _write(self.path / 'cgroup.procs', str(pid or os.getpid()))

    def pids(self):
        """The pids in it now."""
        try:
            return [int(p) for p in
                    (self.path / 'cgroup.procs').read_text().split()]
        except OSError:
            return []

    def populated(self):
        """Whether any process is in it (``cgroup.events``)."""
        try:
            events = (self.path / 'cgroup.events').read_text()
        except FileNotFoundError:
            return False
        return 'populated 1' in events

    def signal(self, signum):
        """``signum`` to every process in it; their pids."""
        return send(set(self.pids()), signum)

    def kill(self):
        """SIGKILL to every process in it at once (``cgroup.kill``)."""
        try:
            _write(self.path / 'cgroup.kill', '1')
        except FileNotFoundError:
            pass

    def oom_kills(self):
        """How many of its processes the kernel killed for memory."""
        try:
            for line in (self.path / 'memory.events').read_text() \
                    .splitlines():
                key, _, value = line.partition(' ')
                if key == 'oom_kill':
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def end(self, timeout=30.0):
        """Kill everything in it, wait until it is empty (``timeout``
        seconds at most, then OSError) and remove it."""
        deadline = time.monotonic() + timeout
        while self.populated():
            self.kill()
            if time.monotonic() > deadline:
                raise OSError(errno.EBUSY, f'{self.path} still holds '
                              f'processes {self.pids()}')
            time.sleep(PAUSE)
        self.remove()

    def remove(self):
        """Remove it (an empty cgroup); nothing if it is gone."""
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass


# ---------------------------------------------- a worker's jobs, here

_here = {}  # this process's containment and its jobs' folder, once


def cluster_tag(folder):
    """The tag of the cluster whose state is in ``folder``: the name of
    its subtree (``dasktrain-TAG``) and the prefix of its jobs' markers.

    >>> cluster_tag('/var/lib/dasktrain/private')
    'cfcc7c067'
    """
    import hashlib
    return 'c' + hashlib.sha1(str(folder).encode()).hexdigest()[:8]


def cluster_mark(env=None):
    """The marker prefix of this cluster's jobs (``$DASKTRAIN_CLUSTER_MARK``,
    else ``dasktrain``)."""
    return (os.environ if env is None else env).get(CLUSTER_ENV) or \
        'dasktrain'


def in_force():
    """The :class:`Containment` of the jobs this process runs: the
    cluster's (``$DASKTRAIN_CONTAIN``, set by ``cluster start``), else
    one prepared here, once (a worker joined by hand)."""
    if 'containment' not in _here:
        found = Containment.of_env()
        if found is None:
            found = prepare(name=f'dasktrain-{cluster_mark()}')
        _here['containment'] = found
        stale_workers(found)
    return _here['containment']


def jobs_folder():
    """This worker process's folder of job cgroups (made once), or None
    where jobs are swept by marker."""
    if 'folder' not in _here:
        try:
            _here['folder'] = worker_folder(in_force())
        except OSError as e:
            logger.warning('no cgroup folder for this worker\'s jobs (%s): '
                           'they are swept by marker', e)
            _here['folder'] = None
    return _here['folder']


# ------------------------------------------------------ a whole cluster

def end_all(containment, mark, grace=0.0, own=None):
    """End every job process a cluster left (``cluster stop`` once its
    own processes are gone; ``cluster start`` before it runs anything):
    the processes marked with the cluster's ``mark`` prefix and every
    cgroup under its subtree get ``grace`` seconds to end by themselves
    (their keepers are stopping them), then SIGKILL; returns once none is
    left. How many cgroups or processes were killed. ``own``: the name
    :func:`prepare` gave the subtree, removed with them (a stopped
    cluster's; a ``--cgroup`` given stays)."""
    deadline = time.monotonic() + grace
    cgroups = _job_cgroups(containment)
    while time.monotonic() < deadline and (
            any(c.populated() for c in cgroups) or marked(mark)):
        time.sleep(0.2)
    killed = 0
    for c in cgroups:
        killed += bool(c.populated())
        try:
            c.end()
        except OSError as e:
            logger.warning('cannot end %s: %s', c.path, e)
    killed += sweep(mark)
    root = [Path(containment.root)] if own and containment and \
        containment.kind == 'cgroup' else []
    for folder in _worker_folders(containment) + \
            [r for r in root if r.name == own]:
        try:
            folder.rmdir()
        except OSError:  # a live worker's (another cluster's start)
            pass
    return killed


def _worker_folders(containment):
    if containment is None or containment.kind != 'cgroup':
        return []
    root = Path(containment.root)
    try:
        return [p for p in root.iterdir()
                if p.is_dir() and p.name.startswith('worker-')]
    except OSError:
        return []


def _job_cgroups(containment):
    return [Cgroup(job) for folder in _worker_folders(containment)
            for job in folder.iterdir() if job.is_dir()]


def stale_workers(containment):
    """End what the jobs of a worker process that is gone left (a worker
    its nanny restarted; the cgroups of a killed one): kill and remove
    every ``worker-PID`` of ``containment`` whose PID is no process."""
    for folder in _worker_folders(containment):
        pid = folder.name[len('worker-'):]
        if pid.isdigit() and os.path.exists(f'/proc/{pid}'):
            continue
        for job in [p for p in folder.iterdir() if p.is_dir()]:
            try:
                Cgroup(job).end()
            except OSError as e:
                logger.warning('cannot end %s: %s', job, e)
        try:
            folder.rmdir()
        except OSError:
            pass
