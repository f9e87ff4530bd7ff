"""Which queue a client talks to: a cluster of your own (its job files
and its scheduler, as Dask's client) or a shared cluster (its socket; see
:mod:`dasktrain.cluster.shared`), decided in one place, in this order
(:func:`route`):

1. an explicit ``--scheduler`` / ``--jobs-dir`` (``scheduler=``,
   ``path=``, ``client=`` from Python): your own, as named;
2. ``$DASKTRAIN_QUEUE`` (the path of a shared queue's socket): that queue;
3. a cluster of your own recorded (``$DASKTRAIN_HOME/cluster.json``,
   default ``~/.dasktrain``): yours;
4. a shared cluster's public record (``$DASKTRAIN_SHARED_DIR``, default
   ``/var/lib/dasktrain``): its socket;
5. else your own, which says that no cluster is recorded.

:func:`find` and :func:`rows` are what commands ask, wherever the queue
is.
"""
import os

from dasktrain.cluster.local import state_path
from dasktrain.cluster.shared import read_record
from dasktrain.jobs.client.socket_client import SocketClient
from dasktrain.jobs.job import Job
from dasktrain.jobs.status import PER_PAGE, job_rows, shown

QUEUE_ENV = 'DASKTRAIN_QUEUE'


def route(explicit, env, own, shared):
    """The socket of the shared queue a client uses, or None for a cluster
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


def shared_queue(scheduler=None, jobs_dir=None, env=None):
    """The :class:`~dasktrain.jobs.client.socket_client.SocketClient` of
    the shared cluster to use (see the module), or None for a cluster of
    your own."""
    env = os.environ if env is None else env
    explicit = scheduler is not None or jobs_dir is not None
    # Only the facts the order needs: no file read past the first that
    # decides.
    own = not explicit and not env.get(QUEUE_ENV) and state_path().exists()
    record = None if explicit or own or env.get(QUEUE_ENV) else \
        read_record(env=env)
    path = route(explicit, env, own, record and record['socket'])
    return SocketClient(path, record) if path else None


def find(job_id, jobs_dir=None):
    """The job ``job_id`` wherever the queue is (:func:`shared_queue`);
    JobError if there is none."""
    door = shared_queue(None, jobs_dir)
    return door.job(job_id) if door is not None else \
        Job.find(job_id, jobs_dir)


def rows(jobs_dir=None, ask=None, everything=False, user=None, page=1,
         per_page=PER_PAGE):
    """The jobs table's ``(rows, unreadable, counts)`` wherever the queue
    is, as :func:`~dasktrain.jobs.status.shown` cuts it (``everything``:
    every job kept, not only live and recent ones; ``user``'s only;
    ``page`` of ``per_page``): the shared cluster's, or
    :func:`~dasktrain.jobs.status.job_rows` of the jobs dir with ``ask``
    (a scheduler's answer)."""
    door = shared_queue(None, jobs_dir)
    if door is not None:
        return door.rows(everything, user, page, per_page)
    return shown(*job_rows(jobs_dir, ask), everything, user, page, per_page)
