"""dasktrain: train Chainer models on several GPUs and machines, with Dask.

The package is grouped by layer, and data flows one way through it
(docs/design.md has the whole map)::

    data       the data of a run: CIFAR, a user's data, augmentation,
                   the epoch loader
    -> kernels     Chainer's convolutions and batch normalization on
                   cuDNN graphs
    -> parallel    GPUDistributedGradient and what it stands on: devices,
                   GPUs, replicas, the communicators, where a run trains
    -> training, chainermn
                   one rank's training loop, its display, checkpoints and
                   models; ChainerMN's API on dasktrain's communicators
    -> cluster     the Dask cluster and its TLS, throwaway local workers
    -> run         ``train``, ``dasktrain launch`` and the one rank driver
    -> jobs        the job queue: a job's files and record, submitting,
                   the scheduler's queue, a job on its worker
    -> tuning      Optuna studies whose trials are jobs
    -> results     tables and figures of runs, jobs and trials
    -> commands    the ``dasktrain`` subcommands; ``cli`` their table

``bench`` measures the layers; ``config`` (the one ``TrainConfig``),
``errors``, ``files``, ``keeper`` (every program's supervisor),
``numerics`` (how a rank computes: dtype, TF32, cuDNN) and a few more
serve them all.

Heavy modules (chainer, dask.distributed) load on first use, so ``import
dasktrain`` and ``dasktrain --help`` stay fast.
"""
from dasktrain import _compat
from dasktrain._lazy import exports


def _after_chainer():
    """Chainer's GPU function nodes hooked (dasktrain.kernels), unless
    DASKTRAIN_KERNELS=off."""
    from dasktrain import kernels
    if kernels.wanted():
        kernels.install()


# Chainer, whenever imported, finds NumPy patched, and its GPU functions
# hooked once it is.
_compat.install(after_chainer=_after_chainer)

__version__ = '0.1.0'

# public name -> module that defines it
_EXPORTS = {
    'CIFAR10': 'dasktrain.data.cifar',
    'DataError': 'dasktrain.errors',
    'download_cifar10': 'dasktrain.data.download',
    'load_cifar10': 'dasktrain.data.cifar',
    'augment': 'dasktrain.data.augment',
    'EpochLoader': 'dasktrain.data.loader',
    'GPUDistributedGradient': 'dasktrain.parallel.gradient',
    'DistributedUpdater': 'dasktrain.training.updater',
    'get_model': 'dasktrain.training.models',
    'load_model': 'dasktrain.training.models',
    'TrainConfig': 'dasktrain.config',
    'computing': 'dasktrain.numerics',
    'train': 'dasktrain.run.train',
    'submit': 'dasktrain.jobs.client.submit',
    'submit_command': 'dasktrain.jobs.client.submit',
    'Job': 'dasktrain.jobs.job',
    'tune': 'dasktrain.tuning.study',
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
