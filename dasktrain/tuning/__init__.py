"""Hyperparameter search: an Optuna study (:mod:`~dasktrain.tuning.study`)
over a search space (``space``) whose trials run as jobs (``trials``).

Each name below imports its module on first use.
"""
from dasktrain._lazy import exports

_EXPORTS = {
    **dict.fromkeys((
        'DIRECTIONS', 'TuneError', 'check_metric', 'check_numbers',
        'check_same_study', 'read_study_file', 'state_early_stopping'),
        'dasktrain.tuning.checks'),
    **dict.fromkeys((
        'IDENTITY', 'PER_JOB', 'PRUNERS', 'SAMPLERS', 'load',
        'make_sampler', 'tune'), 'dasktrain.tuning.study'),
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
