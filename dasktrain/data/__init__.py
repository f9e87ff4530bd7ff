"""The data layer: CIFAR-10 fetched (:mod:`~dasktrain.data.download`), read
as lazy dask arrays (:mod:`~dasktrain.data.cifar`), augmented image by
image (:mod:`~dasktrain.data.augment`) and served to the replicas in
shards, an epoch ahead (:mod:`~dasktrain.data.loader`).

Each name below imports its module on first use (importing the package
loads neither dask nor requests).
"""
from dasktrain._lazy import exports

_EXPORTS = {
    **dict.fromkeys(('CIFAR10', 'load_cifar10'), 'dasktrain.data.cifar'),
    **dict.fromkeys(('ARCHIVE_NAME', 'BATCHES_DIR', 'CIFAR10_MD5',
                     'CIFAR10_URL', 'URL_ENV', 'download_cifar10',
                     'extract_archive'), 'dasktrain.data.download'),
    **dict.fromkeys(('CIFAR10_MEAN', 'CIFAR10_STD', 'MAX_TTA_VIEWS',
                     'normalize', 'tta_views'), 'dasktrain.data.augment'),
    **dict.fromkeys(('EpochLoader', 'epoch_permutation', 'minibatch_indices',
                     'shard_batches', 'shard_bounds'),
                    'dasktrain.data.loader'),
    **dict.fromkeys(('SAMPLE', 'load_sample'), 'dasktrain.data.sample'),
    'DataError': 'dasktrain.errors',
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
