"""The worker's preload (``dask worker --preload
dasktrain.jobs.worker.preload``, what ``dasktrain cluster start`` runs,
and what a worker joined by hand adds): its heartbeats carry its GPUs'
NVML readings (for the metrics) and its GPUs' ids with who uses each
(what the queue's dispatcher hands out and keeps busy ones off):
:mod:`~dasktrain.jobs.worker.gpu_use`. Where its machine has GPUs that
CuPy cannot use (no CuPy, a CUDA library missing), it says so once in its
log, and its heartbeats carry that line, which ``submit`` shows where a
job cannot run for it: such a worker runs no training job on those GPUs
(``cluster start`` offers none of them; a worker given ``GPU=n`` by hand
keeps them for programs that need no CuPy, and a training job's submit
does not count it). At start it takes up where its
jobs are kept (:mod:`dasktrain.containment`: its folder of cgroups,
and what a worker before it left there ended); at its end it removes
that folder.
"""
import contextlib
import logging

from dasktrain import containment
from dasktrain.jobs.worker.gpu_use import (
    GPU_METRIC,
    UNUSABLE_METRIC,
    USE_METRIC,
    gpu_readings,
    worker_use,
)
from dasktrain.parallel.cuda_check import unusable_gpus_here

logger = logging.getLogger(__name__)


def dask_setup(worker):
    """Dask's preload hook."""
    worker.metrics[GPU_METRIC] = gpu_readings
    worker.metrics[USE_METRIC] = worker_use
    line = unusable_gpus_here()
    if line:
        logger.warning('%s; until then this worker runs no training job on '
                       'them', line)
        worker.metrics[UNUSABLE_METRIC] = lambda worker: line
    containment.jobs_folder()


def dask_teardown(worker):
    folder = containment.jobs_folder()
    if folder is not None:
        with contextlib.suppress(OSError):
            folder.rmdir()
