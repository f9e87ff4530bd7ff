"""Search spaces: which TrainConfig fields a study varies, and how.

A space maps TrainConfig fields to distributions, in a YAML or JSON file or
a dict::

    lr: {type: float, low: 1.0e-4, high: 0.1, log: true}
    weight_decay: {type: float, low: 0.0, high: 1.0e-3}
    batch_size: {type: int, low: 32, high: 256, step: 32}
    mode: {type: categorical, choices: [dg, ipm]}
    mix_every: [1, 10, epoch]          # a list: categorical

Your own model's arguments (``--model-arg``) are named ``model_args.NAME``::

    model_args.n_units: {type: int, low: 64, high: 512, log: true}

``float`` and ``int`` take ``low``, ``high`` and optionally ``log`` or
``step``; ``categorical`` takes ``choices``. Each field is sampled with
Optuna's ``trial.suggest_*`` (define-by-run), so fields that apply to ipm
only (``mix_every``, ``mix_optimizer_state``) are sampled only in trials
whose mode is ipm: TrainConfig refuses them with dg.

:func:`load_space` checks everything before any trial runs: unknown or
per-run fields, bounds, and that the bounds and choices themselves make a
valid TrainConfig on top of the base one.
"""
import dataclasses
import json
from pathlib import Path

from dasktrain.config import ConfigError, TrainConfig
from dasktrain.errors import UserError, argument

KINDS = {'float': {'low', 'high', 'log', 'step'},
         'int': {'low', 'high', 'log', 'step'},
         'categorical': {'choices'}}
IPM_ONLY = ('mix_every', 'mix_optimizer_state')
MODEL_ARG = 'model_args.'  # a space key naming one of the model's args
# Set per trial by the search, or not hyperparameters: base options only.
FIXED = ('out', 'resume', 'progress', 'data_dir', 'url', 'md5', 'devices',
         'workers', 'scheduler', 'on_worker_loss', 'collective_timeout',
         'early_stop_monitor', 'early_stop_mode')


class SpaceError(UserError, ValueError):
    """A search space that names or bounds something it cannot."""


def _read(source):
    """The raw mapping and a name for messages."""
    if isinstance(source, dict):
        return source, 'the space'
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpaceError(f'cannot read the space {path} ({e.strerror})') \
            from None
    try:
        if path.suffix == '.json':
            return json.loads(text), path.name
        import yaml
        return yaml.safe_load(text), path.name
    except ValueError as e:  # JSON and YAML errors both
        kind = 'JSON' if path.suffix == '.json' else 'YAML'
        raise SpaceError(f'{path.name} is not valid {kind}: '
                         f'{str(e).splitlines()[0]}') from None


def _unquote(value):
    """YAML 1.1 reads ``1e-4`` (no dot) as a string: take it as the number
    the user meant."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _number(value, name, where):
    value = _unquote(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpaceError(f'{where}: {name} must be a number, got {value!r}')
    return value


def _distribution(field, spec, where):
    """One field's spec as a normalised dict: type and its keys."""
    if isinstance(spec, list):
        spec = {'type': 'categorical', 'choices': spec}
    if not isinstance(spec, dict) or spec.get('type') not in KINDS:
        raise SpaceError(f"{where}: expected {{type: float|int|categorical, "
                         f'...}} or a list of choices, got {spec!r}')
    kind = spec['type']
    unknown = set(spec) - KINDS[kind] - {'type'}
    if unknown:
        raise SpaceError(f'{where}: {kind} takes '
                         f'{", ".join(sorted(KINDS[kind]))}, not '
                         f'{", ".join(sorted(unknown))}')
    if kind == 'categorical':
        choices = spec.get('choices')
        if not isinstance(choices, list) or not choices or not all(
                c is None or isinstance(c, (bool, int, float, str))
                for c in choices):
            raise SpaceError(f'{where}: choices must be a non-empty list of '
                             f'numbers, strings or null, got {choices!r}')
        return {'type': kind, 'choices': [_unquote(c) for c in choices]}
    low = _number(spec.get('low'), 'low', where)
    high = _number(spec.get('high'), 'high', where)
    if kind == 'int' and not (isinstance(low, int) and isinstance(high, int)):
        raise SpaceError(f'{where}: int bounds must be integers, got low '
                         f'{low!r}, high {high!r}')
    if low >= high:
        raise SpaceError(f'{where}: low {low!r} must be below high {high!r}')
    log = spec.get('log', False)
    if not isinstance(log, bool):
        raise SpaceError(f'{where}: log must be true or false, got {log!r}')
    if log and low <= 0:
        raise SpaceError(f'{where}: log needs low > 0, got low {low!r}')
    step = spec.get('step')
    if step is not None:
        step = _number(step, 'step', where)
        if step <= 0 or log:
            raise SpaceError(f'{where}: step must be > 0 and not with log, '
                             f'got step {step!r}')
    return {'type': kind, 'low': low, 'high': high, 'log': log,
            'step': step}


def _values(dist):
    """The values a distribution's edges stand for, to try on a config."""
    if dist['type'] == 'categorical':
        return dist['choices']
    kind = float if dist['type'] == 'float' else int
    return [kind(dist['low']), kind(dist['high'])]


def load_space(source, base):
    """Read and check a space against the base config.

    Parameters
    ----------
    source : str, Path or dict
        A ``.yaml``/``.yml``/``.json`` file, or the mapping itself.
    base : TrainConfig
        What every trial starts from.

    Returns
    -------
    dict
        field -> normalised distribution (``type``, bounds or ``choices``),
        in the order given.
    """
    raw, name = _read(source)
    if not isinstance(raw, dict) or not raw:
        raise SpaceError(f'{name}: expected a mapping of TrainConfig fields '
                         f'to distributions, got {raw!r}')
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    space = {}
    for key, spec in raw.items():
        field = str(key).replace('-', '_')
        where = f'{name}: {key}'
        if field.startswith(('model_args.', 'model_arg.')):
            arg = field.split('.', 1)[1]
            if not arg.isidentifier():
                raise SpaceError(f'{where}: expected model_args.NAME, NAME '
                                 "a keyword of your model's factory")
            space[MODEL_ARG + arg] = _distribution(field, spec, where)
            continue
        if field not in fields:
            raise SpaceError(f'{where}: TrainConfig has no such field (one of '
                             f'{", ".join(sorted(fields - set(FIXED)))})')
        if field in FIXED:
            raise SpaceError(f'{where}: not a hyperparameter; give it with '
                             'the base options (`dasktrain tune SPACE -- '
                             f'--{field.replace("_", "-")} ...`)')
        space[field] = _distribution(field, spec, where)
    modes = space['mode']['choices'] if 'mode' in space else [base.mode]
    for field in IPM_ONLY:
        if field in space and 'ipm' not in modes:
            raise SpaceError(f'{name}: {field} applies to mode ipm only; add '
                             'ipm to mode in the space, or pass '
                             f'{argument("mode")} ipm')
    for field, dist in space.items():  # the edges must make valid runs
        for value in _values(dist):
            try:
                config_for(base, {field: value}, ipm=field in IPM_ONLY)
            except (ConfigError, TypeError) as e:
                raise SpaceError(f'{name}: {field}: {value!r} is not a valid '
                                 f'value ({e})') from None
    return space


def suggest(trial, space, base):
    """Sample a trial's params with Optuna's ``trial.suggest_*``."""
    params = {}
    for field, dist in space.items():
        if field in IPM_ONLY and params.get('mode', base.mode) != 'ipm':
            continue  # not sampled: TrainConfig refuses it with dg
        if dist['type'] == 'categorical':
            params[field] = trial.suggest_categorical(field, dist['choices'])
        else:
            suggest_number = trial.suggest_float if dist['type'] == 'float' \
                else trial.suggest_int
            extra = {'step': dist['step']} if dist['step'] else {}
            params[field] = suggest_number(field, dist['low'], dist['high'],
                                           log=dist['log'], **extra)
    return params


def config_for(base, params, ipm=False):
    """The TrainConfig of a trial: ``base`` with ``params``; ipm-only fields
    dropped where the trial's mode is dg (``ipm=True`` forces ipm)."""
    changes = {k: v for k, v in params.items()
               if not k.startswith(MODEL_ARG)}
    model_args = {k[len(MODEL_ARG):]: v for k, v in params.items()
                  if k.startswith(MODEL_ARG)}
    if model_args:
        changes['model_args'] = {**(base.model_args or {}), **model_args}
    if ipm:
        changes['mode'] = 'ipm'
    if changes.get('mode', base.mode) != 'ipm':
        changes.update(mix_every=None, mix_optimizer_state=False)
    return base.replace(**changes)
