"""NVML's devices matched to CUDA's: which NVML device (index, UUID,
handle) each of a process's CUDA devices, or each of a worker's GPU ids,
is. CUDA numbers devices fastest first unless ``CUDA_DEVICE_ORDER=
PCI_BUS_ID``, NVML in PCI bus order; only UUIDs (and the driver's own
answer) match them for certain: :func:`match_cuda_devices` and
:func:`worker_devices` decide, as pure functions of the devices' dicts.

And each device's processes as NVML lists them (:func:`nvml_processes`):
twice over, ``nvmlDeviceGetComputeRunningProcesses`` (CUDA) and
``nvmlDeviceGetGraphicsRunningProcesses`` (graphics), entries with
``pid`` and ``usedGpuMemory`` in bytes (``c_nvmlProcessInfo_v2_t``/v3
also ``gpuInstanceId`` and ``computeInstanceId``, one entry per MIG
instance). ``usedGpuMemory`` is None where the driver cannot say (pynvml
turns ``NVML_VALUE_NOT_AVAILABLE``, 2**64-1, into None; older pynvml
passed it through raw). The unversioned calls raise when pynvml is newer
than the driver: the ``_v2`` calls are tried then. A process may be on
both lists: it counts once (:func:`merge_entries`, pure).

Used by the worker's preload (:mod:`dasktrain.jobs.worker.preload`: its
GPU readings) and :mod:`dasktrain.jobs.worker.gpu_use` (who uses each
GPU). Owns NVML's answers: it reads no metric, no ``/proc``, no job.
"""

NOT_AVAILABLE = 2 ** 64 - 1  # NVML_VALUE_NOT_AVAILABLE_ulonglong
NO_INSTANCE = 2 ** 32 - 1    # NVML_VALUE_NOT_AVAILABLE_uint


def nvml_read(call, *args):
    """``call(*args)``, or None where NVML raises (NOT_SUPPORTED, ...)."""
    try:
        return call(*args)
    except Exception:  # NVML_ERROR_NOT_SUPPORTED and kin: no value
        return None


def nvml_text(value):
    return value.decode() if isinstance(value, bytes) else (value or '')


def nvml_gpu(pynvml, index):
    """One NVML device: index (PCI bus order), UUID, name, handle and the
    UUIDs of its MIG instances."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    uuid = nvml_text(nvml_read(pynvml.nvmlDeviceGetUUID, handle))
    migs = []
    for i in range(nvml_read(pynvml.nvmlDeviceGetMaxMigDeviceCount,
                             handle) or 0):
        mig = nvml_read(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, i)
        if mig is not None:
            migs.append(nvml_text(nvml_read(pynvml.nvmlDeviceGetUUID, mig)))
    return dict(index=index, uuid=uuid, handle=handle, migs=migs,
                name=nvml_text(nvml_read(pynvml.nvmlDeviceGetName, handle)))


_DRIVER = []  # this process's CUDA devices' UUIDs, asked once


def driver_view():
    """The UUIDs of this process's CUDA devices, as the driver says (None
    where it cannot be asked)."""
    if not _DRIVER:
        from dasktrain.parallel.cuda_driver import driver_uuids
        _DRIVER.append(driver_uuids())
    return _DRIVER[0]


def uuid_hex(uuid):
    """A UUID's 32 hex digits, whatever its prefix (GPU-, MIG-)."""
    tail = uuid.split('-', 1)[1] if uuid[:4] in ('GPU-', 'MIG-') else uuid
    return tail.replace('-', '').lower()


def match_cuda_devices(gpus, uuids=None, entries=None, pci_order=False):
    """The NVML devices (dicts with ``index``, ``uuid``, ``name``, ``migs``)
    that are a process's CUDA devices, in CUDA order, each once (a MIG
    instance reads as its GPU).

    ``uuids``: what the CUDA driver says the process's ordinals are (the
    truth, where it can be asked). Else ``entries``: its
    ``CUDA_VISIBLE_DEVICES`` (ids, ``GPU-`` and ``MIG-`` UUIDs, prefixes).
    An id is a CUDA ordinal, which NVML's PCI order matches only with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (``pci_order``) or where every GPU is
    the same model (CUDA's default fastest-first order then falls back to
    PCI order); otherwise an id names no NVML device for certain, and is
    skipped rather than guessed.

    >>> a = dict(index=0, uuid='GPU-aa', name='A100', migs=['MIG-a1'])
    >>> b = dict(index=1, uuid='GPU-bb', name='T4', migs=[])
    >>> [g['index'] for g in match_cuda_devices([a, b], uuids=['GPU-bb',
    ...                                                        'GPU-a1'])]
    [1, 0]
    >>> [g['index'] for g in match_cuda_devices([a, b], entries=['1', '0'])]
    []
    >>> [g['index'] for g in match_cuda_devices([a, b], entries=['1', '0'],
    ...                                         pci_order=True)]
    [1, 0]
    """
    def by_uuid(wanted, prefix=False):
        want = uuid_hex(wanted)
        for gpu in gpus:
            for uuid in [gpu['uuid']] + gpu['migs']:
                have = uuid_hex(uuid)
                if have == want or (prefix and want and
                                    have.startswith(want)):
                    return gpu
        return None
    same_model = len({g['name'] for g in gpus}) <= 1
    chosen = []
    for item in (uuids if uuids is not None else entries or ()):
        if uuids is None and item.isdigit():
            index = int(item)
            gpu = gpus[index] if (pci_order or same_model) and \
                index < len(gpus) else None
        else:
            gpu = by_uuid(item, prefix=uuids is None)
        if gpu is not None and all(gpu is not c for c in chosen):
            chosen.append(gpu)
    return chosen


def worker_devices(gpus, entries, uuids=None, pci_order=False):
    """``{entry: nvml device}`` for a worker's GPU ``entries`` (its
    ``CUDA_VISIBLE_DEVICES`` entries, the ids jobs hold): entry ``i`` is
    the worker's CUDA ordinal ``i``, whose UUID the driver names
    (``uuids``) where it can; an entry no device matches for certain is
    left out.

    >>> a = dict(index=0, uuid='GPU-aa', name='T4', migs=[])
    >>> b = dict(index=1, uuid='GPU-bb', name='T4', migs=[])
    >>> {e: g['index'] for e, g in worker_devices([a, b], ['1']).items()}
    {'1': 1}
    >>> {e: g['index'] for e, g in worker_devices(
    ...     [a, b], ['3', '5'], uuids=['GPU-bb', 'GPU-aa']).items()}
    {'3': 1, '5': 0}
    """
    found = {}
    for i, entry in enumerate(entries):
        if uuids is not None:
            match = match_cuda_devices(gpus, uuids=uuids[i:i + 1])
        else:
            match = match_cuda_devices(gpus, entries=[entry],
                                       pci_order=pci_order)
        if match:
            found[entry] = match[0]
    return found


def entry_bytes(entry):
    """An NVML process entry's ``usedGpuMemory`` in bytes, None where NVML
    cannot say (None, or the raw NVML_VALUE_NOT_AVAILABLE).

    >>> from types import SimpleNamespace as E
    >>> entry_bytes(E(pid=1, usedGpuMemory=2 ** 30))
    1073741824
    >>> entry_bytes(E(pid=1, usedGpuMemory=2 ** 64 - 1)) is None
    True
    """
    used = getattr(entry, 'usedGpuMemory', None)
    if used is None or not isinstance(used, int) or used == NOT_AVAILABLE \
            or used < 0:
        return None
    return used


def merge_entries(*lists):
    """NVML's process lists of one GPU (compute, graphics; None for one
    NVML could not give) as ``[{'pid': N, 'bytes': B or None}]``, each pid
    once, largest first; None when no list could be read.

    An entry on several lists (a process using compute and graphics)
    counts once (its largest figure); entries of one pid on distinct MIG
    instances (``gpuInstanceId``, ``computeInstanceId``) add up.

    >>> from types import SimpleNamespace as E
    >>> merge_entries([E(pid=7, usedGpuMemory=300)],
    ...               [E(pid=7, usedGpuMemory=300), E(pid=9,
    ...                                               usedGpuMemory=None)])
    [{'pid': 7, 'bytes': 300}, {'pid': 9, 'bytes': None}]
    >>> merge_entries(None, None) is None
    True
    """
    if all(entries is None for entries in lists):
        return None
    per_instance = {}
    for entries in lists:
        for entry in entries or ():
            key = (int(entry.pid), getattr(entry, 'gpuInstanceId', None),
                   getattr(entry, 'computeInstanceId', None))
            used = entry_bytes(entry)
            before = per_instance.get(key, None)
            per_instance[key] = used if before is None else \
                before if used is None else max(before, used)
    by_pid = {}
    for (pid, _, _), used in per_instance.items():
        if pid not in by_pid or by_pid[pid] is None:
            by_pid[pid] = used
        elif used is not None:
            by_pid[pid] += used
    return sorted(({'pid': pid, 'bytes': used}
                   for pid, used in by_pid.items()),
                  key=lambda p: (-(p['bytes'] or 0), p['pid']))


def nvml_processes(pynvml, handle):
    """The processes NVML sees on the device ``handle``
    (:func:`merge_entries`), None where it cannot list them (no
    permission, not supported)."""
    def listed(kind):
        for name in (f'nvmlDeviceGet{kind}RunningProcesses',
                     f'nvmlDeviceGet{kind}RunningProcesses_v2'):
            call = getattr(pynvml, name, None)
            if call is not None:
                entries = nvml_read(call, handle)
                if entries is not None:
                    return list(entries)
        return None
    return merge_entries(listed('Compute'), listed('Graphics'))
