"""A training job's program: ``python -m dasktrain.jobs.worker.train_job
FOLDER`` trains the job's config (:func:`train_job`), under its keeper,
as its submitter in a shared cluster (given its ``job.json`` on standard
input: ``--spec-stdin``, for root's file is not theirs to read).

It trains here: as the job's one process, or as one rank of its gang
(:mod:`~dasktrain.jobs.worker.gang`: its peers are then a launch's),
never as the driver of ranks of its own. It sees exactly its GPUs
(``CUDA_VISIBLE_DEVICES``, as 0..k-1) and always resumes from its last
checkpoint. What it prints goes to the job's
``output.log``, which is why this module, a process of its own, prints:
a user's mistake in one last line (``error: ...``: the job's error), the
whole traceback for anything else. It exits 0, 1,
:data:`~dasktrain.jobs.ending.PRUNED` when an epoch callback raised
:class:`~dasktrain.jobs.job.Pruned`, or :data:`~dasktrain.jobs.ending.STOPPED`
when a ``stop`` command (``dasktrain ctl``, ChainerUI) ended it.
"""
import json
import os
import sys
import traceback

from dasktrain.config import TrainConfig
from dasktrain.errors import Error, plural
from dasktrain.jobs.ending import PRUNED, STOPPED
from dasktrain.jobs.job import SPEC_LIMIT, Pruned, read_file
from dasktrain.jobs.record import JobRecord
from dasktrain.parallel.gpus import VISIBLE, place_devices


def _log_devices(devices):
    """What this job's process sees and which physical GPUs it trains on,
    for its output.log."""
    print(f'CUDA_VISIBLE_DEVICES={os.environ.get(VISIBLE)!r}', flush=True)
    if devices:
        from dasktrain.parallel.devices import device_uuids, resolve_devices
        uuids = device_uuids(resolve_devices(devices))
        print('devices: ' + ', '.join(f'{d} ({uuids.get(d, "CPU")})'
                                      for d in devices), flush=True)


def read_spec(folder, argv=()):
    """The job's record (its ``job.json``): from standard input where
    ``argv`` says ``--spec-stdin`` (a shared cluster's job), else from
    ``folder``."""
    if list(argv) == ['--spec-stdin']:
        return JobRecord.of(json.load(sys.stdin))
    return JobRecord.of(read_file(folder, 'job.json', SPEC_LIMIT))


def train_job(folder, callbacks=(), spec=None):
    """Train the job's config (``spec``, its record; default read from
    ``folder``), calling ``callbacks`` after each epoch; the exit code
    (see the module).

    Examples
    --------
    >>> sys.exit(train_job(folder, callbacks=[reporter]))  # doctest: +SKIP
    """
    if spec is None:
        spec = read_spec(folder)
    # Here, never ranks of its own: a gang's rank joins its peers, which
    # its environment names (jobs.worker.gang).
    config = TrainConfig.from_json(json.dumps(spec.config)).replace(
        workers=None, scheduler=None, gpus_per_worker=None)
    from dasktrain.run.train import train  # Chainer: the program only
    try:
        if spec.gpus:
            # CUDA_VISIBLE_DEVICES shows this job its GPUs as 0..k-1.
            config = config.replace(devices=place_devices(
                config.devices, range(spec.gpus)))
        _log_devices(config.devices if spec.gpus else None)
        summary = train(config, callbacks=callbacks)
    except Pruned as e:
        print(f'pruned: {e}', flush=True)
        return PRUNED
    except Error as e:  # the user's mistake or a fault: one line
        print(f'error: {e}', flush=True)
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    if summary.get('rank'):  # a gang's rank r > 0: rank 0 tells the run
        return 0
    final, stop = summary['final'], summary.get('stopped_by_request')
    if stop:
        print(f"stopped by request at iteration {stop['iteration']} "
              f"({plural(stop['epoch'], 'epoch')} done)", flush=True)
    if final:
        print(f"done: epoch {final['epoch']}, test accuracy "
              f"{final['validation/main/accuracy']:.4f}", flush=True)
        _curves(summary['out'])
    return STOPPED if stop else 0


def _curves(out):
    """OUT/curves.png, as ``dasktrain train`` draws it, where matplotlib
    is installed; the job's result stands without it."""
    try:
        from dasktrain.training.curves import save_curves
        path = save_curves(out)
    except ImportError:
        print('curves: not drawn (no matplotlib where the job ran); open '
              'OUT/log in ChainerUI', flush=True)
        return
    except OSError as e:
        print(f'curves: not drawn ({e})', flush=True)
        return
    if path is not None:
        print(f'curves: {path}', flush=True)


if __name__ == '__main__':
    sys.exit(train_job(sys.argv[1], spec=read_spec(sys.argv[1],
                                                    sys.argv[2:])))
