"""The shared queue's wire and rules, as pure functions: what a request to
the front door may say, who is asking, and who may act on a job.

One connection carries one request and one response, each a line of
JSON (:func:`encode`): ``{"op": ..., fields}`` and ``{"ok": true, ...}``
or ``{"ok": false, "error": "one line"}``. A request is at most
:data:`MAX_REQUEST` bytes; :func:`check_request` checks every field of
every operation (types, sizes, job ids, file names, environment names)
and refuses anything else in one line: nothing is evaluated or
unpickled. Who asks is never a field: it is the kernel's word, the
connection's ``SO_PEERCRED`` (:func:`peer_credentials`).

A job's submitter, root, and the user who started the cluster with sudo
may act on it (:func:`may_act`: cancel, requeue, read its logs and
results); anyone may see the jobs table and a job's state.

Owns the format, its limits, the checks and the rule; serving is
:mod:`~dasktrain.jobs.frontdoor`'s, asking :mod:`~dasktrain.jobs.door`'s.
"""
import base64
import binascii
import collections
import json
import math
import re
import struct

from dasktrain.jobs.records import JobError

MAX_REQUEST = 4 * 1024 * 1024     # bytes of one request line
MAX_RESPONSE = 64 * 1024 * 1024   # bytes of one response (a client's cap)
LOG_CHUNK = 1024 * 1024           # bytes of output.log per `logs` answer
OPS = ('ping', 'cluster', 'submit', 'jobs', 'status', 'result', 'logs',
       'cancel', 'requeue', 'gpus')
KINDS = ('train', 'program')
FILES = {'model': 'model', 'dataset': 'data'}  # request key -> folder
_ID = re.compile(r'[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}')
_ENV = re.compile(r'[A-Za-z_][A-Za-z0-9_]{0,199}')
_FILE = re.compile(r'[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}\.py')

# A job across workers (and a search's trials) would need its user to
# reach Dask, which only root may in a shared cluster.
NO_WORKERS = ('a shared cluster runs no job across workers (--workers): its '
              'ranks would need Dask, which only the cluster\'s owner '
              'reaches. Ask for the GPUs of one machine instead (`dasktrain '
              'submit --gpus 4 -- --devices 0,1,2,3`), or run ranks on the '
              'job\'s own GPUs as a command job (`dasktrain submit --gpus 2 '
              '-- dasktrain launch -n 2 -- python train.py`)')

Peer = collections.namedtuple('Peer', 'pid uid gid')
Peer.__doc__ = 'Who is at the other end of a Unix socket, as the kernel says.'


class ProtocolError(JobError):
    """A request the front door refuses (one line)."""


def peer_credentials(raw):
    """:class:`Peer` from ``getsockopt(SOL_SOCKET, SO_PEERCRED, 12)``'s
    bytes (``struct ucred``: pid, uid, gid); ProtocolError for anything
    else.

    >>> peer_credentials(struct.pack('3i', 4242, 1000, 1000))
    Peer(pid=4242, uid=1000, gid=1000)
    """
    if not isinstance(raw, bytes) or len(raw) != struct.calcsize('3i'):
        raise ProtocolError('no peer credentials on this connection')
    pid, uid, gid = struct.unpack('3i', raw)
    if uid < 0 or gid < 0:
        raise ProtocolError('no peer credentials on this connection')
    return Peer(pid, uid, gid)


def encode(message):
    """``message`` as one line of JSON, bytes."""
    return json.dumps(message, separators=(',', ':')).encode() + b'\n'


def decode(line, limit=MAX_REQUEST):
    """The JSON object in ``line`` (bytes); ProtocolError otherwise."""
    if len(line) > limit:
        raise ProtocolError(f'a request is at most {limit // 2 ** 20} MiB')
    try:
        message = json.loads(line.decode('utf-8'))
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f'not a JSON request ({e})') from None
    if not isinstance(message, dict):
        raise ProtocolError('a request is a JSON object')
    return message


def may_act(uid, job_uid, owners):
    """Whether the user ``uid`` may act on (cancel, requeue, read) a job
    of ``job_uid``: its submitter, or one of the cluster's ``owners``
    (root, and the user who ran ``sudo ... cluster start --shared``).

    >>> may_act(1001, 1001, {0}), may_act(1002, 1001, {0, 1000})
    (True, False)
    >>> may_act(1000, 1001, {0, 1000}), may_act(0, 1001, {0})
    (True, True)
    """
    return uid == job_uid or uid in owners


def refusal(job_id, user, owner_names, verb='cancel'):
    """The one line a user who may not act on a job gets.

    >>> refusal('r20-1', 'ann', ['root', 'alice'])[26:]
    "only ann or the cluster's owner (root, alice) can cancel it"
    """
    return (f"job {job_id} belongs to {user}; only {user} or the cluster's "
            f"owner ({', '.join(owner_names)}) can {verb} it")


def _fail(message):
    raise ProtocolError(message)


def _text(value, name, limit=4096, optional=False):
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > limit or '\0' in value:
        _fail(f'{name} must be a string of at most {limit} characters')
    return value


def _flag(value, name):
    if not isinstance(value, bool):
        _fail(f'{name} must be true or false')
    return value


def _seconds(value, name, optional=True, zero=False):
    if value is None and optional:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and (value >= 0 if zero else value > 0)
    if not ok:
        _fail(f'{name} must be seconds {">=" if zero else ">"} 0')
    return float(value)


def job_id(value):
    """``value`` if it can name a job folder (no path, no dot first).

    >>> job_id('r20-20261122-101500-1a2b3c')
    'r20-20261122-101500-1a2b3c'
    """
    if not isinstance(value, str) or not _ID.fullmatch(value):
        _fail(f'not a job id: {value!r}'[:200])
    return value


_FIELDS = {  # op -> the fields it takes beyond op (and `cli`)
    'ping': (), 'cluster': (), 'jobs': (), 'gpus': (),
    'status': ('id',), 'result': ('id',), 'cancel': ('id',),
    'requeue': ('id',), 'logs': ('id', 'offset')}
_COMMON = ('kind', 'name', 'gpus', 'notify', 'after', 'after_any', 'time',
           'time_limit')
_SUBMIT = {'train': _COMMON + ('config', 'files'),
           'program': _COMMON + ('command', 'cwd', 'env', 'grace',
                                 'requeue')}


def check_request(message):
    """The request ``message`` (a dict from :func:`decode`) with every
    field checked (a submit's files decoded to bytes); ProtocolError
    naming the first field that is wrong, or the first one too many.

    >>> check_request({'op': 'logs', 'id': 'a-1', 'offset': 0})
    {'op': 'logs', 'id': 'a-1', 'offset': 0, 'cli': False}
    >>> check_request({'op': 'cancel', 'id': '../x'})
    Traceback (most recent call last):
    ...
    dasktrain.jobs.protocol.ProtocolError: not a job id: '../x'
    """
    op = message.get('op')
    if op not in OPS:
        _fail(f'op must be one of {", ".join(OPS)}')
    allowed = _SUBMIT.get(message.get('kind'), _COMMON) \
        if op == 'submit' else _FIELDS[op]
    extra = set(message) - {'op', 'cli', *allowed}
    if extra:
        _fail(f'{op} takes no {sorted(extra)[0]}')
    checked = {'op': op}
    if 'id' in allowed:
        checked['id'] = job_id(message.get('id'))
    if op == 'logs':
        offset = message.get('offset', 0)
        if not (type(offset) is int and offset >= 0):
            _fail('offset must be an int >= 0')
        checked['offset'] = offset
    if op == 'submit':
        checked.update(check_submit(message))
    checked['cli'] = _flag(message.get('cli', False), 'cli')
    return checked


def check_submit(message):
    """The fields of a submit request, checked (see
    :func:`check_request`)."""
    kind = message.get('kind')
    if kind not in KINDS:
        _fail(f'kind must be one of {", ".join(KINDS)}')
    gpus = message.get('gpus')
    if type(gpus) is not int or not 0 <= gpus <= 4096:
        _fail('gpus must be an int >= 0')
    after = message.get('after') or []
    if not isinstance(after, list) or len(after) > 1000:
        _fail('after must be a list of job ids')
    found = {'kind': kind, 'gpus': gpus,
             'name': _text(message.get('name'), 'name', 200, True),
             'notify': _text(message.get('notify'), 'notify', 4096, True),
             'after': [job_id(a) for a in after],
             'after_any': _flag(message.get('after_any', False), 'after_any'),
             'time': _seconds(message.get('time'), 'time'),
             'time_limit': _seconds(message.get('time_limit'), 'time_limit')}
    if kind == 'train':
        if not isinstance(message.get('config'), dict):
            _fail('config must be a JSON object (a TrainConfig)')
        found['config'] = message['config']
        found['files'] = _files(message.get('files') or {})
        return found
    command = message.get('command')
    if not isinstance(command, list) or not command or len(command) > 65536:
        _fail('command must be a non-empty list of strings')
    env = message.get('env')
    if not isinstance(env, dict) or len(env) > 65536:
        _fail('env must be a JSON object of strings')
    for key, value in env.items():
        if not _ENV.fullmatch(key):
            _fail(f'env: not a variable name: {key!r}'[:200])
        _text(value, f'env {key}', MAX_REQUEST)
    cwd = _text(message.get('cwd'), 'cwd')
    if not cwd.startswith('/'):
        _fail('cwd must be an absolute path')
    found.update(command=[_text(a, 'command', MAX_REQUEST) for a in command],
                 cwd=cwd, env=dict(env),
                 grace=_seconds(message.get('grace', 30.0), 'grace',
                                optional=False, zero=True),
                 requeue=_flag(message.get('requeue', False), 'requeue'))
    return found


def _files(files):
    """``{'model' | 'dataset': {'name': 'x.py', 'data': base64}}`` ->
    ``{key: (name, bytes)}``."""
    if not isinstance(files, dict) or set(files) - set(FILES):
        _fail(f'files takes {" and ".join(FILES)} only')
    decoded = {}
    for key, entry in files.items():
        if not isinstance(entry, dict) or set(entry) != {'name', 'data'} or \
                not isinstance(entry['name'], str) or \
                not _FILE.fullmatch(entry['name']) or \
                not isinstance(entry['data'], str):
            _fail(f'files.{key} must be {{"name": "file.py", "data": '
                  'base64}')
        try:
            data = base64.b64decode(entry['data'], validate=True)
        except (binascii.Error, ValueError):
            _fail(f'files.{key}.data is not base64')
        decoded[key] = (entry['name'], data)
    return decoded


def pack_files(files):
    """``{key: (name, bytes)}`` as a request's ``files`` (the inverse of
    what :func:`check_request` decodes).

    >>> pack_files({'model': ('net.py', b'x = 1')})
    {'model': {'name': 'net.py', 'data': 'eCA9IDE='}}
    """
    return {key: {'name': name, 'data': base64.b64encode(data).decode()}
            for key, (name, data) in files.items()}
