"""What a job's end tells its submitter: ``--notify URL`` (or the
cluster's default, ``cluster start --notify URL``) gets one message when
a job ends ``finished``, ``failed``, ``cancelled``, ``pruned`` or
``lost``: job, name, user, state, how long it ran, and its final test
accuracy (a run that logged one) or its program's exit code.

:func:`ended` is called by :func:`dasktrain.jobs.job.update_status`
on every change of a job's status, wherever that happens (the worker, a
``cancel`` of a queued job, ``cluster stop``, a lost job found again), so
every end is told exactly once: on the change from a live state to an
end. The message goes out in the background
(:func:`dasktrain.notify.send_later`): a webhook that fails or hangs
never delays the job's end nor changes it.

Delivering it is :mod:`dasktrain.notify`'s. It reads a job's files as
plain JSON and never writes them.
"""
import logging
import os
from pathlib import Path

from dasktrain.cluster.local import read_state
from dasktrain.files import read_json
from dasktrain.notify import ENV, send_later

logger = logging.getLogger(__name__)

ENDS = ('finished', 'failed', 'cancelled', 'pruned', 'lost')


def target(spec, env=None, state=None):
    """Where the end of the job ``spec`` (its ``job.json``) is told: its
    own ``notify``; else the cluster's default, from its processes'
    environment (``DASKTRAIN_NOTIFY``, set by ``cluster start --notify``)
    or the recorded cluster's (when the job was queued on it); else None.

    Examples
    --------
    >>> target({'notify': 'https://h/x'}, env={})
    'https://h/x'
    >>> target({'scheduler': 'tls://a:1'}, env={},
    ...        state={'scheduler': 'tls://a:1', 'notify': 'https://h/d'})
    'https://h/d'
    >>> target({'scheduler': 'tls://b:1'}, env={},
    ...        state={'scheduler': 'tls://a:1', 'notify': 'https://h/d'})
    """
    if spec.get('notify'):
        return spec['notify']
    env = os.environ if env is None else env
    if env.get(ENV):
        return env[ENV]
    state = read_state() if state is None else state
    if state and state.get('notify') and \
            state.get('scheduler') == spec.get('scheduler'):
        return state['notify']
    return None


def duration(seconds):
    """Seconds in words, to the minute (to the second below one).

    >>> duration(42.4), duration(754), duration(3 * 3600 + 125)
    ('42 s', '12 min', '3 h 02 min')
    """
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f'{seconds} s'
    minutes = seconds // 60
    if minutes < 60:
        return f'{minutes} min'
    return f'{minutes // 60} h {minutes % 60:02d} min'


def message(spec, status, rows=()):
    """The text of a job's end, from its ``job.json``, ``status.json``
    and log rows.

    Examples
    --------
    >>> spec = {'id': 'x-1', 'name': 'resnet', 'user': 'ann'}
    >>> message(spec, {'state': 'finished', 'started': 0, 'ended': 600},
    ...         [{'epoch': 9, 'validation/main/accuracy': 0.91234}])[24:]
    'finished after 10 min: epoch 9, test accuracy 0.9123'
    >>> message(spec, {'state': 'failed', 'started': 0, 'ended': 30,
    ...                'exit_code': 3, 'error': 'exit 3'})
    'job x-1 (resnet) of ann failed after 30 s: exit code 3'
    >>> message(spec, {'state': 'finished', 'ending': 'stopped by request',
    ...                'started': 0, 'ended': 60})
    'job x-1 (resnet) of ann finished (stopped by request) after 1 min'
    >>> message(spec, {'state': 'cancelled', 'started': None, 'ended': 9})
    'job x-1 (resnet) of ann cancelled before it started'
    """
    head = f"job {spec.get('id')} ({spec.get('name')}) of " \
        f"{spec.get('user') or '?'} {status['state']}"
    if status.get('ending'):  # finished (stopped by request)
        head += f" ({status['ending']})"
    started, ended = status.get('started'), status.get('ended')
    if started is None:
        return f'{head} before it started'
    if ended is not None:
        head += f' after {duration(ended - started)}'
    row = rows[-1] if rows else None
    accuracy = row.get('validation/main/accuracy') if row else None
    if isinstance(accuracy, (int, float)) and not isinstance(accuracy, bool):
        return f"{head}: epoch {row.get('epoch')}, test accuracy " \
            f'{accuracy:.4f}'
    code, error = status.get('exit_code'), status.get('error')
    if code is not None and status['state'] in ('finished', 'failed'):
        if code < 0:
            return f"{head}: {error or f'signal {-code}'}"
        if error in (None, f'exit {code}'):  # its exit, and nothing more
            return f'{head}: exit code {code}'
    return f'{head}: {error}' if error and status['state'] != 'finished' \
        else head


def ended(folder, before, status):
    """Called on every status change of the job in ``folder``: if it went
    from ``before`` (a live state) to an end, tell its target in the
    background. Never raises, never waits."""
    if before in ENDS or status.get('state') not in ENDS:
        return None
    try:
        folder = Path(folder)
        spec = read_json(folder / 'job.json', limit=16 * 2 ** 20)
        if not isinstance(spec, dict):
            return None
        where = target(spec)
        if not where or not isinstance(where, str):
            return None
        try:  # a shared cluster's out/ is its user's: no symlink followed,
            uid = spec.get('uid')  # bounded, its rows checked
            rows = read_json(folder / 'out' / 'log',
                             uid if type(uid) is int else None,
                             limit=8 * 2 ** 20)
            rows = [r for r in rows if isinstance(r, dict)] \
                if isinstance(rows, list) else []
        except (OSError, ValueError):
            rows = []
        return send_later(where, message(spec, status, rows))
    except Exception:  # telling never breaks the job's end
        logger.exception('cannot tell the end of the job in %s', folder)
        return None
