"""Telling someone: a webhook (Slack-compatible JSON ``{"text": ...}``
POSTed with ``urllib3``) or ``mailto:ADDR`` through the machine's local
MTA (``sendmail``), checked, sent in the background, retried.

:func:`check_target` says whether a target can be used (one line naming
the argument otherwise); :func:`send` delivers one message, retrying a
failed or slow webhook a few times with a bounded backoff, and only logs
when it gives up; :func:`send_later` does that in the background, so
that nothing waiting on a message (a job being marked ended) is delayed,
and a process that exits first waits for it a bounded time at exit.

Where a webhook may go is the cluster's rule (:func:`allow_rules`,
``cluster start --notify-allow``, ``$DASKTRAIN_NOTIFY_ALLOW``): by
default in a shared cluster only to public addresses (no loopback,
link-local, private, shared, multicast or reserved one), checked on the
addresses the name resolves to when it is sent (:func:`refusal`), and
the POST goes to the very address checked (no second lookup for DNS to
answer otherwise), never following a redirect. A process running as
root never sends itself: :func:`send_later` has a keeper
(:func:`dasktrain.keeper.call`) run :func:`deliver` as ``nobody`` (no
groups), stopped once it outlasts every try it may make, so a webhook
URL is no way to make root connect anywhere.

Owns delivering a text; it knows nothing of jobs (what a job's end says
is :mod:`dasktrain.jobs.end_notice`'). Never raises once a target is
checked: a message that cannot be delivered is a logged warning.
"""
import atexit
import collections
import ipaddress
import json
import logging
import os
import pwd
import shutil
import socket
import subprocess
import threading
import time
from email.message import EmailMessage
from urllib.parse import urlsplit

from dasktrain import keeper
from dasktrain.errors import UserError, argument

logger = logging.getLogger(__name__)

ENV = 'DASKTRAIN_NOTIFY'  # the cluster-wide default, in its processes
ALLOW_ENV = 'DASKTRAIN_NOTIFY_ALLOW'  # where webhooks may go, as JSON
# A shared cluster's default rule: public addresses, and the local MTA.
SHARED_ALLOW = ('public', 'mailto')
NOBODY = 65534  # the uid and gid of `nobody` where it has no entry
ATTEMPTS = 4   # a webhook is tried this often at most ...
TIMEOUT = 10.0  # ... each waiting this long for an answer ...
BACKOFF = 1.0  # ... with 1, 2, 4 s between tries
AT_EXIT = 20.0  # what a process exiting waits for its messages, at most
SENDMAIL = ('/usr/sbin/sendmail', '/usr/lib/sendmail')
GRACE = 1.0  # s between the SIGTERM and the SIGKILL of a sender given up
# The environment of a sender run as `nobody`: none of root's.
SENDER_ENV = {'PATH': '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:'
                      '/sbin:/bin', 'LANG': 'C.UTF-8'}


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


def allow_rules(entries, name='notify_allow'):
    """The rules of where notifications may go, each of ``entries``
    checked: ``public`` (a webhook whose every address is public),
    ``any`` (anywhere), ``mailto`` (mail through the local MTA), a network
    (``10.1.0.0/16``: a webhook whose every address lies in the allowed
    ones) or a URL prefix (``https://chat.lab.example.org/hooks/``:
    those webhooks, wherever the name resolves); NotifyError naming the
    argument ``name`` for anything else.

    >>> allow_rules(['public', '10.0.0.0/8', 'https://chat.lab/hooks/'])
    ('public', '10.0.0.0/8', 'https://chat.lab/hooks/')
    >>> allow_rules(['intranet'])
    Traceback (most recent call last):
    ...
    dasktrain.notify.NotifyError: notify_allow takes public, any, mailto, \
a network (10.0.0.0/8) or a URL prefix (https://host/path), got 'intranet'
    """
    rules = []
    for entry in entries:
        entry = str(entry).strip()
        if entry in ('public', 'any', 'mailto'):
            rules.append(entry)
            continue
        try:
            rules.append(str(ipaddress.ip_network(entry, strict=False)))
            continue
        except ValueError:
            pass
        parts = urlsplit(entry)
        if parts.scheme in ('http', 'https') and parts.hostname:
            rules.append(entry)
            continue
        raise NotifyError(f'{argument(name)} takes public, any, mailto, a '
                          'network (10.0.0.0/8) or a URL prefix '
                          f'(https://host/path), got {entry!r}')
    return tuple(rules)


def rules_of(env=None):
    """The rules in ``$DASKTRAIN_NOTIFY_ALLOW`` (JSON), else ``('any',)``:
    a cluster of your own sends as you, anywhere you could."""
    text = (os.environ if env is None else env).get(ALLOW_ENV)
    try:
        return allow_rules(json.loads(text)) if text else ('any',)
    except (ValueError, TypeError, NotifyError):
        return SHARED_ALLOW  # damaged: the safe default


def _kind(address):
    for kind in ('loopback', 'link_local', 'private', 'multicast',
                 'reserved', 'unspecified'):
        if getattr(address, f'is_{kind}'):
            return kind.replace('_', '-')
    return 'public' if address.is_global else 'not public'


def refusal(target, rules, addresses=None):
    """Why ``target`` may not be told under ``rules`` (one line), or
    None; a webhook's ``addresses`` (default: its host's, resolved now).

    >>> refusal('http://127.0.0.1:8080/x', ('public',))
    'notify http://127.0.0.1:8080/...: 127.0.0.1 is a loopback address; this \
cluster sends to public addresses only (cluster start --notify-allow)'
    >>> refusal('https://hooks.slack.com/x', ('public',),
    ...         addresses=['34.1.2.3']) is None
    True
    """
    if 'any' in rules:
        return None
    if target.startswith('mailto:'):
        return None if 'mailto' in rules else (
            f'notify {target}: this cluster sends no mail (cluster start '
            '--notify-allow mailto)')
    if any(r.startswith(('http://', 'https://')) and target.startswith(r)
           for r in rules):
        return None
    parts = urlsplit(target)
    if addresses is None:
        try:
            addresses = resolve(parts.hostname, parts.port)
        except OSError as e:
            return f'notify {redacted(target)}: cannot resolve ' \
                f'{parts.hostname} ({e.strerror or e})'
    networks = [ipaddress.ip_network(r) for r in rules
                if r[0].isdigit() or ':' in r and '//' not in r]
    allowed = [r for r in rules if r in ('public', 'mailto')] + \
        [str(n) for n in networks]
    for text in addresses:
        address = ipaddress.ip_address(text)
        if getattr(address, 'ipv4_mapped', None):
            address = address.ipv4_mapped
        if 'public' in rules and address.is_global or \
                any(address in n for n in networks):
            continue
        kind = _kind(address)
        article = 'an' if kind[0] in 'aeiou' else 'a'
        only = ' and '.join(f'{r} addresses' if r == 'public' else r
                            for r in allowed if r != 'mailto') or 'nowhere'
        return (f'notify {redacted(target)}: {address} is {article} {kind} '
                f'address; this cluster sends to {only} only (cluster start '
                '--notify-allow)')
    return None


def resolve(host, port=None):
    """The addresses ``host`` resolves to now (a literal address: itself);
    OSError if none."""
    try:
        return [str(ipaddress.ip_address(host.strip('[]')))]
    except ValueError:
        pass
    found = socket.getaddrinfo(host, port or 443, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in found))


def _post(target, text, timeout, rules):
    """POST ``text`` to ``target`` at the address :func:`refusal` checked;
    the HTTP status, or NotifyError (refused: no retry), or OSError and
    urllib3's errors (try again)."""
    import urllib3
    parts = urlsplit(target)
    addresses = resolve(parts.hostname, parts.port)
    why = refusal(target, rules, addresses)
    if why:
        raise NotifyError(why)
    https = parts.scheme == 'https'
    port = parts.port or (443 if https else 80)
    options = {'timeout': urllib3.Timeout(connect=timeout, read=timeout),
               'retries': False}
    if https:
        pool = urllib3.HTTPSConnectionPool(
            addresses[0], port, server_hostname=parts.hostname,
            assert_hostname=parts.hostname, ssl_context=_tls(), **options)
    else:
        pool = urllib3.HTTPConnectionPool(addresses[0], port, **options)
    path = (parts.path or '/') + (f'?{parts.query}' if parts.query else '')
    with pool:
        answer = pool.urlopen(
            'POST', path, body=json.dumps({'text': text}).encode(),
            headers={'Host': parts.netloc.rsplit('@', 1)[-1],
                     'Content-Type': 'application/json'},
            redirect=False, assert_same_host=False, preload_content=True)
    return answer.status


_loaded = {}


def _tls():
    """The TLS context of every webhook POST (certifi's CAs), made once:
    a sender that dropped to ``nobody`` may no longer read them."""
    if 'tls' not in _loaded:
        import ssl

        import certifi
        _loaded['tls'] = ssl.create_default_context(cafile=certifi.where())
    return _loaded['tls']


def _preload():
    """Everything :func:`send` imports or reads, loaded now: a sender that
    dropped to ``nobody`` may not read this interpreter's files (one
    under ``/root``)."""
    import email.policy  # noqa: F401  (mailto)
    import encodings.idna  # noqa: F401  (a host name, encoded)
    import http.client  # noqa: F401

    import urllib3
    import urllib3.exceptions
    import urllib3.util.ssl_
    _tls()
    urllib3.HTTPConnectionPool('127.0.0.1', 9)  # its lazy imports
    socket.getaddrinfo('localhost', 80, type=socket.SOCK_STREAM)


def send(target, text, attempts=None, timeout=None, backoff=None,
         rules=None):
    """Deliver ``text`` to ``target`` now; True once delivered, False (and
    a logged warning) when every attempt failed. Default: :data:`ATTEMPTS`
    tries of :data:`TIMEOUT` seconds, :data:`BACKOFF`. A webhook's 2xx
    is delivery; a connection error, a timeout, 429 or 5xx is tried again
    after ``backoff``, then twice that, ...; another 4xx, or a redirect,
    is not (the URL is wrong: retrying cannot help). ``rules``: where it
    may go (:func:`allow_rules`; default :func:`rules_of` this process's
    environment), checked at each try on the addresses it then resolves
    to: a target the rules refuse is logged, not sent."""
    attempts = ATTEMPTS if attempts is None else attempts
    timeout = TIMEOUT if timeout is None else timeout
    backoff = BACKOFF if backoff is None else backoff
    rules = rules_of() if rules is None else rules
    where = redacted(target)
    if target.startswith('mailto:'):
        why = refusal(target, rules)
        if why:
            logger.warning('notification not sent: %s', why)
            return False
        return _mail(target[len('mailto:'):], text, timeout)
    import urllib3
    for attempt in range(1, attempts + 1):
        try:
            code = _post(target, text, timeout, rules)
            if 200 <= code < 300:
                return True
            why = f'HTTP {code}'
            if code < 500 and code != 429:
                logger.warning('notification to %s refused (%s); not '
                               'retried', where, why)
                return False
        except NotifyError as e:
            logger.warning('notification not sent: %s', e)
            return False
        except (OSError, urllib3.exceptions.HTTPError) as e:
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
    """:func:`send` in the background; returns at once with the thread
    that waits for it. A process running as root sends from a program of
    its own run as ``nobody`` under its keeper (:func:`_unprivileged`). A
    process that
    exits waits for its messages at most :data:`AT_EXIT` seconds in
    all."""
    work = _unprivileged if os.geteuid() == 0 else _send_quietly
    thread = threading.Thread(target=work, args=(target, text),
                              kwargs=kwargs, name='dasktrain-notify',
                              daemon=True)
    with _lock:
        if not _at_exit:
            _at_exit.append(atexit.register(wait_pending))
        _pending[:] = [t for t in _pending if t.is_alive()] + [thread]
    thread.start()
    return thread


def nobody():
    """``(uid, gid)`` of the user ``nobody`` (:data:`NOBODY` where it has
    no entry)."""
    try:
        entry = pwd.getpwnam('nobody')
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return NOBODY, NOBODY


# Whom a sender runs as: keeper.start's user.
_User = collections.namedtuple('_User', 'uid gid groups name')


def _unprivileged(target, text, **kwargs):
    """:func:`send` as :func:`deliver` under its keeper
    (:func:`dasktrain.keeper.call`), as ``nobody`` with no groups: stopped
    (SIGTERM, SIGKILL after :data:`GRACE`) if it outlasts every try it may
    make. Waited for in this thread."""
    uid, gid = nobody()
    attempts = kwargs.get('attempts') or ATTEMPTS
    timeout = kwargs.get('timeout') or TIMEOUT
    backoff = kwargs.get('backoff') or BACKOFF
    limit = attempts * (timeout * 2 + backoff * 2 ** attempts)
    asked = {'target': target, 'text': text, 'attempts': attempts,
             'timeout': timeout, 'backoff': backoff,
             'rules': list(kwargs.get('rules') or rules_of())}
    try:
        kept = keeper.call(f'{__name__}:deliver', asked, GRACE, SENDER_ENV,
                           stdout=subprocess.DEVNULL, stderr=None,
                           user=_User(uid, gid, [], 'nobody'), cwd='/')
    except OSError as e:
        logger.warning('notification to %s not sent: %s', redacted(target), e)
        return
    deadline = time.monotonic() + limit
    ended = kept.watch(lambda: time.monotonic() > deadline, GRACE)
    if ended.error is not None:
        logger.warning('notification to %s not sent: %s', redacted(target),
                       ended.error)
    elif ended.stopped is not None:
        logger.warning('notification to %s given up after %.0f s',
                       redacted(target), limit)


def deliver(asked, drop):
    """A sender's body, forked by its keeper as root
    (:func:`_unprivileged`): all that :func:`send` reads loaded, then
    ``drop()`` (it is ``nobody`` from then on), then ``asked``'s message
    sent; its exit code."""
    logging.basicConfig(format='dasktrain notify: %(message)s')
    _preload()
    drop()
    return 0 if send(asked['target'], asked['text'], asked['attempts'],
                     asked['timeout'], asked['backoff'],
                     tuple(asked['rules'])) else 1


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

