"""Data-parallel training on several devices: ``GPUDistributedGradient``
(:mod:`~dasktrain.parallel.gradient`) and what it stands on: devices
(``devices``) and GPU numbering (``gpus``), the replicas' arrays
(``replicas``), collectives among processes (``collective``, with ``shm``
on one machine and ``nccl`` between GPUs), and how dg's gradients travel
(``gradcomm``, overlapped with ``backprop``'s backward pass).

Each name below imports its module (and Chainer) on first use.
"""
from dasktrain._lazy import exports

_EXPORTS = {
    **dict.fromkeys(('GPUDistributedGradient', 'MODES'),
                    'dasktrain.parallel.gradient'),
    **dict.fromkeys(('DeviceError', 'resolve_devices'),
                    'dasktrain.parallel.devices'),
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
