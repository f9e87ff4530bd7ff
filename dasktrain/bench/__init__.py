"""Measurements behind ``dasktrain bench``: augmentation and training
throughput (:mod:`~dasktrain.bench.benchmarks`), one job across Dask
workers (``scaleout``), the all-reduce against OpenMPI's (``allreduce``)
and the predicted scaling to 64 GPUs (``costmodel``).

Each name below imports its module on first use.
"""
from dasktrain._lazy import exports

_EXPORTS = {
    **dict.fromkeys(('bench_augment', 'bench_train', 'best_of', 'machine',
                     'synthetic_cifar10', 'table'),
                    'dasktrain.bench.benchmarks'),
    'bench_scaleout': 'dasktrain.bench.scaleout',
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
