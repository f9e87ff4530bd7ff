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
cluster start --shared``) may cancel or requeue it, or read its logs,
results, progress and error; everyone sees every job's id, name, user,
state, GPUs and times (:data:`~dasktrain.jobs.status.PUBLIC`: the jobs
table, a job's state, ``dasktrain gpus``). Everything a user sends that
names a file was read by their own client: root opens no path a request
names.

No user can use it up for others: each may hold :data:`PER_USER`
connections at once (all users :data:`CONNECTIONS`; one over is
answered with one line and closed as it is accepted, before anything is
made for it, from a backlog of :data:`BACKLOG`: a user who opens
thousands as fast as they can fills neither), and may have at most the
cluster's ``--max-queued-per-user`` jobs queued or running and
``--max-bytes-per-user`` of job files kept
(:mod:`dasktrain.cluster.settings`); a job's grace may not exceed
``--max-grace``, its ``--mem`` needs a cluster that caps memory, its
``--notify`` a target the cluster allows (a literal address here; the
name's addresses when it is sent).

The answers are built on the scheduler's loop, in process, from what is
in memory: the queue's :class:`~dasktrain.jobs.scheduler.dispatch.
Dispatcher` takes a new job at once; the jobs table is the job board's
(read from the job files again at most every
:data:`~dasktrain.jobs.scheduler.board.FRESH` seconds, in a thread),
cut into pages, its rows kept :data:`ROWS_FRESH` seconds: a thousand
jobs cost an asker nothing more than ten. What reads a job's own files
(its status with progress, result, logs) reads them in a thread.
"""
import asyncio
import collections
import contextlib
import inspect
import ipaddress
import json
import logging
import os
import shutil
import socket
import struct
import time
from urllib.parse import urlsplit

from distributed.diagnostics.plugin import SchedulerPlugin

from dasktrain.cluster.settings import (
    max_bytes,
    max_grace,
    max_queued,
    rules,
)
from dasktrain.cluster.shared import layout
from dasktrain.containment import Containment
from dasktrain.errors import Error, argument, flag_names, plural
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
from dasktrain.jobs.scheduler.outside_use import BOARD
from dasktrain.jobs.scheduler.recovery import reset
from dasktrain.jobs.status import (
    public_row,
    running_jobs,
    shown,
    summary_rows,
)
from dasktrain.jobs.wire import (
    LOG_CHUNK,
    MAX_REQUEST,
    ProtocolError,
    check_request,
    decode,
    encode,
    may_act,
    peer_credentials,
    refusal,
)
from dasktrain.jobs.worker.gpu_use import UNUSABLE_METRIC
from dasktrain.notify import refusal as notify_refusal
from dasktrain.notify import rules_of

logger = logging.getLogger(__name__)

NAME = 'dasktrain-socket-server'
READ_TIMEOUT = 10.0  # seconds a client has to send its request
WRITE_TIMEOUT = 30.0  # seconds a client has to take its answer
PER_USER = 16  # connections one user may hold open at once
CONNECTIONS = 1024  # connections open at once, all users
BACKLOG = 4096  # connections waiting to be accepted (somaxconn caps it)
ACCEPTS = 256  # connections taken from the backlog at one look
ROWS_FRESH = 1.0  # s: the jobs table's rows are built again at most this often
_CRED = struct.calcsize('3i')
# What anyone may see of a job's status (the rest: its owner's).
PUBLIC_STATUS = ('state', 'ending', 'gpus', 'worker', 'started', 'ended',
                 'attempts')
PUBLIC_SUMMARY = ('id', 'name', 'user', 'state', 'gpus', 'workers', 'held',
                  'worker', 'started', 'ended', 'submitted')


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
        self.serving = set()  # the tasks serving a connection now
        self.open = collections.Counter()  # {uid: connections open}
        self.rows = (-1.0, [], [])  # (when, rows, unreadable): the table
        self.sizes = {}  # {job id: bytes of root's files for it}

    async def start(self, scheduler):
        self.scheduler = scheduler
        path = str(self.where.socket)
        if os.path.lexists(path):  # a crashed scheduler's; root's place
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        os.chmod(path, 0o666)  # every local user may knock
        listener.listen(BACKLOG)
        listener.setblocking(False)
        self.server = listener
        asyncio.get_running_loop().add_reader(listener.fileno(),
                                              self.accept)
        logger.info('dasktrain shared queue: %s', path)

    async def close(self):
        if self.server is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(
                    self.server.fileno())
            self.server.close()
            self.server = None
        with contextlib.suppress(OSError):
            os.unlink(self.where.socket)

    def accept(self):
        """Take what waits in the listen backlog, up to :data:`ACCEPTS`
        at a time: a connection over its user's (or everyone's) limit is
        answered its one line and closed here, before anything is made
        for it (no stream, no task: a flood of them costs the loop little
        and leaves the backlog free for others); the others are served
        (:meth:`handle`)."""
        for _ in range(ACCEPTS):
            try:
                connection, _ = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors: said, later
                logger.warning('dasktrain shared queue: accept: %s', e)
                return
            try:
                peer = peer_credentials(connection.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED))
            except Exception:  # no one to answer
                connection.close()
                continue
            crowded = self.crowded(peer)
            if crowded:  # a line fits the socket's buffer: never blocks
                with contextlib.suppress(OSError):
                    connection.setblocking(False)
                    connection.send(encode({'ok': False, 'error': crowded}))
                connection.close()
                continue
            self.open[peer.uid] += 1
            task = asyncio.ensure_future(self.handle(connection, peer))
            self.serving.add(task)  # held until done: never collected
            task.add_done_callback(self.serving.discard)

    def crowded(self, peer):
        """Why ``peer`` may not open one more connection, or None."""
        if self.open[peer.uid] >= PER_USER:
            return (f'you have {self.open[peer.uid]} connections open to '
                    f'the shared queue (at most {PER_USER} per user); let '
                    'them finish, then ask again')
        if sum(self.open.values()) >= CONNECTIONS:
            return ('the shared queue has too many connections open; ask '
                    'again in a moment')
        return None

    async def handle(self, connection, peer):
        """One connection of ``peer`` (counted in :attr:`open` by
        :meth:`accept`): its request, its answer, closed."""
        writer = None
        try:
            reader, writer = await asyncio.open_unix_connection(
                sock=connection, limit=MAX_REQUEST + 1)
            try:
                message = decode(await self.read(reader))
                reply = dict(await self.serve(peer, message), ok=True)
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
            self.open[peer.uid] -= 1
            if self.open[peer.uid] <= 0:
                del self.open[peer.uid]
            if writer is not None:
                writer.close()
            else:
                connection.close()

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

    async def serve(self, peer, message):
        """The answer to one request ``message`` of ``peer`` (a dict),
        checked first. What an operation says of an argument names the
        flag where the asker is the CLI (its synchronous part: the
        setting is the process's)."""
        with flag_names() if message.get('cli') is True else \
                contextlib.nullcontext():
            request = check_request(message)
            op = request['op']
            if op in ('ping', 'cluster', 'jobs', 'gpus', 'submit'):
                answer = getattr(self, f'op_{op}')(peer, request)
            else:
                job = self.job(request['id'])
                answer = getattr(self, f'op_{op}')(peer, request, job)
        return await answer if inspect.isawaitable(answer) else answer

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
        contain = Containment.of_env()
        return {'scheduler': self.scheduler.address, 'dashboard': dashboard,
                'workers': workers, 'you': user_name(peer.uid),
                'owners': [user_name(u) for u in sorted(self.owners)],
                'contain': contain.words() if contain else None,
                'rules': rules() + [f'per user: at most {PER_USER} '
                                    "connections to the queue's socket"]}

    def op_submit(self, peer, request):
        who = submitter(peer.uid)
        asked = request['request']
        self.check_limits(peer, asked)
        workers = list(self.scheduler.workers.items())
        asked.check_fits({a: dict(ws.resources) for a, ws in workers},
                         {a: (ws.metrics or {}).get(UNUSABLE_METRIC)
                          for a, ws in workers})
        asked.check_after(self.where.jobs)
        job_id, folder, _ = create(self.where.jobs, asked, who,
                                   self.scheduler.address)
        job = Job(job_id, folder)
        try:
            installed(self.scheduler).enqueue(str(folder))
        except BaseException:  # not queued: nothing is left behind
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self.sizes[job_id] = _stored(folder)
        self.announce(job)
        logger.info('dasktrain shared queue: %s queued %s', who.user, job_id)
        return {'id': job_id, 'folder': str(folder)}

    def check_limits(self, peer, asked):
        """JobError in one line where ``asked`` (a submit of ``peer``) is
        over one of the cluster's limits."""
        grace = getattr(asked.program, 'grace', None)
        if grace is not None and grace > max_grace():
            raise JobError(f'{argument("grace")} {grace:g}: this cluster '
                           f'stops a job within {max_grace():g} s of its '
                           'SIGTERM (cluster start --max-grace)')
        contain = Containment.of_env()
        problem = contain.limit_problem(mem=asked.mem) if contain else \
            None if asked.mem is None else \
            "this cluster cannot cap a job's memory"
        if problem:
            raise JobError(f'{argument("mem")}: {problem}')
        if asked.notify and not asked.notify.startswith('mailto:'):
            host = urlsplit(asked.notify).hostname or ''
            literal = ['127.0.0.1'] if host == 'localhost' else None
            try:  # a name is resolved when it is sent, not here
                literal = literal or [str(ipaddress.ip_address(host))]
            except ValueError:
                pass
            why = literal and notify_refusal(asked.notify, rules_of(),
                                             literal)
            if why:
                raise JobError(why)
        elif asked.notify:
            why = notify_refusal(asked.notify, rules_of())
            if why:
                raise JobError(why)
        board = self.board()
        mine = [j for j in (board.jobs.values() if board else ())
                if j.get('uid') == peer.uid]
        limit = max_queued()
        live = sum(j['state'] in ('queued', 'running') for j in mine)
        if limit is not None and live >= limit:
            raise JobError(f'you have {plural(live, "job")} queued or '
                           'running, the '
                           f'most this cluster takes from one user '
                           '(cluster start --max-queued-per-user); submit '
                           'more once some have ended')
        limit = max_bytes()
        if limit is not None:
            kept = sum(self.stored(j['id']) for j in mine)
            if kept + len(encode(asked.wire())) > limit:
                raise JobError(
                    f'your jobs\' files take {kept / 2 ** 20:.1f} MiB of the '
                    f'queue\'s own disk, the most it keeps for one user is '
                    f'{limit / 2 ** 20:g} MiB (cluster start '
                    '--max-bytes-per-user): smaller environments and '
                    'commands, or wait until ended jobs are purged')

    def stored(self, job_id):
        """Bytes of root's files for the job ``job_id`` (cached)."""
        if job_id not in self.sizes:
            self.sizes[job_id] = _stored(self.where.jobs / job_id)
        return self.sizes[job_id]

    async def op_jobs(self, peer, request):
        when, rows, unreadable = self.rows
        if time.monotonic() - when > ROWS_FRESH:
            board = self.board()
            summaries = await board.fresh() if board else []
            live = ['dasktrain-job-' + s['id'] for s in summaries
                    if s['state'] not in DONE]
            rows, unreadable = summary_rows(summaries, self.ask(live))
            self.rows = (time.monotonic(), rows, unreadable)
        user = request.get('user')
        page, hidden, counts = shown(
            rows, unreadable, request.get('all', False), user,
            request.get('page', 1), request.get('per_page') or 100)
        owner = peer.uid in self.owners
        page = [{k: v for k, v in (
            r if owner or r.get('uid') == peer.uid else public_row(r)
        ).items() if k != 'uid'} for r in page]
        hidden = [(i, why if owner else f'job {i}: its files cannot be '
                   "read; the cluster's owner can see why")
                  for i, why in hidden]
        return {'rows': page, 'unreadable': hidden, 'counts': counts}

    def op_gpus(self, peer, request):
        if self.gpu_use is None:
            raise JobError('this scheduler reads no GPU use (no '
                           'dasktrain.jobs.scheduler.preload)')
        seen = self.gpu_use(self.scheduler)
        running = running_jobs(self.where.jobs, self.scheduler.address,
                               seen['jobs'])
        if peer.uid not in self.owners:
            running = [j if j.get('uid') == peer.uid else
                       {k: j.get(k) for k in PUBLIC_SUMMARY}
                       for j in running]
        return {'seen': seen, 'running': running}

    async def op_status(self, peer, request, job):
        mine = self.may(peer, job)
        try:
            status = await asyncio.to_thread(job.status if mine else
                                             job.recorded)
            lost = None if status['state'] in DONE else \
                job.lost_reason(self.ask)
        except JobError as e:  # damaged: one state, why to its owners
            status, lost = {'state': 'unreadable', 'error': str(e)}, None
        if not mine:
            status = {k: status.get(k) for k in PUBLIC_STATUS}
        return {'folder': str(job.folder), 'status': status, 'lost': lost}

    async def op_result(self, peer, request, job):
        self.check(peer, job, 'read')

        def read():
            return {'spec': job.spec().data, 'rows': job.log_rows(),
                    'status': job.status()}
        return await asyncio.to_thread(read)

    async def op_logs(self, peer, request, job):
        self.check(peer, job, 'read')
        text, offset = await asyncio.to_thread(
            job.read_log, request['offset'], LOG_CHUNK)
        return {'text': text, 'offset': offset}

    def op_cancel(self, peer, request, job):
        self.check(peer, job, 'cancel')
        try:
            state = job.recorded()['state']
        except JobError:  # damaged: its owners may still stop it
            state = 'unreadable'
        if state in DONE:
            return {'state': state}
        (job.folder / 'cancel').touch()  # the worker stops it on this
        if state in ('queued', 'unreadable') and \
                job.key not in self.scheduler.tasks:
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
        return {'state': job.recorded()['state']}

    def op_requeue(self, peer, request, job):
        self.check(peer, job, 'requeue')
        state = job.recorded()['state']
        if state in ('queued', 'running') and not job.lost_reason(self.ask):
            raise JobError(f'job {job.id} is {state} on its scheduler '
                           f'({self.scheduler.address}); nothing to requeue')
        reset(job, self.scheduler.address)
        self.announce(job)
        installed(self.scheduler).enqueue(str(job.folder))
        return {'scheduler': self.scheduler.address}

    # ------------------------------------------------------------- helpers

    def board(self):
        """The scheduler's job board, if it has one."""
        return self.scheduler.plugins.get(BOARD)

    def job(self, job_id):
        folder = self.where.jobs / job_id
        if not (folder / 'job.json').exists() and \
                not (folder / 'job.json').is_symlink():
            raise JobError(f'no job {job_id!r} in the shared queue; '
                           '`dasktrain jobs` lists them')
        return Job(job_id, folder)

    def may(self, peer, job):
        """Whether ``peer`` may act on ``job`` and read what is its (its
        submitter, the cluster's owners; a job whose files cannot be read:
        its owners alone)."""
        return may_act(peer.uid, job.owner(), self.owners)

    def check(self, peer, job, verb):
        """JobError in one line unless ``peer`` may ``verb`` ``job``."""
        if not self.may(peer, job):
            try:
                user = job.spec().user or '?'
            except JobError:
                user = 'nobody known (its files cannot be read)'
            raise JobError(refusal(job.id, user, [
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


def _stored(folder):
    """Bytes of the files root keeps for a job in ``folder`` (its request,
    status and environment); 0 where they are gone."""
    total = 0
    for name in ('job.json', 'status.json', 'env.json'):
        try:
            total += os.lstat(os.path.join(folder, name)).st_size
        except OSError:
            pass
    return total
