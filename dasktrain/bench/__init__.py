"""Measurements behind ``dasktrain bench`` and ``bench/*.py``
(:mod:`~dasktrain.bench.benchmarks`), the all-reduce against OpenMPI's
(``allreduce``) and the predicted scaling to 64 GPUs (``costmodel``).

Each name below imports its module on first use.
"""
from dasktrain._lazy import exports

_EXPORTS = dict.fromkeys((
    'bench_augment', 'bench_scaleout', 'bench_train', 'machine',
    'synthetic_cifar10', 'table'), 'dasktrain.bench.benchmarks')

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
