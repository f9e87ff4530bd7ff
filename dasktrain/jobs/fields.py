"""A job's fields checked, wherever they come from: a submitter's
arguments, a shared cluster's socket, a job's files. Each check passes
the value it was given or raises one line naming the field
(:class:`JobError`; :class:`RequestError` for a request the queue
refuses): the kit :mod:`~dasktrain.jobs.request` checks a request with
and :mod:`~dasktrain.jobs.job` and :mod:`~dasktrain.jobs.record` read
the job files with, and the words a submitter may use for a duration
(:func:`parse_time`) or a size (:func:`parse_size`).
"""
import math
import re

from dasktrain.as_user import RLIMITS
from dasktrain.errors import UserError, argument

MAX_TEXT = 4 * 1024 * 1024  # characters of one field (a request's bound)
MAX_ENV = 256 * 1024  # bytes of a submitter's environment a job keeps
_ID = re.compile(r'[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}')
_ENV = re.compile(r'[A-Za-z_][A-Za-z0-9_]{0,199}')
_UNITS = {'d': 86400, 'h': 3600, 'm': 60, 's': 1}


class JobError(UserError):
    """A job that cannot be what was asked, or whose files cannot be
    read: one line saying what is wrong."""


class RequestError(JobError):
    """A request the queue refuses (one line)."""


def fail(message):
    raise RequestError(message)


# ------------------------------------------------------ field checks

def text(value, name, limit=4096, optional=False):
    """``value`` if it is a string of at most ``limit`` characters."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > limit or '\0' in value:
        fail(f'{name} must be a string of at most {limit} characters')
    return value


def flag(value, name):
    """``value`` if it is a bool."""
    if not isinstance(value, bool):
        fail(f'{name} must be true or false')
    return value


def seconds(value, name, optional=True, zero=False):
    """``value`` as float seconds (> 0, or >= 0 with ``zero``)."""
    if value is None and optional:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and (value >= 0 if zero else value > 0)
    if not ok:
        fail(f'{name} must be seconds {">=" if zero else ">"} 0')
    return float(value)


def job_id(value):
    """``value`` if it can name a job folder (no path, no dot first).

    >>> job_id('r20-20261122-101500-1a2b3c')
    'r20-20261122-101500-1a2b3c'
    """
    if not isinstance(value, str) or not _ID.fullmatch(value):
        fail(f'not a job id: {value!r}'[:200])
    return value


def environment(env):
    """``env`` if it is a dict of variable names to strings, at most
    :data:`MAX_ENV` bytes in all."""
    if not isinstance(env, dict) or len(env) > 65536:
        fail('env must be a JSON object of strings')
    for key, value in env.items():
        if not _ENV.fullmatch(key):
            fail(f'env: not a variable name: {key!r}'[:200])
        text(value, f'env {key}', MAX_TEXT)
    size = sum(len(k) + len(v) + 2 for k, v in env.items())
    if size > MAX_ENV:
        fail(f'env is {size / 1024:.0f} KiB; a job keeps at most '
             f'{MAX_ENV // 1024} KiB of your environment (largest: '
             f'{max(env, key=lambda k: len(env[k]))}): unset what it '
             'does not need')
    return dict(env)


def rlimits(value):
    """``value`` if it is ``{name: [soft, hard]}`` of
    :data:`dasktrain.as_user.RLIMITS`, ints >= -1 (-1: unlimited)."""
    if not isinstance(value, dict) or set(value) - set(RLIMITS):
        fail(f'rlimits takes {", ".join(RLIMITS)} only')
    for name, pair in value.items():
        if not (isinstance(pair, list) and len(pair) == 2 and
                all(type(v) is int and v >= -1 for v in pair)):
            fail(f'rlimits.{name} must be [soft, hard], ints >= -1')
    return {k: list(v) for k, v in value.items()}


def absolute_path(value):
    """``value`` if it is an absolute path."""
    if not text(value, 'cwd').startswith('/'):
        fail('cwd must be an absolute path')
    return value


def parse_time(value, name='time'):
    """Seconds in ``value``: ``90s``, ``45m``, ``2h``, ``1h30m``, ``1d``,
    or ``H:MM:SS``; a number of seconds passes as it is. JobError naming
    the argument ``name`` otherwise.

    Examples
    --------
    >>> parse_time('2h'), parse_time('1h30m'), parse_time('0:01:30')
    (7200.0, 5400.0, 90.0)
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool) \
            and value > 0:
        return float(value)
    words = str(value).strip().lower()
    if re.fullmatch(r'\d+(:\d{1,2}){1,2}', words):
        total = 0.0
        for part in words.split(':'):
            total = total * 60 + int(part)
    elif re.fullmatch(r'(\d+(\.\d+)?[dhms])+', words):
        total = sum(float(n) * _UNITS[u]
                    for n, u in re.findall(r'(\d+(?:\.\d+)?)([dhms])',
                                           words))
    else:
        total = 0.0
    if total <= 0:
        raise JobError(f'{argument(name)} takes a duration such as 90s, '
                       f'45m, 2h, 1h30m or 2:00:00, got {value!r}')
    return total


_SIZES = {'': 1, 'k': 2 ** 10, 'm': 2 ** 20, 'g': 2 ** 30, 't': 2 ** 40}


def parse_size(value, name='mem'):
    """Bytes in ``value`` (``512M``, ``1.5G``: binary units, as Slurm's
    ``--mem``; an int: bytes); JobError naming ``name`` otherwise.

    >>> parse_size('8G'), parse_size('512m'), parse_size(4096)
    (8589934592, 536870912, 4096)
    """
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    found = re.fullmatch(r'(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?',
                         str(value).strip().lower())
    size = int(float(found[1]) * _SIZES[found[2]]) if found else 0
    if size <= 0:
        raise JobError(f'{argument(name)} takes a size such as 512M, 8G or '
                       f'1.5G, got {value!r}')
    return size


def after_ids(after):
    """``after`` (job ids, or ``'ID,ID'``) as a list of ids.

    >>> after_ids('a, b,'), after_ids(None)
    (['a', 'b'], [])
    """
    if isinstance(after, str):
        after = after.split(',')
    return [str(a).strip() for a in after or () if str(a).strip()]


# ------------------------------------------------ the job files' fields

NUMBER = 'a number'  # a field's kind: an int or float, finite, no bool


def is_a(value, kind):
    """Whether ``value`` is of ``kind`` (a type, or :data:`NUMBER`); an
    int is exactly an int (not a bool)."""
    if kind is NUMBER:
        return isinstance(value, (int, float)) and \
            not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        return type(value) is int
    return isinstance(value, kind)


def checked(data, fields, where, more=lambda data: []):
    """``data`` if it is a dict whose ``fields`` are what they must be
    (None for one not required); JobError naming every key missing (those
    required, and ``more(data)``), else the first that is wrong."""
    if not isinstance(data, dict):
        raise JobError(f'{where} is not a JSON object')
    missing = [key for key, (_, required) in fields.items()
               if required and data.get(key) is None] + more(data)
    if missing:
        raise JobError(f'{where} lacks {", ".join(missing)}')
    for key, (kind, _) in fields.items():
        value = data.get(key)
        if value is None:
            continue
        if not is_a(value, kind):
            what = 'a time in seconds' if key == 'submitted' else \
                kind if kind is NUMBER else \
                f'{"an" if kind.__name__[0] in "aeiou" else "a"} ' \
                f'{kind.__name__}'
            raise JobError(f'{where} has {key}={short(value)}, not {what}')
    return data


def short(value):
    """``value``'s repr, cut to 60 characters, for a one-line error."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + '...'
