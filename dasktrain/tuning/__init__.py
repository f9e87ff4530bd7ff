"""Hyperparameter search: an Optuna study (:mod:`~dasktrain.tuning.study`)
over a search space (``space``) whose trials run as jobs (``trials``).

Each name below imports its module on first use.
"""
from dasktrain._lazy import exports

_EXPORTS = dict.fromkeys((
    'DIRECTIONS', 'IDENTITY', 'PER_JOB', 'PRUNERS', 'SAMPLERS', 'TuneError',
    'check_metric', 'load', 'make_sampler', 'tune'), 'dasktrain.tuning.study')

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
