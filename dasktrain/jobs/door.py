"""Which queue a client talks to, and the client of a shared cluster's
front door.

:func:`front_door` is the one place that decides between a cluster of
your own (its job files and its scheduler, as Dask's client) and a
shared cluster (its front door's Unix socket; see
:mod:`dasktrain.cluster.shared`), in this order (:func:`route`):

1. an explicit ``--scheduler`` / ``--jobs-dir`` (``scheduler=``,
   ``path=``, ``client=`` from Python): your own, as named;
2. ``$DASKTRAIN_QUEUE`` (the path of a front door's socket): that queue;
3. a cluster of your own recorded (``$DASKTRAIN_HOME/cluster.json``,
   default ``~/.dasktrain``): yours;
4. a shared cluster's public record (``$DASKTRAIN_SHARED_DIR``, default
   ``/var/lib/dasktrain``): its front door;
5. else your own, which says that no cluster is recorded.

:class:`FrontDoor` asks the socket (one request per connection, see
:mod:`~dasktrain.jobs.protocol`); :class:`DoorJob` is the
:class:`~dasktrain.jobs.records.Job` it returns: the same methods
(``status``, ``result``, ``logs``, ``cancel``), asked of the front door
instead of read from files a user cannot read. :func:`find` and
:func:`rows` are what commands ask, wherever the queue is.

Owns the choice and the client side of the socket; serving it is
:mod:`~dasktrain.jobs.frontdoor`'s.
"""
import dataclasses
import os
import socket
from pathlib import Path

from dasktrain.cluster.local import ClusterError, state_path
from dasktrain.cluster.shared import read_record
from dasktrain.errors import naming_flags
from dasktrain.jobs.asking import job_rows
from dasktrain.jobs.protocol import (
    MAX_REQUEST,
    MAX_RESPONSE,
    ProtocolError,
    decode,
    encode,
    pack_files,
)
from dasktrain.jobs.records import Job, JobError

QUEUE_ENV = 'DASKTRAIN_QUEUE'
TIMEOUT = 60.0  # seconds a front door may take to answer


def route(explicit, env, own, shared):
    """The socket of the front door a client uses, or None for a cluster
    of its own: ``explicit`` (a scheduler or jobs dir named), ``env``
    (its environment), ``own`` (a cluster of its own is recorded),
    ``shared`` (the socket a shared cluster's record names, or None).

    >>> route(False, {}, False, '/var/lib/dasktrain/queue.sock')
    '/var/lib/dasktrain/queue.sock'
    >>> route(False, {}, True, '/var/lib/dasktrain/queue.sock') is None
    True
    >>> route(False, {'DASKTRAIN_QUEUE': '/q.sock'}, True, None)
    '/q.sock'
    >>> route(True, {'DASKTRAIN_QUEUE': '/q.sock'}, False, '/x') is None
    True
    """
    if explicit:
        return None
    if env.get(QUEUE_ENV):
        return env[QUEUE_ENV]
    if own:
        return None
    return shared


def front_door(scheduler=None, jobs_dir=None, env=None):
    """The :class:`FrontDoor` to use (see the module), or None for a
    cluster of your own."""
    env = os.environ if env is None else env
    explicit = scheduler is not None or jobs_dir is not None
    # Only the facts the order needs: no file read past the first that
    # decides.
    own = not explicit and not env.get(QUEUE_ENV) and state_path().exists()
    record = None if explicit or own or env.get(QUEUE_ENV) else \
        read_record(env=env)
    path = route(explicit, env, own, record and record['socket'])
    return FrontDoor(path, record) if path else None


class FrontDoor:
    """A shared cluster's front door at the socket ``path``; ``record``:
    its public record, if known (addresses, owner, for display)."""

    def __init__(self, path, record=None, timeout=TIMEOUT):
        self.path, self.record, self.timeout = Path(path), record, timeout

    def ask(self, op, **fields):
        """The answer to one request (a dict); JobError with the front
        door's one line when it refuses, ClusterError when it is not
        there or does not answer."""
        request = {'op': op, **fields, 'cli': naming_flags()}
        data = encode(request)
        if len(data) > MAX_REQUEST:
            raise JobError(f'the request is {len(data) / 2 ** 20:.1f} MiB; '
                           'the shared queue takes at most '
                           f'{MAX_REQUEST // 2 ** 20} MiB (keep large files '
                           'where the job can read them)')
        where = f'the shared queue at {self.path}'
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(self.timeout)
                s.connect(str(self.path))
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                chunks, size = [], 0
                while chunk := s.recv(1 << 16):
                    size += len(chunk)
                    if size > MAX_RESPONSE:
                        raise JobError(f'{where} answered more than '
                                       f'{MAX_RESPONSE // 2 ** 20} MiB')
                    chunks.append(chunk)
        except TimeoutError:
            raise ClusterError(f'{where} did not answer within '
                               f'{self.timeout:g} s') from None
        except (FileNotFoundError, ConnectionRefusedError) as e:
            what = 'is not there' if isinstance(e, FileNotFoundError) else \
                'is not answering'
            raise ClusterError(
                f'{where} {what} ({e.strerror}); is the shared cluster '
                'running? (`sudo dasktrain cluster start --shared` starts '
                'it)') from None
        except OSError as e:
            raise ClusterError(f'cannot reach {where} ({e.strerror or e})'
                               ) from None
        try:
            answer = decode(b''.join(chunks), MAX_RESPONSE)
        except ProtocolError:
            raise ClusterError(f'{where} closed the connection without an '
                               'answer; see its scheduler\'s log') from None
        if answer.get('ok') is not True:
            raise JobError(str(answer.get('error') or f'{where} refused'))
        return answer

    def submit(self, request):
        """Queue the job ``request`` (what
        :func:`~dasktrain.jobs.submit.training_request` or
        :func:`~dasktrain.jobs.programs.command_request` made, with
        ``after``, ``after_any``); its :class:`DoorJob`."""
        fields = dict(request)
        if 'files' in fields:
            fields['files'] = pack_files(fields['files'])
        answer = self.ask('submit', **fields)
        return DoorJob(answer['id'], Path(answer['folder']), door=self)

    def job(self, job_id):
        """The job ``job_id``; JobError if the queue has none."""
        answer = self.ask('status', id=job_id)
        return DoorJob(job_id, Path(answer['folder']), door=self)

    def rows(self):
        """``(rows, unreadable)`` as :func:`~dasktrain.jobs.asking.job_rows`
        returns them, everyone's."""
        answer = self.ask('jobs')
        return answer['rows'], [tuple(u) for u in answer['unreadable']]

    def gpus(self):
        """``{'seen': ..., 'running': [...]}``: what ``dasktrain gpus``
        shows (:func:`dasktrain.gpuuse.cluster_use`, the running jobs)."""
        return self.ask('gpus')

    def cluster(self):
        """The scheduler's address, its dashboard, and its workers."""
        answer = self.ask('cluster')
        return {'scheduler': answer['scheduler'],
                'dashboard': answer.get('dashboard'),
                'workers': answer['workers'], 'owners': answer['owners'],
                'you': answer['you']}

    def requeue(self, job_id):
        """Hand the job ``job_id`` to the running cluster again; the
        scheduler's address."""
        return self.ask('requeue', id=job_id)['scheduler']


@dataclasses.dataclass
class DoorJob(Job):
    """A job of a shared cluster: what a :class:`Job` reads from its
    files, asked of the front door (which says who may read what)."""
    door: FrontDoor = None

    def spec(self):
        return self.door.ask('result', id=self.id)['spec']

    def status(self):
        return self.door.ask('status', id=self.id)['status']

    def owner(self):
        return None

    def log_rows(self):
        return self.door.ask('result', id=self.id)['rows']

    def read_log(self, offset=0, limit=None):
        answer = self.door.ask('logs', id=self.id, offset=offset)
        return answer['text'], answer['offset']

    def lost_reason(self, ask=None):
        return self.door.ask('status', id=self.id)['lost']

    def announce(self, client=None):
        pass  # the front door tells the scheduler itself

    def cancel(self, client=None):
        """Cancel the job (its submitter, root, or the cluster's owner
        only: JobError otherwise, in one line)."""
        self.door.ask('cancel', id=self.id)


def find(job_id, jobs_dir=None):
    """The job ``job_id`` wherever the queue is (:func:`front_door`);
    JobError if there is none."""
    door = front_door(None, jobs_dir)
    return door.job(job_id) if door is not None else \
        Job.find(job_id, jobs_dir)


def rows(jobs_dir=None, ask=None):
    """The jobs table's ``(rows, unreadable)`` wherever the queue is:
    the front door's, or :func:`~dasktrain.jobs.asking.job_rows` of the
    jobs dir with ``ask`` (a scheduler's answer)."""
    door = front_door(None, jobs_dir)
    return door.rows() if door is not None else job_rows(jobs_dir, ask)
