"""The worker's preload (``dask worker --preload
dasktrain.jobs.worker.preload``, what ``dasktrain cluster start`` runs,
and what a worker joined by hand adds): its heartbeats carry its GPUs'
NVML readings (for the metrics) and its GPUs' ids with who uses each
(what the queue's dispatcher hands out and keeps busy ones off):
:mod:`~dasktrain.jobs.worker.gpu_use`. At start it takes up where its
jobs are kept (:mod:`dasktrain.containment`: its folder of cgroups,
and what a worker before it left there ended); at its end it removes
that folder.
"""
import contextlib

from dasktrain import containment
from dasktrain.jobs.worker.gpu_use import (
    GPU_METRIC,
    USE_METRIC,
    gpu_readings,
    worker_use,
)


def dask_setup(worker):
    """Dask's preload hook."""
    worker.metrics[GPU_METRIC] = gpu_readings
    worker.metrics[USE_METRIC] = worker_use
    containment.jobs_folder()


def dask_teardown(worker):
    folder = containment.jobs_folder()
    if folder is not None:
        with contextlib.suppress(OSError):
            folder.rmdir()
