"""dasktrain: train Chainer models on several GPUs and machines, with Dask.

Data flows one way through the package::

    data -> augment -> collective -> parallel -> training -> cluster
         -> scaleout -> jobs -> trials -> tuning -> cli

Heavy modules (chainer, dask.distributed) load on first use, so ``import
dasktrain`` and ``dasktrain --help`` stay fast.
"""
from dasktrain import _compat

_compat.install()  # Chainer, whenever imported, finds NumPy patched

__version__ = '0.1.0'

# public name -> module that defines it
_EXPORTS = {
    'CIFAR10': 'dasktrain.data',
    'DataError': 'dasktrain.data',
    'download_cifar10': 'dasktrain.data',
    'load_cifar10': 'dasktrain.data',
    'augment': 'dasktrain.augment',
    'EpochLoader': 'dasktrain.augment',
    'GPUDistributedGradient': 'dasktrain.parallel',
    'get_model': 'dasktrain.models',
    'load_model': 'dasktrain.models',
    'TrainConfig': 'dasktrain.config',
    'train': 'dasktrain.scaleout',
    'submit': 'dasktrain.jobs',
    'Job': 'dasktrain.jobs',
    'tune': 'dasktrain.tuning',
}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
