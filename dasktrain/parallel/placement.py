"""Where a run trains: the decisions, without processes or CUDA.

A run trains in one of four placements (:func:`place`):

* ``here``: every replica in this process, on its devices (one device,
  ``in_process``, or devices one process each cannot serve);
* ``per-device``: one new local worker process per device, each a rank of
  one job (several CPU replicas, or several distinct GPUs);
* ``ranks``: ``workers`` ranks on a Dask cluster, each on the devices its
  worker gives it;
* ``launched``: this process is one rank of ``dasktrain launch`` (its
  environment says so), on the devices :func:`launched_devices` gives it.

For ranks on a cluster, :func:`gpus_per_rank`, :func:`able_workers` and
:func:`rank_resources` decide what each rank holds and which workers can
host one, from the workers' advertised resources; :func:`machine_place`
a rank's place on its machine.

Everything here is a pure function of what it is given (the config, the
devices this process sees, the workers' resources), so the tests check
the decisions without a GPU or a cluster. Owns the decisions; may not
start processes (:mod:`dasktrain.run.train` does, as decided here).
"""
from typing import NamedTuple

from dasktrain.parallel.gpus import gpu_ids

HERE, PER_DEVICE, RANKS, LAUNCHED = ('here', 'per-device', 'ranks',
                                    'launched')


class Placement(NamedTuple):
    """Where a run trains (see :func:`place`)."""
    where: str                   # HERE, PER_DEVICE, RANKS or LAUNCHED
    devices: tuple | None     # here: this process's devices; per-device:
    #                              one per worker process; ranks: each
    #                              rank's as named (None: its worker's)
    ranks: int | None = None  # processes of the job (None: here)
    rank_devices: tuple | None = None  # per-device: each worker's own,
    #                                       as that worker sees it


def default_devices(available=None):
    """Every GPU among ``available``, else one CPU replica.

    ``available``: the Chainer specifiers this process can use (default:
    asked of CUDA, :func:`dasktrain.parallel.devices.available_devices`).

    >>> default_devices(['@numpy', '@cupy:0', '@cupy:1'])
    ('@cupy:0', '@cupy:1')
    >>> default_devices(['@numpy'])
    ('@numpy',)
    """
    if available is None:
        # Only the default asks CUDA: the decisions above import no Chainer.
        from dasktrain.parallel.devices import available_devices
        available = available_devices()
    gpus = [d for d in available if d.startswith('@cupy')]
    return tuple(gpus) or ('@numpy',)


def per_device_plan(devices):
    """(workers, each one's device) to train ``devices`` as one process
    per device, or None to keep them in one process: a single device, or
    a list with a GPU named twice or CPU and GPUs mixed.

    >>> per_device_plan(('@numpy', '@numpy'))
    (2, '@numpy')
    >>> per_device_plan(('@cupy:2', '@cupy:0'))
    (2, '@cupy:0')
    >>> per_device_plan(('@cupy:1', '@cupy:1')) is None
    True
    """
    devices = tuple(devices)
    if len(devices) < 2:
        return None
    if all(d == '@numpy' for d in devices):
        return len(devices), '@numpy'
    if len(gpu_ids(devices)) == len(devices):  # distinct GPUs only
        return len(devices), '@cupy:0'  # each worker sees its GPU as 0
    return None


def place(config, available=None, launched=False):
    """Where ``config`` trains: one rank of a launch where ``launched``
    (devices: the named ones, else None: see :func:`launched_devices`);
    ranks on a cluster with ``config.workers``; else on
    ``config.devices`` (default :func:`default_devices` of
    ``available``), one process per device where
    :func:`per_device_plan` allows it and ``config.in_process`` is off,
    else here.

    >>> from dasktrain.config import TrainConfig
    >>> place(TrainConfig(), available=['@numpy'])
    ... # doctest: +NORMALIZE_WHITESPACE
    Placement(where='here', devices=('@numpy',), ranks=None,
              rank_devices=None)
    >>> place(TrainConfig(devices=('@numpy',) * 2))
    ... # doctest: +NORMALIZE_WHITESPACE
    Placement(where='per-device', devices=('@numpy', '@numpy'), ranks=2,
              rank_devices=('@numpy',))
    >>> place(TrainConfig(devices=('@numpy',) * 2, in_process=True)).where
    'here'
    >>> place(TrainConfig(workers=3, devices=('@cupy:0',)))[:3]
    ('ranks', ('@cupy:0',), 3)
    >>> place(TrainConfig(), launched=True)[:2]
    ('launched', None)
    """
    if launched:
        return Placement(LAUNCHED, config.devices and tuple(config.devices))
    if config.workers is not None:
        return Placement(RANKS, config.devices, config.workers)
    devices = tuple(config.devices or default_devices(available))
    plan = None if config.in_process else per_device_plan(devices)
    if plan is None:
        return Placement(HERE, devices)
    workers, device = plan
    return Placement(PER_DEVICE, devices, workers, (device,))


def machine_place(machines, rank):
    """``(intra_rank, intra_size, inter_rank, inter_size)`` of ``rank``:
    its place among the ranks on its machine, their number, its machine's
    place among the job's machines (in order of their first rank) and
    their number, given ``machines``: every rank's machine, in rank order.

    A machine is what the ranks tell machines apart by: the host each
    listens on (:attr:`~dasktrain.parallel.comm.dask.DaskComm.machine`),
    which clones of one image do not share; never ``gethostname()``,
    which they do.

    Examples
    --------
    Two clones named ``node`` listening on their own addresses are two
    machines:

    >>> machine_place(['10.0.0.1', '10.0.0.2', '10.0.0.1'], 2)
    (1, 2, 0, 2)
    >>> machine_place(['10.0.0.1', '10.0.0.2', '10.0.0.1'], 1)
    (0, 1, 1, 2)
    """
    mine = machines[rank]
    same = [r for r, m in enumerate(machines) if m == mine]
    order = list(dict.fromkeys(machines))
    return same.index(rank), len(same), order.index(mine), len(order)


def launched_devices(named, gpus, intra_rank, intra_size):
    """The devices of one rank of ``dasktrain launch``: those ``named``
    (as this process sees them), else its own GPU, else one CPU replica.

    ``gpus``: how many GPUs this process sees; ``intra_rank`` of
    ``intra_size``: its place among the job's ranks on this machine
    (:func:`machine_place`).
    Launch shows each rank the GPUs of its machine's ranks in rank order
    (as ``mpiexec`` leaves them, and a queue's job its own GPUs), so a
    rank's own GPU is the one at its place; ValueError where there are
    GPUs, but fewer than ranks.

    Examples
    --------
    >>> launched_devices(None, 2, 1, 2)
    ('@cupy:1',)
    >>> launched_devices(None, 0, 1, 2)
    ('@numpy',)
    >>> launched_devices(('@numpy',) * 2, 4, 0, 1)
    ('@numpy', '@numpy')
    """
    if named:
        return tuple(named)
    if not gpus:
        return ('@numpy',)
    if gpus < intra_size:
        raise ValueError(f'{intra_size} ranks on this machine see {gpus} '
                         'GPUs: launch one GPU per rank, or name each '
                         "rank's devices")
    return (f'@cupy:{intra_rank}',)


def default_bucket_mb(devices):
    """MiB of gradients per overlapped all-reduce bucket by default, for a
    rank on ``devices``: 4 where any is a GPU (its all-reduce runs beside
    the GPU's kernels, NCCL or a host copy); 0 on CPUs, one all-reduce
    after the backward pass, since :func:`rank_threads` gives every core
    to computing and the sums' copies would take their time from it:
    measured on 2 cores, buckets of 4 MiB were no faster (1.76x against
    1.80x for 2 workers over 1, ``bench/two_workers.py``).

    >>> default_bucket_mb(('@cupy:0',)), default_bucket_mb(('@numpy',))
    (4.0, 0.0)
    """
    return 4.0 if gpu_ids(devices) else 0.0


def rank_threads(ranks, cores):
    """BLAS threads for each of ``ranks`` CPU processes of one job on a
    machine of ``cores`` cores: the cores shared out, at least one. One
    process alone takes every core through BLAS, so N ranks with one
    thread each would leave a big machine idle and lose to one process.

    >>> rank_threads(2, 2), rank_threads(2, 16), rank_threads(3, 16)
    (1, 8, 5)
    >>> rank_threads(4, 2)
    1
    """
    return max(1, int(cores or 1) // max(1, ranks))


def gpus_per_rank(devices, workers, asked=None):
    """GPUs each rank of a job on a cluster holds: ``asked`` where given
    (``TrainConfig.gpus_per_worker``, which ``submit --gpus`` sets); else
    as many as ``devices`` names; with none named, one where any of
    ``workers`` (their info dicts, with the ``resources`` they advertise)
    has GPUs, else none.

    >>> gpus_per_rank(None, [{'resources': {'GPU': 4}}], asked=2)
    2
    >>> gpus_per_rank(('@numpy',), [{'resources': {'GPU': 4}}], asked=0)
    0

    >>> gpus_per_rank(None, [{'resources': {'GPU': 2}}, {'resources': {}}])
    1
    >>> gpus_per_rank(None, [{'resources': {'CPU': 1}}])
    0
    >>> gpus_per_rank(('@cupy:0', '@cupy:1'), [])
    2
    """
    if asked is not None:
        return asked
    if devices is None:
        return 1 if any(w.get('resources', {}).get('GPU') for w in workers) \
            else 0
    return len(gpu_ids(devices))


def able_workers(workers, gpus):
    """The addresses, sorted, of the ``workers`` (``{address: info}``)
    that advertise at least ``gpus`` GPUs.

    >>> able_workers({'b': {'resources': {'GPU': 2}}, 'a': {}}, 0)
    ['a', 'b']
    >>> able_workers({'b': {'resources': {'GPU': 2}}, 'a': {}}, 1)
    ['b']
    """
    return sorted(a for a, w in workers.items()
                  if w.get('resources', {}).get('GPU', 0) >= gpus)


def rank_resources(gpus, worker):
    """The Dask resources a rank holds on ``worker`` (its info dict):
    its GPUs; without GPUs, one CPU slot where the worker has slots (a
    ``dasktrain cluster start`` worker), else none.

    >>> rank_resources(2, {'resources': {'GPU': 4}})
    {'GPU': 2}
    >>> rank_resources(0, {'resources': {'CPU': 1}})
    {'CPU': 1}
    >>> rank_resources(0, {}) is None
    True
    """
    if gpus:
        return {'GPU': gpus}
    return {'CPU': 1} if worker.get('resources', {}).get('CPU') else None
