"""A shared cluster's socket server: the Unix socket
(``SHARED_DIR/queue.sock``, 0666) through which every local user submits,
lists, reads, cancels and requeues jobs, served by the scheduler process
(as root, installed by :mod:`~dasktrain.jobs.scheduler.preload` where
``cluster start --shared`` asked for it). Users never reach Dask itself.

Each connection carries one request and one answer
(:mod:`~dasktrain.jobs.wire`: checked field by field, at most 4 MiB,
a request not sent within :data:`READ_TIMEOUT` seconds is dropped). Who
asks is the kernel's ``SO_PEERCRED`` of the connection, never a field:
a submitted job is the asker's (their uid, primary gid and name from the
password database, :func:`dasktrain.jobs.folder.submitter`), and only
its submitter, root or the cluster's owner (who ran ``sudo dasktrain
cluster start --shared``) may cancel or requeue it, or read its logs and
results; everyone sees the jobs table, a job's state and ``dasktrain
gpus``. Everything a user sends that names a file was read by their own
client: root opens no path a request names.

The answers are built on the scheduler's loop, in process: the queue's
:class:`~dasktrain.jobs.scheduler.dispatch.Dispatcher` takes a new job at
once, the jobs table asks it directly.
"""
import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import struct
import time

from distributed.diagnostics.plugin import SchedulerPlugin

from dasktrain.cluster.shared import layout
from dasktrain.errors import Error, flag_names
from dasktrain.jobs.folder import create, submitter
from dasktrain.jobs.job import (
    DONE,
    EVENTS,
    Job,
    JobError,
    update_status,
    user_name,
)
from dasktrain.jobs.scheduler.dispatch import answer, installed
from dasktrain.jobs.scheduler.recovery import reset
from dasktrain.jobs.status import job_rows, running_jobs
from dasktrain.jobs.wire import (
    LOG_CHUNK,
    MAX_REQUEST,
    NO_WORKERS,
    ProtocolError,
    check_request,
    decode,
    encode,
    may_act,
    peer_credentials,
    refusal,
)

logger = logging.getLogger(__name__)

NAME = 'dasktrain-socket-server'
READ_TIMEOUT = 10.0  # seconds a client has to send its request
WRITE_TIMEOUT = 30.0  # seconds a client has to take its answer
_CRED = struct.calcsize('3i')


class SocketServer(SchedulerPlugin):
    """The socket server of the shared place ``root`` on the scheduler it
    is added to (see the module). ``owner``: the uid of who started the
    cluster with sudo (None: root alone); ``gpu_use``:
    ``gpu_use(scheduler)`` -> what ``dasktrain gpus`` shows
    (:func:`~dasktrain.jobs.scheduler.outside_use.cluster_use`)."""
    name = NAME

    def __init__(self, root, owner=None, gpu_use=None):
        self.where = layout(root)
        self.owners = {0} | ({owner} if owner is not None else set())
        self.gpu_use = gpu_use
        self.scheduler = self.server = None

    async def start(self, scheduler):
        self.scheduler = scheduler
        path = str(self.where.socket)
        if os.path.lexists(path):  # a crashed scheduler's; root's place
            os.unlink(path)
        self.server = await asyncio.start_unix_server(
            self.handle, path=path, limit=MAX_REQUEST + 1)
        os.chmod(path, 0o666)  # every local user may knock
        logger.info('dasktrain shared queue: %s', path)

    async def close(self):
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5)
        with contextlib.suppress(OSError):
            os.unlink(self.where.socket)

    async def handle(self, reader, writer):
        """One connection: its request, its answer, closed."""
        try:
            try:
                raw = writer.get_extra_info('socket').getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED)
                peer = peer_credentials(raw)
                message = decode(await self.read(reader))
                # The CLI's user is told of flags (--gpus), not arguments.
                with flag_names() if message.get('cli') is True else \
                        contextlib.nullcontext():
                    reply = dict(self.serve(peer, check_request(message)),
                                 ok=True)
            except Error as e:  # the asker's mistake, or a refusal
                reply = {'ok': False, 'error': str(e)}
            except Exception:  # ours: logged, and one line for the asker
                logger.exception('dasktrain shared queue: a request failed')
                reply = {'ok': False, 'error': 'the shared queue failed on '
                                               "this request; see its "
                                               "scheduler's log"}
            writer.write(encode(reply))
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
        except Exception:  # the asker went away: nothing to tell
            pass
        finally:
            writer.close()

    @staticmethod
    async def read(reader):
        """The request's line; ProtocolError if it does not come within
        :data:`READ_TIMEOUT` or is over the limit."""
        try:
            return await asyncio.wait_for(reader.readline(), READ_TIMEOUT)
        except asyncio.TimeoutError:
            raise ProtocolError(f'no request within {READ_TIMEOUT:g} s'
                                ) from None
        except (ValueError, asyncio.LimitOverrunError):  # over `limit`
            raise ProtocolError(f'a request is at most '
                                f'{MAX_REQUEST // 2 ** 20} MiB') from None

    def serve(self, peer, request):
        """The answer to one checked ``request`` of ``peer`` (a dict)."""
        op = request['op']
        if op in ('ping', 'cluster', 'jobs', 'gpus', 'submit'):
            return getattr(self, f'op_{op}')(peer, request)
        job = self.job(request['id'])
        return getattr(self, f'op_{op}')(peer, request, job)

    # ------------------------------------------------------ the operations

    def op_ping(self, peer, request):
        return {'you': user_name(peer.uid)}

    def op_cluster(self, peer, request):
        workers = {address: {'name': ws.name, 'resources':
                             dict(ws.resources), 'threads': ws.nthreads}
                   for address, ws in list(self.scheduler.workers.items())}
        try:
            dashboard = json.loads(self.where.record.read_text())['dashboard']
        except (OSError, ValueError, KeyError):
            dashboard = None
        return {'scheduler': self.scheduler.address, 'dashboard': dashboard,
                'workers': workers, 'you': user_name(peer.uid),
                'owners': [user_name(u) for u in sorted(self.owners)]}

    def op_submit(self, peer, request):
        who = submitter(peer.uid)
        asked = request['request']
        if asked.workers is not None:
            raise JobError(NO_WORKERS)
        asked.check_fits({a: dict(ws.resources) for a, ws in
                          list(self.scheduler.workers.items())})
        asked.check_after(self.where.jobs)
        job_id, folder, _ = create(self.where.jobs, asked, who,
                                   self.scheduler.address)
        job = Job(job_id, folder)
        try:
            installed(self.scheduler).enqueue(str(folder))
        except BaseException:  # not queued: nothing is left behind
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self.announce(job)
        logger.info('dasktrain shared queue: %s queued %s', who.user, job_id)
        return {'id': job_id, 'folder': str(folder)}

    def op_jobs(self, peer, request):
        rows, unreadable = job_rows(self.where.jobs, self.ask)
        return {'rows': rows, 'unreadable': unreadable}

    def op_gpus(self, peer, request):
        if self.gpu_use is None:
            raise JobError('this scheduler reads no GPU use (no '
                           'dasktrain.jobs.scheduler.preload)')
        seen = self.gpu_use(self.scheduler)
        return {'seen': seen, 'running': running_jobs(
            self.where.jobs, self.scheduler.address, seen['jobs'])}

    def op_status(self, peer, request, job):
        status = job.status()
        lost = None if status['state'] in DONE else job.lost_reason(self.ask)
        return {'folder': str(job.folder), 'status': status, 'lost': lost}

    def op_result(self, peer, request, job):
        self.check(peer, job, 'read')
        return {'spec': job.spec(), 'rows': job.log_rows(),
                'status': job.status()}

    def op_logs(self, peer, request, job):
        self.check(peer, job, 'read')
        text, offset = job.read_log(request['offset'], LOG_CHUNK)
        return {'text': text, 'offset': offset}

    def op_cancel(self, peer, request, job):
        self.check(peer, job, 'cancel')
        status = job.status()
        if status['state'] in DONE:
            return {'state': status['state']}
        (job.folder / 'cancel').touch()  # the worker stops it on this
        if status['state'] == 'queued':
            update_status(job.folder, state='cancelled', ended=time.time())
            self.announce(job)
        if job.key in self.scheduler.tasks:  # handed to Dask: dropped there
            try:
                self.scheduler.stimulus_cancel(
                    [job.key], 'fire-and-forget', force=True,
                    reason='dasktrain cancel', msg='')
            except Exception:  # the flag file stops it all the same
                logger.exception('dasktrain shared queue: cancelling %s',
                                 job.id)
        logger.info('dasktrain shared queue: %s cancelled %s',
                    user_name(peer.uid), job.id)
        return {'state': job.status()['state']}

    def op_requeue(self, peer, request, job):
        self.check(peer, job, 'requeue')
        state = job.status()['state']
        if state in ('queued', 'running') and not job.lost_reason(self.ask):
            raise JobError(f'job {job.id} is {state} on its scheduler '
                           f'({self.scheduler.address}); nothing to requeue')
        reset(job, self.scheduler.address)
        self.announce(job)
        installed(self.scheduler).enqueue(str(job.folder))
        return {'scheduler': self.scheduler.address}

    # ------------------------------------------------------------- helpers

    def job(self, job_id):
        folder = self.where.jobs / job_id
        if not (folder / 'job.json').exists():
            raise JobError(f'no job {job_id!r} in the shared queue; '
                           '`dasktrain jobs` lists them')
        return Job(job_id, folder)

    def check(self, peer, job, verb):
        """JobError in one line unless ``peer`` may ``verb`` ``job``."""
        spec = job.spec()
        if not may_act(peer.uid, spec.get('uid'), self.owners):
            raise JobError(refusal(job.id, spec.get('user', '?'), [
                user_name(u) for u in sorted(self.owners)], verb))

    def ask(self, keys, address=None):
        """What this scheduler knows of job ``keys`` (as
        :func:`~dasktrain.jobs.scheduler.query.ask_scheduler`, in process:
        a job it does not hold, one of a scheduler before it too, is
        lost)."""
        return answer(self.scheduler, keys)

    def announce(self, job):
        try:  # for the job board and the jobs page
            self.scheduler.log_event(EVENTS, job.summary())
        except Exception:  # monitoring never stops the queue
            pass
