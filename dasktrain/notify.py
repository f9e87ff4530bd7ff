"""Telling someone: a webhook (Slack-compatible JSON ``{"text": ...}``
POSTed with ``requests``) or ``mailto:ADDR`` through the machine's local
MTA (``sendmail``), checked, sent in the background, retried.

:func:`check_target` says whether a target can be used (one line naming
the argument otherwise); :func:`send` delivers one message, retrying a
failed or slow webhook a few times with a bounded backoff, and only logs
when it gives up; :func:`send_later` does that in a daemon thread, so
that nothing waiting on a message (a job being marked ended) is delayed,
and a process that exits first waits for it a bounded time at exit.

Owns delivering a text; it knows nothing of jobs (what a job's end says
is :mod:`dasktrain.jobs.end_notice`'). Never raises once a target is
checked: a message that cannot be delivered is a logged warning.
"""
import atexit
import logging
import shutil
import subprocess
import threading
import time
from email.message import EmailMessage
from urllib.parse import urlsplit

from dasktrain.errors import UserError, argument

logger = logging.getLogger(__name__)

ENV = 'DASKTRAIN_NOTIFY'  # the cluster-wide default, in its processes
ATTEMPTS = 4   # a webhook is tried this often at most ...
TIMEOUT = 10.0  # ... each waiting this long for an answer ...
BACKOFF = 1.0  # ... with 1, 2, 4 s between tries
AT_EXIT = 20.0  # what a process exiting waits for its messages, at most
SENDMAIL = ('/usr/sbin/sendmail', '/usr/lib/sendmail')


class NotifyError(UserError):
    pass


def sendmail():
    """The local MTA's ``sendmail`` program, or None."""
    found = shutil.which('sendmail')
    if found:
        return found
    for path in SENDMAIL:
        if shutil.which(path):
            return path
    return None


def check_target(target, name='notify'):
    """``target`` if it can be notified: an ``http(s)://`` URL with a host,
    or ``mailto:ADDR`` on a machine with ``sendmail``; None for None or
    ``''``; NotifyError naming the argument ``name`` otherwise.

    Examples
    --------
    >>> check_target('https://hooks.slack.com/services/T0/B0/x')
    'https://hooks.slack.com/services/T0/B0/x'
    >>> check_target('hooks.slack.com')
    Traceback (most recent call last):
    ...
    dasktrain.notify.NotifyError: notify takes an http(s):// URL (a Slack ...
    """
    if target is None or target == '':
        return None
    if not isinstance(target, str):
        raise NotifyError(f'{argument(name)} takes a URL, got {target!r}')
    if target.startswith('mailto:'):
        address = target[len('mailto:'):]
        if '@' not in address or any(c.isspace() for c in address):
            raise NotifyError(f'{argument(name)} {target}: not an address '
                              '(mailto:you@example.org)')
        if sendmail() is None:
            raise NotifyError(f'{argument(name)} {target}: this machine has '
                              'no local mail server (no sendmail found); '
                              'use a webhook URL (Slack, Mattermost) instead')
        return target
    parts = urlsplit(target)
    if parts.scheme not in ('http', 'https') or not parts.hostname:
        raise NotifyError(f'{argument(name)} takes an http(s):// URL (a Slack '
                          'or Mattermost incoming webhook) or mailto:ADDR, '
                          f'got {target!r}')
    return target


def send(target, text, attempts=None, timeout=None, backoff=None):
    """Deliver ``text`` to ``target`` now; True once delivered, False (and
    a logged warning) when every attempt failed. Default: :data:`ATTEMPTS`
    tries of :data:`TIMEOUT` seconds, :data:`BACKOFF`. A webhook's 2xx
    is delivery; a connection error, a timeout, 429 or 5xx is tried again
    after ``backoff``, then twice that, ...; another 4xx is not (the URL
    is wrong: retrying cannot help)."""
    attempts = ATTEMPTS if attempts is None else attempts
    timeout = TIMEOUT if timeout is None else timeout
    backoff = BACKOFF if backoff is None else backoff
    if target.startswith('mailto:'):
        return _mail(target[len('mailto:'):], text, timeout)
    import requests
    where = redacted(target)
    for attempt in range(1, attempts + 1):
        try:
            answer = requests.post(target, json={'text': text},
                                   timeout=timeout)
            if 200 <= answer.status_code < 300:
                return True
            why = f'HTTP {answer.status_code}'
            if answer.status_code < 500 and answer.status_code != 429:
                logger.warning('notification to %s refused (%s); not '
                               'retried', where, why)
                return False
        except requests.RequestException as e:
            why = type(e).__name__
        if attempt < attempts:
            logger.info('notification to %s failed (%s), try %d of %d',
                        where, why, attempt, attempts)
            time.sleep(backoff * 2 ** (attempt - 1))
    logger.warning('notification to %s failed %d times (last: %s); given '
                   'up', where, attempts, why)
    return False


def redacted(url):
    """A webhook URL without its secret path (Slack's holds the token)."""
    parts = urlsplit(url)
    return f'{parts.scheme}://{parts.netloc}/...' if parts.path.strip('/') \
        else url


def _mail(address, text, timeout):
    program = sendmail()
    if program is None:
        logger.warning('no sendmail on this machine: cannot mail %s', address)
        return False
    message = EmailMessage()
    message['To'] = address
    message['Subject'] = text.splitlines()[0][:120]
    message.set_content(text)
    try:
        subprocess.run([program, '-t', '-oi'], input=message.as_bytes(),
                       timeout=timeout * 3, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return True
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning('mail to %s failed: %s', address, e)
        return False


_pending = []  # threads still sending
_lock = threading.Lock()
_at_exit = []  # [True] once wait_pending is registered


def send_later(target, text, **kwargs):
    """:func:`send` in a daemon thread; returns it at once. A process that
    exits waits for it at most :data:`AT_EXIT` seconds in all."""
    thread = threading.Thread(target=_send_quietly, args=(target, text),
                              kwargs=kwargs, name='dasktrain-notify',
                              daemon=True)
    with _lock:
        if not _at_exit:
            _at_exit.append(atexit.register(wait_pending))
        _pending[:] = [t for t in _pending if t.is_alive()] + [thread]
    thread.start()
    return thread


def _send_quietly(target, text, **kwargs):
    try:
        send(target, text, **kwargs)
    except Exception:  # a notification never breaks what sent it
        logger.exception('notification to %s failed', redacted(target))


def wait_pending(timeout=AT_EXIT):
    """Wait for messages still being sent, ``timeout`` seconds at most."""
    deadline = time.monotonic() + timeout
    with _lock:
        threads = [t for t in _pending if t.is_alive()]
    if threads:
        logger.info('sending the notification of a job\'s end (at most '
                    '%.0f s)', timeout)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
