"""A shared cluster's socket, as lines: what a request may say, who is
asking, and who may act on a job; pure functions, for the server
(:mod:`~dasktrain.jobs.scheduler.socket_server`) and the client
(:mod:`~dasktrain.jobs.client.socket_client`) alike.

One connection carries one request and one response, each a line of
JSON (:func:`encode`): ``{"op": ..., fields}`` and ``{"ok": true, ...}``
or ``{"ok": false, "error": "one line"}``. A request is at most
:data:`MAX_REQUEST` bytes; :func:`check_request` checks every field of
every operation (a submit's are a :class:`~dasktrain.jobs.request.
JobRequest`'s) and refuses anything else in one line: nothing is
evaluated or unpickled. Who asks is never a field: it is the kernel's
word, the connection's ``SO_PEERCRED`` (:func:`peer_credentials`).

A job's submitter, root, and the user who started the cluster with sudo
may act on it (:func:`may_act`: cancel, requeue, read its logs and
results); anyone may see the jobs table and a job's state.
"""
import collections
import json
import struct

from dasktrain.jobs.fields import RequestError, job_id
from dasktrain.jobs.request import JobRequest

MAX_REQUEST = 4 * 1024 * 1024     # bytes of one request line
MAX_RESPONSE = 64 * 1024 * 1024   # bytes of one response (a client's cap)
LOG_CHUNK = 1024 * 1024           # bytes of output.log per `logs` answer
OPS = ('ping', 'cluster', 'submit', 'jobs', 'status', 'result', 'logs',
       'cancel', 'requeue', 'gpus')

Peer = collections.namedtuple('Peer', 'pid uid gid')
Peer.__doc__ = 'Who is at the other end of a Unix socket, as the kernel says.'


class ProtocolError(RequestError):
    """A request the socket's server refuses (one line)."""


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


def refusal(job, user, owner_names, verb='cancel'):
    """The one line a user who may not act on a job gets.

    >>> refusal('r20-1', 'ann', ['root', 'alice'])[26:]
    "only ann or the cluster's owner (root, alice) can cancel it"
    """
    return (f"job {job} belongs to {user}; only {user} or the cluster's "
            f"owner ({', '.join(owner_names)}) can {verb} it")


_FIELDS = {  # op -> the fields it takes beyond op (and `cli`)
    'ping': (), 'cluster': (), 'gpus': (),
    'jobs': ('all', 'user', 'page', 'per_page'),
    'status': ('id',), 'result': ('id',), 'cancel': ('id',),
    'requeue': ('id',), 'logs': ('id', 'offset'), 'submit': ('request',)}


def check_request(message):
    """The request ``message`` (a dict from :func:`decode`) with every
    field checked (a submit's as a :class:`~dasktrain.jobs.request.
    JobRequest`); ProtocolError naming the first field that is wrong, or
    the first one too many.

    >>> check_request({'op': 'logs', 'id': 'a-1', 'offset': 0})
    {'op': 'logs', 'id': 'a-1', 'offset': 0, 'cli': False}
    >>> check_request({'op': 'cancel', 'id': '../x'})
    Traceback (most recent call last):
    ...
    dasktrain.jobs.fields.RequestError: not a job id: '../x'
    """
    op = message.get('op')
    if op not in OPS:
        raise ProtocolError(f'op must be one of {", ".join(OPS)}')
    allowed = _FIELDS[op]
    extra = set(message) - {'op', 'cli', *allowed}
    if extra:
        raise ProtocolError(f'{op} takes no {sorted(extra)[0]}')
    checked = {'op': op}
    if 'id' in allowed:
        checked['id'] = job_id(message.get('id'))
    if op == 'jobs':
        if not isinstance(message.get('all', False), bool):
            raise ProtocolError('all must be true or false')
        user = message.get('user')
        if user is not None and not (isinstance(user, str) and
                                     0 < len(user) <= 256):
            raise ProtocolError('user must be a user name')
        for key, most in (('page', 10 ** 9), ('per_page', 1000)):
            value = message.get(key, 1)
            if not (type(value) is int and 1 <= value <= most):
                raise ProtocolError(f'{key} must be an int from 1 to '
                                    f'{most}')
        checked.update({k: message[k] for k in _FIELDS['jobs']
                        if k in message})
    if op == 'logs':
        offset = message.get('offset', 0)
        if not (type(offset) is int and offset >= 0):
            raise ProtocolError('offset must be an int >= 0')
        checked['offset'] = offset
    if op == 'submit':
        if not isinstance(message.get('request'), dict):
            raise ProtocolError('request must be a JSON object')
        checked['request'] = JobRequest.from_wire(message['request'])
    cli = message.get('cli', False)
    if not isinstance(cli, bool):
        raise ProtocolError('cli must be true or false')
    checked['cli'] = cli
    return checked
