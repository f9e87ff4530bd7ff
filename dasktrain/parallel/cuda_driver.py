"""What the CUDA driver says of this process's devices, asked through
``libcuda`` itself, never creating a context: each device's UUID, as
nvidia-smi and ``CUDA_VISIBLE_DEVICES`` spell it (a MIG instance's own),
in the driver's numbering (the runtime's), and whether its primary
context is active here. NVML's view of the same GPUs (by UUID) is
:mod:`dasktrain.parallel.nvml`'s.
"""


def format_uuid(raw):
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` for 16 raw bytes, as
    nvidia-smi and CUDA_VISIBLE_DEVICES spell it.

    >>> format_uuid(bytes(range(16)))
    'GPU-00010203-0405-0607-0809-0a0b0c0d0e0f'
    """
    h = bytes(raw).hex()
    return f'GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}'


def uuid_bytes(ordinal):
    """The GPU's 16 UUID bytes from the driver, which numbers devices as
    the runtime does; CuPy's device properties pass them through a C
    string, cut at the first zero byte. ``cuDeviceGetUuid_v2`` (CUDA 11.4
    and later) gives a MIG instance its own UUID, where the first version
    gives the whole GPU's; a driver without it answers with the first."""
    import ctypes
    cuda = ctypes.CDLL('libcuda.so.1')
    device = ctypes.c_int()
    raw = ctypes.create_string_buffer(16)
    get_uuid = getattr(cuda, 'cuDeviceGetUuid_v2', None) or \
        cuda.cuDeviceGetUuid
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), ordinal) \
            or get_uuid(raw, device):
        return None
    return raw.raw


def _driver():
    """``libcuda`` initialised and how many devices this process has, or
    None where there is no CUDA driver."""
    import ctypes
    try:
        cuda = ctypes.CDLL('libcuda.so.1')
    except OSError:
        return None
    count = ctypes.c_int()
    if cuda.cuInit(0) or cuda.cuDeviceGetCount(ctypes.byref(count)):
        return None
    return cuda, count.value


def driver_uuids():
    """The UUIDs of this process's CUDA devices in ordinal order, as the
    driver numbers them (``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``
    applied; a MIG instance's own UUID), without creating a context; None
    where there is no CUDA driver."""
    driver = _driver()
    if driver is None:
        return None
    found = []
    for ordinal in range(driver[1]):
        raw = uuid_bytes(ordinal)
        if raw is None:
            return None
        found.append(format_uuid(raw))
    return found


def primary_contexts():
    """For each of this process's CUDA ordinals, whether its primary
    context is active here (``cuDevicePrimaryCtxGetState``: the context
    CuPy's runtime calls use, left by any GPU work this process did),
    without creating one; None where there is no CUDA driver."""
    import ctypes
    driver = _driver()
    if driver is None:
        return None
    cuda, count = driver
    found = []
    for ordinal in range(count):
        device, flags, active = ctypes.c_int(), ctypes.c_uint(), \
            ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(device), ordinal) or \
                cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags),
                                                ctypes.byref(active)):
            return None
        found.append(bool(active.value))
    return found
