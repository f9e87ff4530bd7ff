"""GPUs busy outside the queue, as the scheduler knows them: the
workers' last heartbeat readings of who uses their GPUs
(:func:`~dasktrain.jobs.worker.gpu_use.worker_use`) judged by the one
rule (:mod:`dasktrain.parallel.outside`) with the cluster's threshold
(``cluster start --busy-mib``, ``$DASKTRAIN_BUSY_MIB``), for the queue's
dispatcher and ``dasktrain gpus`` alike.
"""
from dasktrain.jobs.worker.gpu_use import USE_METRIC, threshold
from dasktrain.parallel.outside import busy_from

BOARD = 'dasktrain-job-board'  # the job board's plugin name


def busy_outside(dask_scheduler, threshold_mib=None):
    """``{worker address: {gpu_id: 'user (pid N, M MiB)'}}``: the GPUs no
    job may get now, from each worker's last heartbeat (a worker without
    NVML, or without such processes, has ``{}``).

    Parameters
    ----------
    dask_scheduler : distributed.Scheduler
        In the scheduler's process (the queue's dispatcher; or
        ``client.run_on_scheduler(busy_outside)``, which passes it).
    threshold_mib : float, optional
        Default: ``cluster start --busy-mib`` (``$DASKTRAIN_BUSY_MIB`` of
        the scheduler), else :data:`~dasktrain.cluster.settings.BUSY_MIB`.

    Examples
    --------
    >>> busy_outside(dask_scheduler)  # doctest: +SKIP
    {'tls://10.0.0.5:40001': {'1': 'bob (pid 4242, 9000 MiB)'}}
    """
    return busy_from({address: (ws.metrics or {}).get(USE_METRIC)
                      for address, ws in
                      list(dask_scheduler.workers.items())},
                     threshold() if threshold_mib is None else threshold_mib)


def cluster_use(dask_scheduler):
    """What ``dasktrain gpus`` shows, as the scheduler knows it (run with
    ``client.run_on_scheduler``): per worker its resources and last
    ``worker_use`` (None before its first heartbeat, or without the
    worker's preload, :mod:`~dasktrain.jobs.worker.preload`), the GPUs
    busy outside the queue as the queue's dispatcher sees them
    (:func:`busy_outside`), and the job board's summaries."""
    board = dask_scheduler.plugins.get(BOARD)
    return {'workers': {address: {
        'resources': dict(ws.resources),
        'use': (ws.metrics or {}).get(USE_METRIC)}
        for address, ws in list(dask_scheduler.workers.items())},
        'busy': busy_outside(dask_scheduler),
        'jobs': board.summaries() if board is not None else [],
        'busy_mib': threshold()}
