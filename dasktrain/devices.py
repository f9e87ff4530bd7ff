"""Which devices this process can train on, by Chainer specifier."""
import chainer
import numpy as np

from dasktrain.errors import UserError


class DeviceError(UserError, ValueError):
    """A device that was asked for is not there."""


def available_devices():
    """Chainer specifiers of the devices this process can use."""
    found = ['@numpy']
    if chainer.backends.cuda.available:
        import cupy
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except cupy.cuda.runtime.CUDARuntimeError:
            count = 0
        found += [f'@cupy:{i}' for i in range(count)]
    return found


def resolve_devices(devices):
    """Chainer devices for GPU ids, ``'@cupy:N'``, ``'@numpy'`` or ``'cpu'``.

    An int ``n`` alone means GPUs ``0..n-1``, as in the seed post.
    """
    if isinstance(devices, (int, np.integer)) and not isinstance(devices,
                                                                 bool):
        if devices < 1:
            raise ValueError(f'devices must be >= 1 GPUs, got {devices}')
        devices = range(devices)
    elif isinstance(devices, str):
        devices = [devices]
    devices = list(devices)
    if not devices:
        raise ValueError('devices must name at least one device, got []')
    available = available_devices()
    resolved = []
    for d in devices:
        spec = (f'@cupy:{d}' if isinstance(d, (int, np.integer))
                else '@numpy' if d == 'cpu' else d)
        if spec not in available:
            why = ('CuPy is not installed or finds no CUDA driver'
                   if spec.startswith('@cupy') and len(available) == 1
                   else 'no such device')
            raise DeviceError(f'device {d!r} is not available ({why}); '
                              f'available: {", ".join(available)}')
        resolved.append(chainer.get_device(spec))
    return resolved
