"""What a study must agree on before anything runs or is written: its
metric and which way it improves, the trials' early stopping, the numbers
it is given, and the study a storage or ``study.json`` already holds.

Owns those checks (each failure one :class:`TuneError` line naming the
argument); running the study is :mod:`~dasktrain.tuning.study`'s.
"""
import json

from dasktrain.config import IPM_KEYS, LOG_KEYS, better
from dasktrain.errors import UserError, argument

DIRECTIONS = {'maximize': 'max', 'minimize': 'min'}


class TuneError(UserError):
    pass


def check_metric(metric, direction, modes):
    """The study's direction for ``metric``: read off its name where that
    is unambiguous (accuracy: maximize, loss: minimize), else ``direction``
    must say; a ``direction`` contradicting the name is refused."""
    usable = [k for k in LOG_KEYS + IPM_KEYS
              if k not in ('epoch', 'iteration', 'lr')]
    if set(modes) != {'ipm'}:
        usable.remove('drift')  # only ipm runs log it
    if metric not in usable:
        raise TuneError(f'{argument("metric")} {metric} is never in the '
                        'training log of '
                        f'these trials; choose one of {", ".join(usable)}')
    if direction is not None and direction not in DIRECTIONS:
        raise TuneError(f'{argument("direction")} must be maximize or '
                        f'minimize, got {direction!r}')
    implied = better(metric)
    if direction is None:
        if implied is None:
            raise TuneError(f'{argument("metric")} {metric}: whether higher '
                            'or lower is better is not in its name; pass '
                            f'{argument("direction")} maximize or minimize')
        return 'maximize' if implied == 'max' else 'minimize'
    if implied is not None and DIRECTIONS[direction] != implied:
        raise TuneError(f'{argument("direction")} {direction} contradicts '
                        f'{argument("metric")} {metric}, which is better '
                        f'{"higher" if implied == "max" else "lower"}; drop '
                        f'{argument("direction")}')
    return direction


def state_early_stopping(base, metric, direction):
    """The trials' early stopping with its mode stated, never guessed:
    the study's direction when it watches the study's metric. Without
    early stopping the monitor only picks ``model_best.npz``: it becomes
    the metric, so that file holds the epoch the trial's value is from."""
    if base.early_stop_patience is None:
        base = base.replace(early_stop_monitor=metric)
    monitor, mode = base.early_stop_monitor, base.early_stop_mode
    if monitor == metric:
        wanted = DIRECTIONS[direction]
        if mode not in ('auto', wanted):
            raise TuneError(f'{argument("early_stop_mode")} {mode} '
                            f'contradicts {argument("direction")} {direction} '
                            f'for {metric}')
        return base.replace(early_stop_mode=wanted)
    if mode == 'auto' and monitor in LOG_KEYS + IPM_KEYS:
        mode = better(monitor)
        if mode is None:
            raise TuneError(f'{argument("early_stop_monitor")} {monitor}: '
                            f'pass {argument("early_stop_mode")} max or min')
    return base.replace(early_stop_mode=mode)


def check_numbers(**values):
    lows = {'trials': 1, 'parallel': 1}
    for name, value in values.items():
        low = lows.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or \
                value < low:
            raise TuneError(f'{argument(name)} must be an int >= '
                            f'{low}, got {value!r}')


def read_study_file(path):
    """The study's ``study.json``; None where there is none; TuneError
    (one line) where it is damaged: nothing is re-run or mixed."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise TuneError(f'{path} is damaged ({e}); restore it, or pass '
                        f'another {argument("study")}') from None
    if not isinstance(data, dict):
        raise TuneError(f'{path} is damaged (not a JSON object); restore '
                        f'it, or pass another {argument("study")}')
    return data


def check_same_study(found, metric, direction, storage):
    """TuneError where the stored study ``found`` ranks another metric,
    or the same one the other way, than this run would."""
    had = (found.user_attrs.get('metric'), found.direction.name.lower())
    if had[0] is None:  # a study of someone else's: its direction only
        had = (metric, had[1])
    if had != (metric, direction):
        raise TuneError(f'{argument("storage")} {storage} holds study '
                        f'{found.study_name!r}, which is to {had[1]} '
                        f'{had[0]}, not to {direction} {metric}; pass the '
                        f'same {argument("metric")} and '
                        f'{argument("direction")}, or another '
                        f'{argument("study")}')
