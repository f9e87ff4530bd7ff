"""One rank's training: THE loop (:mod:`~dasktrain.training.loop`), what
it shows (``progress``), its checkpoints and model files
(``checkpoint``), test-set evaluation (``evaluate``), early stopping
(``stopping``), the models (``models``) and the run's output folder
(``outdir``). Where it runs is :mod:`dasktrain.run.train`'s.

Each name below imports its module (and Chainer) on first use.
"""
from dasktrain._lazy import exports

_EXPORTS = {
    **dict.fromkeys(('READ_EVERY', 'EpochSums', 'TrainingDiverged',
                     'make_optimizer', 'run', 'seed_everything'),
                    'dasktrain.training.loop'),
    **dict.fromkeys(('Progress', 'describe_devices'),
                    'dasktrain.training.progress'),
    **dict.fromkeys(('CHECKPOINT', 'load_checkpoint', 'prepare_out',
                     'save_checkpoint', 'save_model'),
                    'dasktrain.training.checkpoint'),
    'load_test_share': 'dasktrain.training.evaluate',
    'EarlyStopping': 'dasktrain.training.stopping',
    'DistributedUpdater': 'dasktrain.training.updater',
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
