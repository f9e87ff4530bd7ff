"""Training in one process: the loop behind ``dasktrain train``
(:mod:`~dasktrain.training.loop`), the models (``models``), the run's
output folder (``outdir``) and tables and figures of runs (``report``).

Each name below imports its module (and Chainer) on first use.
"""
from dasktrain._lazy import exports

_EXPORTS = dict.fromkeys((
    'CHECKPOINT', 'READ_EVERY', 'EarlyStopping', 'TrainingDiverged',
    'default_devices', 'describe_devices', 'evaluate', 'load_checkpoint',
    'make_optimizer', 'prepare_out', 'run_group', 'save_checkpoint',
    'save_model', 'seed_everything', 'train'), 'dasktrain.training.loop')

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
