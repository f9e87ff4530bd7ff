"""Data-parallel training on several devices: ``GPUDistributedGradient``
(:mod:`~dasktrain.parallel.gradient`, the update, dg and ipm, mixing) and
what it stands on: devices (``devices``) and GPU numbering (``gpus``), a
model's replicas on the devices (``replicas``), the communicators among
a job's processes (``comm``: over Dask, through shared memory on one
machine, NCCL between GPUs), how dg's gradients are summed between them
(``exchange``, overlapped with the backward pass) and double buffering's
stale steps (``stale``).

Each name below imports its module (and Chainer) on first use.
"""
from dasktrain._lazy import exports

_EXPORTS = {
    **dict.fromkeys(('GPUDistributedGradient', 'MODES'),
                    'dasktrain.parallel.gradient'),
    **dict.fromkeys(('DeviceError', 'resolve_devices'),
                    'dasktrain.parallel.devices'),
    **dict.fromkeys(('CollectiveError', 'Communicator', 'Solo'),
                    'dasktrain.parallel.comm.base'),
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
