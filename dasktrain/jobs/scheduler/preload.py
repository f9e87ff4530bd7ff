"""The scheduler's preload (``dask scheduler --preload
dasktrain.jobs.scheduler.preload``, what ``dasktrain cluster start``
runs): it installs the queue in the scheduler process.

* the :class:`~dasktrain.jobs.scheduler.board.JobBoard`, which keeps every
  job's latest summary (after reading the jobs dir once, for the jobs
  before it);
* the queue's :class:`~dasktrain.jobs.scheduler.dispatch.Dispatcher`
  (its jobs come back by :mod:`~dasktrain.jobs.scheduler.recovery`);
* in a shared cluster (``cluster start --shared`` set
  ``$DASKTRAIN_SHARED_SERVE``, as root) the socket every local user
  submits through (:mod:`~dasktrain.jobs.scheduler.socket_server`);
* the Prometheus metrics (:mod:`~dasktrain.jobs.scheduler.metrics`) and
  the read-only jobs page (:mod:`~dasktrain.jobs.scheduler.page`), as
  routes of the dashboard's web server, wherever it binds; a shared
  cluster's private: nothing of any job's output.
"""
import logging
import os

from dasktrain.cluster.shared import OWNER_ENV, SERVE_ENV
from dasktrain.jobs.scheduler.board import JobBoard
from dasktrain.jobs.scheduler.dispatch import Dispatcher
from dasktrain.jobs.scheduler.metrics import register, unregister
from dasktrain.jobs.scheduler.outside_use import cluster_use
from dasktrain.jobs.scheduler.page import add_routes
from dasktrain.jobs.scheduler.socket_server import SocketServer


def _log_as_dask():
    """The queue's own lines (who queued or cancelled what, what was
    purged) in the scheduler's log, at INFO, formatted as Dask's."""
    ours = logging.getLogger('dasktrain')
    handlers = logging.getLogger('distributed').handlers
    if handlers and not ours.handlers:
        for handler in handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


def dask_setup(scheduler):
    """Dask's preload hook."""
    _log_as_dask()
    board = JobBoard()
    scheduler.add_plugin(board)
    queue = Dispatcher()
    scheduler.add_plugin(queue, name=queue.name)
    shared = bool(os.environ.get(SERVE_ENV)) and os.geteuid() == 0
    if shared:
        owner = os.environ.get(OWNER_ENV, '')
        scheduler.add_plugin(SocketServer(
            os.environ[SERVE_ENV], int(owner) if owner.isdigit() else None,
            gpu_use=cluster_use))
    # A shared cluster's page and metrics show nothing of a job's output.
    register(scheduler, board, private=shared)
    add_routes(scheduler.http_application, board, queue, private=shared)


def dask_teardown(scheduler):
    unregister(scheduler)
