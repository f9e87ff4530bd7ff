"""A cluster for a notebook or a script: the one it is given, else the
one ``dasktrain cluster start`` left running, else a new one, which it
alone stops again.

Owns that choice; starting and stopping are
:mod:`~dasktrain.cluster.local`'s.
"""
from dasktrain.cluster.local import (
    ClusterError,
    cluster_status,
    read_state,
    start_cluster,
    stop_cluster,
)


def ensure_cluster(scheduler=None, **start):
    """The cluster to use, as a dict with ``scheduler``, ``dashboard``,
    ``workers`` and ``started`` (True only where this call started it:
    pass the dict to :func:`release_cluster` when done).

    Parameters
    ----------
    scheduler : str, optional
        The address of a running cluster (yours, started by ``dasktrain
        cluster start`` or ``dask scheduler``); used as it is.
    **start
        :func:`~dasktrain.cluster.local.start_cluster`'s arguments, for
        a cluster started here when none is given or running.

    Examples
    --------
    >>> cluster = ensure_cluster(port=0, dashboard_port=0)  # doctest: +SKIP
    >>> cluster['started']  # doctest: +SKIP
    False
    >>> release_cluster(cluster)  # doctest: +SKIP
    """
    if scheduler is None and read_state() is not None:
        try:  # the recorded one, if it still answers
            return dict(cluster_status(), started=False)
        except ClusterError:
            pass  # a stale record: start_cluster replaces it
    if scheduler is not None:
        return dict(cluster_status(scheduler), started=False)
    state = start_cluster(**start)
    return dict(cluster_status(state['scheduler']), started=True)


def release_cluster(cluster):
    """Stop ``cluster`` if :func:`ensure_cluster` started it; leave it
    running otherwise (someone else's, or yours from the shell)."""
    if cluster.get('started'):
        stop_cluster()
