"""NVML's devices matched to CUDA's: which NVML device (index, UUID,
handle) each of a process's CUDA devices, or each of a worker's GPU ids,
is. CUDA numbers devices fastest first unless ``CUDA_DEVICE_ORDER=
PCI_BUS_ID``, NVML in PCI bus order; only UUIDs (and the driver's own
answer) match them for certain: :func:`match_cuda_devices` and
:func:`worker_devices` decide, as pure functions of the devices' dicts.

Used by the worker's preload (:mod:`dasktrain.jobs.worker.preload`: its
GPU readings) and :mod:`dasktrain.jobs.worker.gpu_use` (who uses each
GPU). Owns the matching only: it
reads no metric and no process.
"""


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
        from dasktrain.parallel.devices import driver_uuids
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
