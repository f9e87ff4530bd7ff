"""The cluster-wide settings the cluster's processes act on, beside its
addresses: where every job's end is told unless the job names its own
(``cluster start --notify``) and the GPU memory a process outside the
queue may hold before its GPU counts as busy (``--busy-mib``).

:func:`settings` checks them (one line naming the argument) into the
dict ``cluster.json`` records; :func:`environment` hands them to the
scheduler's and workers' processes as ``$DASKTRAIN_NOTIFY`` and
``$DASKTRAIN_BUSY_MIB``, which is where jobs' ends
(:mod:`dasktrain.jobs.end_notice`) and the GPU readings
(:mod:`dasktrain.jobs.worker.gpu_use`) read them. Owns the names and
checks only.
"""
from dasktrain.errors import UserError, argument
from dasktrain.notify import ENV as NOTIFY_ENV
from dasktrain.notify import check_target

BUSY_ENV = 'DASKTRAIN_BUSY_MIB'
BUSY_MIB = 256  # default: a CUDA context alone is ~100-300 MiB


def settings(notify=None, busy_mib=None):
    """``{'notify': ..., 'busy_mib': ...}``, checked.

    >>> settings(busy_mib=1000)
    {'notify': None, 'busy_mib': 1000}
    """
    notify = check_target(notify)
    if busy_mib is not None and (isinstance(busy_mib, bool) or not
                                 isinstance(busy_mib, (int, float)) or
                                 not busy_mib >= 0):
        raise UserError(f'{argument("busy_mib")} must be MiB >= 0, got '
                        f'{busy_mib!r}')
    return {'notify': notify, 'busy_mib': busy_mib}


def environment(env, chosen):
    """``env`` with the settings ``chosen`` (from :func:`settings`) as the
    cluster's processes read them; an unset one is removed.

    >>> environment({'DASKTRAIN_NOTIFY': 'x'}, settings(busy_mib=64))
    {'DASKTRAIN_BUSY_MIB': '64'}
    """
    env = dict(env)
    for key, value in ((NOTIFY_ENV, chosen.get('notify')),
                       (BUSY_ENV, chosen.get('busy_mib'))):
        env.pop(key, None)
        if value is not None:
            env[key] = str(value)
    return env
