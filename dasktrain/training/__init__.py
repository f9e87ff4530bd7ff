"""One rank's training: THE loop (:mod:`~dasktrain.training.loop`), what
it shows (``progress``), its checkpoints and model files
(``checkpoint``), test-set evaluation (``evaluate``), early stopping
(``stopping``), the models (``models``), the run's output folder
(``outdir``), an epoch's metrics over the ranks (``metrics``), and the
commands that steer a running run (ChainerUI's: their file
``commandfile``, when they act ``steering``, what they change
``hyperparams``, what the run does ``control``; ChainerUI's own
extension across the ranks of a Trainer script:
``commands_extension``). Where it runs is :mod:`dasktrain.run.train`'s.

Each name below imports its module (and Chainer) on first use.
"""
from dasktrain._lazy import exports

_EXPORTS = {
    **dict.fromkeys(('READ_EVERY', 'TrainingDiverged', 'make_optimizer',
                     'run', 'seed_everything'),
                    'dasktrain.training.loop'),
    'EpochSums': 'dasktrain.training.metrics',
    **dict.fromkeys(('Progress', 'describe_devices'),
                    'dasktrain.training.progress'),
    **dict.fromkeys(('CHECKPOINT', 'load_checkpoint', 'prepare_out',
                     'save_checkpoint', 'save_model'),
                    'dasktrain.training.checkpoint'),
    'load_test_share': 'dasktrain.training.evaluate',
    'EarlyStopping': 'dasktrain.training.stopping',
    'DistributedUpdater': 'dasktrain.training.updater',
    'Steering': 'dasktrain.training.steering',
    'RunControl': 'dasktrain.training.control',
    'Hyperparameters': 'dasktrain.training.hyperparams',
    **dict.fromkeys(('CommandsAcrossRanks', 'across_ranks'),
                    'dasktrain.training.commands_extension'),
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
