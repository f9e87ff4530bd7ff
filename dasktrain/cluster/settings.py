"""The cluster-wide settings its processes act on, beside its addresses:
where every job's end is told unless the job names its own (``cluster
start --notify``) and where a webhook may go at all (``--notify-allow``);
the GPU memory a process outside the queue may hold before its GPU
counts as busy (``--busy-mib``); whether a job's GPU ranks on several
machines may sum over NCCL, in clear (``--allow-clear-nccl``); the
longest grace a job gets between the SIGTERM and the SIGKILL of a stop
(``--max-grace``); the processes a job may have at once
(``--pids-per-job``); and a shared cluster's limits per user: jobs
queued at once (``--max-queued-per-user``), bytes of their jobs' files
the queue keeps (``--max-bytes-per-user``), and how
long an ended job is kept before it is purged (``--keep-finished``).

:func:`settings` checks them (one line naming the argument) into the
dict ``cluster.json`` records, a shared cluster's defaults filled in;
:func:`environment` hands them to the scheduler's and workers' processes
as ``$DASKTRAIN_NOTIFY``, ``$DASKTRAIN_BUSY_MIB``, ..., which is where
the readers below (and :mod:`dasktrain.jobs.end_notice`,
:mod:`dasktrain.jobs.worker.gpu_use`) take them from. Owns the names and
checks only.
"""
import json
import math
import os

from dasktrain.errors import UserError, argument
from dasktrain.notify import ALLOW_ENV, SHARED_ALLOW, allow_rules, check_target
from dasktrain.notify import ENV as NOTIFY_ENV

BUSY_ENV = 'DASKTRAIN_BUSY_MIB'
BUSY_MIB = 256  # default: a CUDA context alone is ~100-300 MiB
GRACE_ENV = 'DASKTRAIN_MAX_GRACE'
MAX_GRACE = 30.0  # s: Slurm's KillWait, the admin's, not the job's
PIDS_ENV = 'DASKTRAIN_PIDS_PER_JOB'
QUEUED_ENV = 'DASKTRAIN_MAX_QUEUED'
BYTES_ENV = 'DASKTRAIN_MAX_BYTES'
KEEP_ENV = 'DASKTRAIN_KEEP_FINISHED'
CLEAR_NCCL_ENV = 'DASKTRAIN_ALLOW_CLEAR_NCCL'
# A shared cluster's defaults (a cluster of your own has no such limit,
# and its GPU ranks, yours, use NCCL between machines).
SHARED = {'max_queued_per_user': 1000, 'max_bytes_per_user': 256 * 2 ** 20,
          'keep_finished': 30 * 86400.0, 'notify_allow': list(SHARED_ALLOW),
          'allow_clear_nccl': False}
_ENV = {'notify': NOTIFY_ENV, 'busy_mib': BUSY_ENV, 'max_grace': GRACE_ENV,
        'pids_per_job': PIDS_ENV, 'max_queued_per_user': QUEUED_ENV,
        'max_bytes_per_user': BYTES_ENV, 'keep_finished': KEEP_ENV,
        'notify_allow': ALLOW_ENV, 'allow_clear_nccl': CLEAR_NCCL_ENV}


def _positive(value, name, kind=int, zero=False):
    ok = not isinstance(value, bool) and isinstance(
        value, (int,) if kind is int else (int, float)) and \
        math.isfinite(value) and (value >= 0 if zero else value > 0)
    if not ok:
        raise UserError(f'{argument(name)} must be '
                        f'{"an int" if kind is int else "a number"} '
                        f'{">=" if zero else ">"} 0, got {value!r}')
    return value


def settings(notify=None, busy_mib=None, max_grace=None, pids_per_job=None,
             notify_allow=None, max_queued_per_user=None,
             max_bytes_per_user=None, keep_finished=None,
             allow_clear_nccl=None, shared=False):
    """The settings, checked; ``shared``: a shared cluster's defaults for
    those not given.

    >>> settings(busy_mib=1000)['busy_mib']
    1000
    >>> settings(shared=True)['keep_finished']
    2592000.0
    """
    notify = check_target(notify)
    if busy_mib is not None and (isinstance(busy_mib, bool) or not
                                 isinstance(busy_mib, (int, float)) or
                                 not busy_mib >= 0):
        raise UserError(f'{argument("busy_mib")} must be MiB >= 0, got '
                        f'{busy_mib!r}')
    chosen = {'notify': notify, 'busy_mib': busy_mib,
              'max_grace': None if max_grace is None else float(
                  _positive(max_grace, 'max_grace', float, zero=True)),
              'pids_per_job': None if pids_per_job is None else
              _positive(pids_per_job, 'pids_per_job'),
              'notify_allow': None if notify_allow is None else
              list(allow_rules(notify_allow)),
              'max_queued_per_user': None if max_queued_per_user is None
              else _positive(max_queued_per_user, 'max_queued_per_user'),
              'max_bytes_per_user': None if max_bytes_per_user is None
              else _positive(max_bytes_per_user, 'max_bytes_per_user'),
              'keep_finished': None if keep_finished is None else
              math.inf if keep_finished == math.inf else float(
                  _positive(keep_finished, 'keep_finished', float)),
              'allow_clear_nccl': None if allow_clear_nccl is None else
              bool(allow_clear_nccl)}
    if shared:
        chosen.update({k: v for k, v in SHARED.items()
                       if chosen[k] is None})
    return chosen


def environment(env, chosen):
    """``env`` with the settings ``chosen`` (from :func:`settings`) as the
    cluster's processes read them; an unset one is removed.

    >>> environment({'DASKTRAIN_NOTIFY': 'x'}, settings(busy_mib=64))
    {'DASKTRAIN_BUSY_MIB': '64'}
    """
    env = dict(env)
    for key, name in _ENV.items():
        env.pop(name, None)
        value = chosen.get(key)
        if value is not None:
            env[name] = json.dumps(value) if isinstance(value, list) \
                else str(value)
    return env


def _number(name, env, default=None):
    text = (os.environ if env is None else env).get(name)
    try:
        value = float(text) if text else default
    except ValueError:
        return default
    return value if value is None or value >= 0 else default


def max_grace(env=None):
    """The longest grace a job gets (``--max-grace``), seconds.

    >>> max_grace({}), max_grace({'DASKTRAIN_MAX_GRACE': '5'})
    (30.0, 5.0)
    """
    return _number(GRACE_ENV, env, MAX_GRACE)


def job_pids(env=None):
    """The processes one job may have (``--pids-per-job``), or None."""
    value = _number(PIDS_ENV, env)
    return None if value is None else int(value)


def max_queued(env=None):
    """Jobs one user may have queued or running (``--max-queued-per-
    user``), or None."""
    value = _number(QUEUED_ENV, env)
    return None if value is None else int(value)


def max_bytes(env=None):
    """Bytes of one user's job files the queue keeps
    (``--max-bytes-per-user``), or None."""
    value = _number(BYTES_ENV, env)
    return None if value is None else int(value)


def keep_finished(env=None):
    """Seconds an ended job is kept before it is purged
    (``--keep-finished``), or None: for ever."""
    return _number(KEEP_ENV, env)


def clear_nccl(env=None, shared=False):
    """Whether a job's GPU ranks on several machines may sum over NCCL,
    whose sockets are neither encrypted nor authenticated (``cluster
    start --allow-clear-nccl``); where this process was not told (a
    worker joined by hand), a ``shared`` cluster's default: no, they use
    sealed links; a cluster of your own's: yes.

    >>> clear_nccl({}), clear_nccl({CLEAR_NCCL_ENV: 'False'})
    (True, False)
    >>> clear_nccl({}, shared=True)
    False
    """
    told = (os.environ if env is None else env).get(CLEAR_NCCL_ENV)
    return not shared if told is None else told != 'False'


def _duration(seconds):
    if seconds == math.inf:
        return 'never'
    for unit, size in (('d', 86400), ('h', 3600), ('min', 60)):
        if seconds >= size and seconds % size == 0:
            return f'{seconds / size:g} {unit}'
    return f'{seconds:g} s'


def rules(env=None):
    """The settings in force in this cluster's processes, in words, one
    line each (``cluster status``).

    >>> rules({'DASKTRAIN_MAX_QUEUED': '1000', 'DASKTRAIN_KEEP_FINISHED':
    ...        '2592000'})[1:3]
    ['per user: at most 1000 jobs queued or running', \
'ended jobs purged after 30 d (--keep-finished)']
    """
    env = os.environ if env is None else env
    lines = [f'a stopped job gets SIGKILL {max_grace(env):g} s after its '
             'SIGTERM at most (--max-grace)']
    per_user = []
    if max_queued(env) is not None:
        per_user.append(f'{max_queued(env)} jobs queued or running')
    if max_bytes(env) is not None:
        per_user.append(f'{max_bytes(env) / 2 ** 20:g} MiB of job files')
    if per_user:
        lines.append(f'per user: at most {", ".join(per_user)}')
    if job_pids(env) is not None:
        lines.append(f'per job: at most {job_pids(env)} processes')
    keep = keep_finished(env)
    if keep is not None and keep != math.inf:
        lines.append(f'ended jobs purged after {_duration(keep)} '
                     '(--keep-finished)')
    lines.append('GPU ranks on several machines: NCCL, in clear on the '
                 'network (--allow-clear-nccl)' if clear_nccl(env) else
                 'GPU ranks on several machines: sealed links, not NCCL '
                 "(in clear; cluster start --allow-clear-nccl allows it)")
    allowed = env.get(ALLOW_ENV)
    if allowed:
        try:
            lines.append('notifications go to: ' +
                         ', '.join(json.loads(allowed)))
        except (ValueError, TypeError):
            pass
    return lines
