"""The client of a shared cluster's socket (:class:`SocketClient`: one
request per connection, see :mod:`~dasktrain.jobs.wire`), and
:class:`SharedJob`, the :class:`~dasktrain.jobs.job.Job` it returns: the
same methods (``status``, ``result``, ``logs``, ``cancel``), asked of the
socket's server instead of read from files a user cannot read.
"""
import dataclasses
import socket
from pathlib import Path

from dasktrain.cluster.local import ClusterError
from dasktrain.errors import naming_flags
from dasktrain.jobs.job import Job, JobError
from dasktrain.jobs.record import JobRecord
from dasktrain.jobs.wire import (
    MAX_REQUEST,
    MAX_RESPONSE,
    ProtocolError,
    decode,
    encode,
)

TIMEOUT = 60.0  # seconds a shared cluster's socket may take to answer


def _connect(s, path, timeout):
    """Connect ``s`` to the Unix socket ``path``, trying again while its
    listen backlog is full (``EAGAIN``: someone floods it, or many ask at
    once), for ``timeout`` seconds at most, a few milliseconds apart with
    a random spread (the asker who tries again first gets in)."""
    import random
    import time
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        try:
            return s.connect(path)
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError from None
            time.sleep(pause * random.uniform(0.5, 1.5))
            pause = min(pause * 2, 0.05)


class SocketClient:
    """The client of a shared cluster's socket at ``path``; ``record``:
    its public record, if known (addresses, owner, for display)."""

    def __init__(self, path, record=None, timeout=TIMEOUT):
        self.path, self.record, self.timeout = Path(path), record, timeout

    def ask(self, op, **fields):
        """The answer to one request (a dict); JobError with the
        server's one line when it refuses, ClusterError when it is not
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
                _connect(s, str(self.path), self.timeout)
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
        """Queue the job ``request`` (a
        :class:`~dasktrain.jobs.request.JobRequest`); its
        :class:`SharedJob`."""
        answer = self.ask('submit', request=request.wire())
        return SharedJob(answer['id'], Path(answer['folder']), door=self)

    def job(self, job_id):
        """The job ``job_id``; JobError if the queue has none."""
        answer = self.ask('status', id=job_id)
        return SharedJob(job_id, Path(answer['folder']), door=self)

    def rows(self, everything=False, user=None, page=1, per_page=None):
        """``(rows, unreadable, counts)`` as
        :func:`~dasktrain.jobs.status.shown` returns them, everyone's
        (what others may not see of a job left out by the server)."""
        fields = {'all': bool(everything), 'page': page}
        if user is not None:
            fields['user'] = user
        if per_page is not None:
            fields['per_page'] = per_page
        answer = self.ask('jobs', **fields)
        return (answer['rows'], [tuple(u) for u in answer['unreadable']],
                answer.get('counts') or {})

    def gpus(self):
        """``{'seen': ..., 'running': [...]}``: what ``dasktrain gpus``
        shows (:func:`~dasktrain.jobs.scheduler.outside_use.cluster_use`,
        the running jobs)."""
        return self.ask('gpus')

    def cluster(self):
        """The scheduler's address, its dashboard, its workers, how its
        jobs are kept (``contain``, in words) and its rules (lines)."""
        answer = self.ask('cluster')
        return {'scheduler': answer['scheduler'],
                'dashboard': answer.get('dashboard'),
                'workers': answer['workers'], 'owners': answer['owners'],
                'you': answer['you'], 'contain': answer.get('contain'),
                'rules': list(answer.get('rules') or ())}

    def requeue(self, job_id):
        """Hand the job ``job_id`` to the running cluster again; the
        scheduler's address."""
        return self.ask('requeue', id=job_id)['scheduler']


@dataclasses.dataclass
class SharedJob(Job):
    """A job of a shared cluster: what a :class:`Job` reads from its
    files, asked of the socket (whose server says who may read what)."""
    door: SocketClient = None

    def spec(self):
        return JobRecord.of(self.door.ask('result', id=self.id)['spec'])

    def status(self):
        return self.door.ask('status', id=self.id)['status']

    def result(self, timeout=None, poll=0.5):
        """As :meth:`Job.result`, for its owners only: anyone else is
        told whose it is in one line, whatever state it is in."""
        self.spec()  # the server's check: its submitter or an owner
        return super().result(timeout, poll)

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
        pass  # the server tells the scheduler itself

    def cancel(self, client=None):
        """Cancel the job (its submitter, root, or the cluster's owner
        only: JobError otherwise, in one line); the state it has now."""
        return self.door.ask('cancel', id=self.id).get('state')
