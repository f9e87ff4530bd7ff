"""Which GPUs a worker, a job and a rank use: the decisions, without CUDA.

CUDA numbers the GPUs a process sees from 0, in the order its
``CUDA_VISIBLE_DEVICES`` lists them; the entries themselves are physical
ids (``2``), UUIDs (``GPU-8f6c...``) or MIG instances (``MIG-...``). Two
numberings therefore meet whenever dasktrain hands GPUs around:

* a Dask worker's :class:`GpuPool` hands out :class:`Gpu` pairs: ``index``
  is the CUDA ordinal *in the worker's process* (what a scale-out rank,
  which runs in that process, passes to Chainer as ``@cupy:<index>``);
  ``id`` is the worker's ``CUDA_VISIBLE_DEVICES`` entry (what a job's
  child process gets in *its* ``CUDA_VISIBLE_DEVICES``, where it then sees
  the GPUs as 0..k-1);
* a job that reserves no GPU runs with ``CUDA_VISIBLE_DEVICES=''`` and sees
  none (:func:`with_visible_gpus`);
* device lists a user typed (``--devices 2,3``) are renumbered onto the
  GPUs the job or rank was given, in order, or refused
  (:func:`place_devices`);
* a machine whose GPUs CuPy cannot use says so in one line, with what to
  install (:func:`unusable_gpus`), and a run that would train on its CPU
  instead, without asking for the CPU, is refused (:func:`gpu_refusal`);
* the ranks of one job compare their own GPUs (:func:`rank_gpu`, however
  the devices were spelt) and refuse to share one
  (:func:`refuse_shared_gpu`);
* ranks on several machines sum over NCCL, whose sockets are in clear,
  only where their cluster allows it (:func:`nccl_between`).

Everything here is a pure function of the environment and counts it is
given, so the tests check, on a machine without GPUs, what a GPU machine
would decide. Nothing here imports CuPy.
"""
import collections
import os
import threading

from dasktrain.errors import UserError, argument, plural

VISIBLE = 'CUDA_VISIBLE_DEVICES'

Gpu = collections.namedtuple('Gpu', 'index id')
Gpu.__doc__ = """One GPU of a worker: CUDA ordinal there, and its entry."""


class GpuError(UserError, ValueError):
    """GPUs asked for that the job or worker cannot have."""


def _valid_entry(entry):
    return entry.isdigit() or entry.startswith(('GPU-', 'MIG-'))


def visible_gpus(env=None, count=None):
    """The ``CUDA_VISIBLE_DEVICES`` entries of this process, in CUDA order.

    Parameters
    ----------
    env : mapping, default ``os.environ``
    count : int, optional
        How many GPUs the process may use (a worker's ``GPU`` resource, or
        ``getDeviceCount()``); unset ``CUDA_VISIBLE_DEVICES`` then means
        ``'0'..str(count - 1)``, and a longer list is cut to ``count``.

    As CUDA does, an empty variable means no GPU and the list ends at the
    first entry that is neither an id nor a ``GPU-``/``MIG-`` UUID.

    >>> visible_gpus({'CUDA_VISIBLE_DEVICES': '2,3'})
    ['2', '3']
    >>> visible_gpus({}, count=2)
    ['0', '1']
    >>> visible_gpus({'CUDA_VISIBLE_DEVICES': ''}, count=4)
    []
    """
    env = os.environ if env is None else env
    value = env.get(VISIBLE)
    if value is None:
        entries = [str(i) for i in range(count or 0)]
    else:
        entries = []
        for entry in value.split(','):
            entry = entry.strip()
            if not _valid_entry(entry):
                break
            entries.append(entry)
    return entries if count is None else entries[:count]


def with_visible_gpus(env, gpus):
    """``env`` with exactly ``gpus`` visible: a job's program's holding
    them.

    ``CUDA_VISIBLE_DEVICES`` lists the GPUs' entries (the child sees them
    as 0..k-1); a job holding none gets ``''`` and sees no GPU, never the
    worker's whole machine.

    >>> env = with_visible_gpus({}, [Gpu(0, '2'), Gpu(1, '3')])
    >>> env['CUDA_VISIBLE_DEVICES']
    '2,3'
    >>> env = with_visible_gpus({'CUDA_VISIBLE_DEVICES': '0,1'}, [])
    >>> env['CUDA_VISIBLE_DEVICES']
    ''
    """
    env = dict(env)
    env[VISIBLE] = ','.join(g.id for g in gpus)
    return env


def split_gpus(entries, workers):
    """``entries`` (a machine's ``CUDA_VISIBLE_DEVICES`` entries) shared
    out among ``workers`` Dask workers of that machine, in order, as
    evenly as they go (the first ones one more): each worker owns its
    own, none shares one. GpuError where there are GPUs, but fewer than
    workers (a worker without its GPU would offer only CPU slots).

    >>> split_gpus(['0', '1', '2'], 2)
    [['0', '1'], ['2']]
    >>> split_gpus([], 2)
    [[], []]
    >>> split_gpus(['0'], 2)
    Traceback (most recent call last):
    ...
    dasktrain.parallel.gpus.GpuError: workers 2 on 1 GPU: each worker owns \
GPUs of its own; ask for at most 1 worker, or for gpus 0 (CPU workers)
    """
    if entries and len(entries) < workers:
        raise GpuError(f'{argument("workers")} {workers} on '
                       f'{plural(len(entries), "GPU")}: each worker owns '
                       f'GPUs of its own; ask for at most '
                       f'{plural(len(entries), "worker")}, or for '
                       f'{argument("gpus")} 0 (CPU workers)')
    share, more = divmod(len(entries), workers)
    shares, start = [], 0
    for w in range(workers):
        end = start + share + (w < more)
        shares.append(list(entries[start:end]))
        start = end
    return shares


def gpu_ids(devices):
    """The distinct GPU ids a device tuple names, in first-use order.

    >>> gpu_ids(('@cupy:3', '@cupy:1', '@cupy:3', '@numpy'))
    [3, 1]
    """
    ids = []
    for d in devices or ():
        if str(d).startswith('@cupy:'):
            i = int(str(d).split(':')[1])
            if i not in ids:
                ids.append(i)
    return ids


def place_devices(devices, indices):
    """Renumber a device tuple onto the CUDA ordinals ``indices`` given.

    Parameters
    ----------
    devices : tuple of str or None
        What the user asked for (``TrainConfig.devices``); None: one
        replica per given GPU (or None again when none are given, which
        means the default, a CPU replica in a process that sees no GPU).
    indices : sequence of int
        The ordinals of the GPUs this process was given, in order.

    The distinct GPUs ``devices`` names map, in the order they first
    appear, onto ``indices``; repeats stay repeats (two replicas on one
    GPU) and CPU entries stay. A list naming no GPU (``('@numpy',)``) is
    used as given. Naming another number of GPUs than given is a GpuError:
    a job never trains on a GPU it did not reserve.

    >>> place_devices(('@cupy:2', '@cupy:3'), [0, 1])
    ('@cupy:0', '@cupy:1')
    >>> place_devices(('@cupy:5', '@cupy:5'), [1])
    ('@cupy:1', '@cupy:1')
    >>> place_devices(None, [1, 0])
    ('@cupy:1', '@cupy:0')
    """
    indices = list(indices)
    if devices is None:
        return tuple(f'@cupy:{i}' for i in indices) or None
    named = gpu_ids(devices)
    if not named:
        return devices
    if len(named) != len(indices):
        flag = argument('devices')
        raise GpuError(
            f'{flag} {",".join(str(i) for i in named)} names '
            f'{plural(len(named), "GPU")} but {len(indices)} were '
            'reserved; the '
            f'cluster picks the GPUs: pass {argument("gpus")} '
            f'{len(named)}, or drop {flag} to use the reserved ones')
    mapping = dict(zip(named, indices))
    return tuple(f'@cupy:{mapping[int(str(d).split(":")[1])]}'
                 if str(d).startswith('@cupy:') else d for d in devices)



# ------------------------------------------ GPUs here that CuPy cannot use

#: What to install where CuPy cannot use a machine's GPUs: the extras of
#: tools/cuda_extra.py, which bring CuPy with its CUDA libraries as wheels.
INSTALL_CUPY = ('install CuPy with its CUDA libraries: `make install` in '
                "dasktrain's checkout (it picks them for the driver), or pip "
                "install 'dasktrain[cuda13]' for a CUDA 13 driver "
                "('dasktrain[cuda12]' for CUDA 12; docs/install.md)")


class GpusUnusable(UserError):
    """This machine has GPUs that CuPy cannot use, and the CPU was not
    asked for."""


def listed_gpus(lines):
    """The GPUs' lines among ``nvidia-smi -L``'s (a MIG instance is listed
    indented under its GPU, and is not one more).

    >>> listed_gpus(['GPU 0: NVIDIA A100 (UUID: GPU-1)',
    ...              '  MIG 1g.10gb Device 0: (UUID: MIG-2)'])
    ['GPU 0: NVIDIA A100 (UUID: GPU-1)']
    """
    return [line for line in lines if line.startswith('GPU ')]


def unusable_gpus(smi_lines, count, problem, visible=None):
    """One line where ``nvidia-smi -L`` lists GPUs that this process
    cannot use through CuPy, saying why and what to install; else None.

    Parameters
    ----------
    smi_lines : list of str
        ``nvidia-smi -L``'s lines (``GPU 0: NVIDIA H100 (UUID: ...)``);
        none without a driver.
    count, problem : int, str or None
        What :func:`dasktrain.parallel.cuda_check.gpu_count` found: the GPUs
        CuPy shows this process, and why none (CuPy's import error, a
        CUDA library it cannot load, CUDA finding no device).
    visible : str, optional
        ``CUDA_VISIBLE_DEVICES``. One that names no GPU hides them on
        purpose (a CPU job of the queue runs with it empty): then None.

    Examples
    --------
    >>> smi = ['GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)']
    >>> print(unusable_gpus(smi, 0, "No module named 'cupy'"))
    ... # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    nvidia-smi sees 1 GPU, but CuPy cannot use it (No module named 'cupy'):
    install CuPy with its CUDA libraries: `make install` in ...
    >>> unusable_gpus(smi, 1, None), unusable_gpus([], 0, 'no cupy')
    (None, None)
    >>> unusable_gpus(smi, 0, 'CUDA finds no device', visible='') is None
    True
    """
    gpus = listed_gpus(smi_lines)
    if not gpus or count or problem is None:
        return None
    if visible is not None and not visible_gpus({VISIBLE: visible}):
        return None
    them = 'it' if len(gpus) == 1 else 'them'
    shown = '' if visible is None else f'; {VISIBLE}={visible}'
    return (f'nvidia-smi sees {plural(len(gpus), "GPU")}, but CuPy cannot '
            f'use {them} ({problem}{shown}): {INSTALL_CUPY}')


def gpu_refusal(smi_lines, count, problem, devices=None, visible=None):
    """The one line that stops a run from training on this machine's CPU
    while it has GPUs that CuPy cannot use (:func:`unusable_gpus`), or
    None. ``devices``: those asked for (None: the default, every GPU);
    a run that asked for the CPU alone (``--devices cpu``, ``cpu:N``) is
    never refused.

    Examples
    --------
    >>> smi = ['GPU 0: NVIDIA H100 (UUID: GPU-1)', 'GPU 1: NVIDIA H100 '
    ...        '(UUID: GPU-2)']
    >>> why = 'CuPy cannot load NVRTC: libnvrtc.so.13 not found'
    >>> print(gpu_refusal(smi, 0, why))
    ... # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    nvidia-smi sees 2 GPUs, but CuPy cannot use them (CuPy cannot load
    NVRTC: libnvrtc.so.13 not found): install CuPy ...; or pass devices
    cpu to train on the CPU
    >>> gpu_refusal(smi, 0, why, devices=('@numpy', '@numpy')) is None
    True
    """
    if devices and not gpu_ids(devices):
        return None
    line = unusable_gpus(smi_lines, count, problem, visible)
    return line and (f'{line}; or pass {argument("devices")} cpu to train '
                     'on the CPU')


# ------------------------------------------------- two ranks on one GPU

def gpu_ordinal(device):
    """The CUDA ordinal a device specifier names, however spelt (``0``,
    ``'0'``, ``'@cupy:0'``, ChainerX's ``'cuda:0'``); None for a CPU.

    >>> [gpu_ordinal(d) for d in (2, '2', '@cupy:2', 'cuda:2', '@numpy')]
    [2, 2, 2, 2, None]
    """
    if isinstance(device, bool):
        return None
    if isinstance(device, int):
        return device if device >= 0 else None
    text = str(device)
    for prefix in ('@cupy:', 'cuda:', ''):
        if text.startswith(prefix) and text[len(prefix):].isdigit():
            return int(text[len(prefix):])
    return None


#: A rank's own GPU, as the ranks of a job compare it (:func:`rank_gpu`).
GpuUse = collections.namedtuple('GpuUse', 'machine entry uuid')


def rank_gpu(devices, machine, entries, uuids=None):
    """The GPU a rank on ``devices`` holds as its own: the first GPU they
    name (its master replica's, where its NCCL communicator lives; its
    other replicas' GPUs only send their gradients to it), as a
    :class:`GpuUse`; None for a rank on the CPU.

    ``machine``: the rank's machine (its listening host); ``entries``: its
    ``CUDA_VISIBLE_DEVICES`` entries (:func:`visible_gpus`; empty where
    it is unset: the ordinal is the physical id); ``uuids``: the driver's
    UUIDs of its ordinals, where it can say.

    >>> rank_gpu(('@cupy:1', '@cupy:0'), '10.0.0.1', ['2', '3'])
    GpuUse(machine='10.0.0.1', entry='3', uuid=None)
    >>> rank_gpu((0,), 'h', [], ['GPU-aa'])
    GpuUse(machine='h', entry='0', uuid='GPU-aa')
    >>> rank_gpu(('@numpy',), 'h', []) is None
    True
    """
    ordinals = [o for o in map(gpu_ordinal, devices or ()) if o is not None]
    if not ordinals:
        return None
    ordinal = ordinals[0]
    entries = list(entries or ())
    entry = entries[ordinal] if ordinal < len(entries) else \
        None if entries else str(ordinal)
    uuid = uuids[ordinal] if uuids and ordinal < len(uuids) else None
    if uuid is None and entry and entry.startswith(('GPU-', 'MIG-')):
        uuid = entry
    return GpuUse(machine, entry, uuid)


def same_gpu(a, b):
    """Whether two ranks' :class:`GpuUse` are one GPU: their UUIDs decide
    where both are known (a UUID names one GPU whatever machine or
    container sees it, and two containers of one host may each see their
    own GPU as ``0``); else one machine and one ``CUDA_VISIBLE_DEVICES``
    entry.

    >>> same_gpu(GpuUse('h', '0', None), GpuUse('h', '0', None))
    True
    >>> same_gpu(GpuUse('h1', '0', None), GpuUse('h2', '0', None))
    False
    >>> same_gpu(GpuUse('h', '0', 'GPU-a'), GpuUse('h', '0', 'GPU-b'))
    False
    """
    if a is None or b is None:
        return False
    if a.uuid and b.uuid:
        return a.uuid == b.uuid
    return a.machine == b.machine and a.entry is not None and \
        a.entry == b.entry


def shared_gpu(uses):
    """The first two ranks (rank order) whose own GPUs are one, given
    every rank's :func:`rank_gpu` in rank order; None where no two are.

    >>> shared_gpu([GpuUse('h', '0', None), None, GpuUse('h', '0', None)])
    (0, 2)
    >>> shared_gpu([GpuUse('h', '0', None), GpuUse('h', '1', None)]) is None
    True
    """
    for b, use in enumerate(uses):
        for a in range(b):
            if same_gpu(uses[a], use):
                return a, b
    return None


def refuse_shared_gpu(uses, remedy=None):
    """Raise :class:`GpuError` (one line) where two ranks of one job would
    hold one GPU as their own (:func:`shared_gpu`): NCCL does not support
    two ranks on one device, and may hang; a job whose ranks cannot use
    NCCL would train them on one GPU while another idles. Every rank
    gives the same ``uses`` (an all-gather), so every rank refuses.
    ``remedy``: what to do, in words (default: a ``dasktrain train``
    rank's).

    >>> refuse_shared_gpu([GpuUse('10.0.0.1', '0', None)] * 2)
    Traceback (most recent call last):
    ...
    dasktrain.parallel.gpus.GpuError: ranks 0 and 1 would both train on GPU 0 of 10.0.0.1, ...
    """  # noqa: E501
    pair = shared_gpu(uses)
    if pair is None:
        return
    a, b = pair
    use = uses[a]
    name = use.uuid if use.uuid and use.uuid != use.entry else None
    gpu = f'GPU {use.entry if use.entry is not None else use.uuid}' + \
        (f' ({name})' if name else '') + \
        (f' of {use.machine}' if use.machine else '')
    if remedy is None:
        remedy = (f'under `dasktrain launch --devices 0,1` leave '
                  f'{argument("devices")} out: each rank takes its own; on '
                  "a cluster, give a machine's workers CUDA_VISIBLE_DEVICES "
                  'of their own')
    raise GpuError(
        f'ranks {a} and {b} would both train on {gpu}, which NCCL does not '
        f'support (it may hang): give each rank its own GPU ({remedy})')


# Non-blocking communicators (NCCL_COMM_BLOCKING=0) came with NCCL 2.14;
# before, the variable is ignored and a dead peer blocks groupEnd forever.
# ncclCommAbort from a thread other than the communicator's own, which a
# rank's deadline needs, was made safe in 2.19.1 (NCCL issue #992). Up to
# 2.25 a non-blocking collective's group job stays in the calling thread's
# thread-local storage until the communicator's next call (group.cc's
# ncclGroupJobMainPtr; 2.22's and 2.25's read alike); dasktrain sums from
# a thread per step, which has ended by then. 2.26 completes the job in
# ncclCommGetAsyncError, 2.28 allocates it on the heap.
MIN_NCCL = (2, 26, 0)


def nccl_version(code):
    """(major, minor, patch) of an ``ncclGetVersion`` code (CuPy's
    ``nccl.get_version()``): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z
    since 2.9; None for 0 (NCCL older than 2.3.4 cannot say).

    Examples
    --------
    >>> nccl_version(2708), nccl_version(21403), nccl_version(0)
    ((2, 7, 8), (2, 14, 3), None)
    """
    if code <= 0:
        return None
    if code >= 20900:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


def nccl_problem(nccl):
    """Why a GPU rank cannot sum over NCCL, given CuPy's ``nccl`` module
    (``cupy.cuda.nccl``, or None when CuPy is not importable), as the one
    warning line to show; None when it can."""
    if nccl is None or not getattr(nccl, 'available', False):
        return NCCL_MISSING
    try:
        version = nccl_version(int(nccl.get_version()))
    except Exception:  # a library too old for ncclGetVersion
        version = None
    if version is None or version < MIN_NCCL:
        found = '.'.join(map(str, version)) if version else 'older than 2.3.4'
        return (f'warning: NCCL {found} is older than 2.26, the first whose '
                'non-blocking sums complete from any thread and whose abort '
                'lets a rank give up on a dead peer: GPU ranks sum over Dask '
                'comms instead, slower; install NCCL >= 2.26 (pip install '
                "'dasktrain[cuda12]' brings nvidia-nccl)")
    return None


def use_nccl(devices, nccl):
    """Whether a rank on ``devices`` sums over NCCL, given CuPy's ``nccl``
    module: only on GPUs, and only where :func:`nccl_problem` finds none
    (the NCCL library loaded, ``nccl.available``, which the cupy-cudaXXx
    wheels do not bring; version 2.26 or later)."""
    return bool(gpu_ids(devices)) and nccl_problem(nccl) is None


#: In a rank's environment: '0' where its ranks on different machines
#: may not sum over NCCL (a shared cluster's gang, unless ``cluster start
#: --allow-clear-nccl``); unset or '1', they may.
CLEAR_NCCL = 'DASKTRAIN_CLEAR_NCCL'
CLEAR_NCCL_REFUSED = (
    'NCCL between machines sends arrays in clear (unencrypted, '
    'unauthenticated), and this cluster does not allow it (cluster start '
    '--allow-clear-nccl): the ranks sum over sealed links instead')


def clear_nccl_allowed(env=None):
    """Whether this rank's environment (``env``, default this process's)
    allows NCCL's sockets between machines (:data:`CLEAR_NCCL` not '0')."""
    env = os.environ if env is None else env
    return env.get(CLEAR_NCCL, '1') != '0'


def nccl_between(ranks):
    """Whether the ranks ``ranks`` (each ``(machine, allowed)``: its
    machine, and :func:`clear_nccl_allowed` of its environment) may sum
    over NCCL as far as the network goes: all on one machine (NCCL's
    shared memory and NVLink stay inside it), or every one allows NCCL's
    sockets, which are neither encrypted nor authenticated, between
    machines. Every rank decides it from the same list: all agree.

    >>> nccl_between([('10.0.0.5', False), ('10.0.0.5', False)])
    True
    >>> nccl_between([('10.0.0.5', True), ('10.0.0.6', False)])
    False
    >>> nccl_between([('10.0.0.5', True), ('10.0.0.6', True)])
    True
    """
    return len({machine for machine, _ in ranks}) <= 1 or \
        all(allowed for _, allowed in ranks)


NCCL_MISSING = ('warning: NCCL is not installed (cupy.cuda.nccl.available is '
                'False): GPU ranks sum over Dask comms instead, slower; '
                "install it with pip install 'dasktrain[cuda12]' (or "
                "[cuda13]), which brings nvidia-nccl")


class GpuPool:
    """The GPUs of this Dask worker process, handed to one holder at a time.

    The worker's ``GPU`` resource says how many it offers; its
    ``CUDA_VISIBLE_DEVICES`` (if set) which ones. Dask's resource accounting
    already guarantees no more than that many are held at once; the pool
    picks *which*, so that no two jobs or ranks share a GPU.
    """
    lock = threading.Lock()  # jobs and ranks run in worker threads
    used = set()

    @classmethod
    def acquire(cls, count, total=None, env=None, want=None):
        """``count`` free :class:`Gpu` of this worker (``total``: its GPU
        resource, default the running worker's): the entries ``want``
        names (the queue's choice) where they are all free, else the first
        free ones."""
        if total is None:
            from distributed import get_worker
            total = int(get_worker().state.total_resources.get('GPU', 0))
        entries = visible_gpus(env, count=total)
        with cls.lock:
            free = [Gpu(i, e) for i, e in enumerate(entries)
                    if e not in cls.used]
            wanted = [g for g in free if g.id in (want or ())]
            free = wanted if want and len(wanted) == count == len(want) \
                else free[:count]
            if len(free) < count:  # the scheduler's accounting forbids it
                raise GpuError(f'{plural(count, "GPU")} asked, free here: '
                               f'{[g.id for g in free]} of {entries}')
            cls.used.update(g.id for g in free)
        return free

    @classmethod
    def held(cls):
        """The entries held now (a copy): what the worker's heartbeat
        says its jobs and ranks hold."""
        with cls.lock:
            return set(cls.used)

    @classmethod
    def release(cls, gpus):
        with cls.lock:
            cls.used.difference_update(g.id for g in gpus)
