"""A training job's program: ``python -m dasktrain.jobs.worker.child
FOLDER`` trains the job's config (:func:`run_child`), under its keeper,
as its submitter in a shared cluster (given its ``job.json`` on standard
input: ``--spec-stdin``, for root's file is not theirs to read).

It sees exactly its GPUs (``CUDA_VISIBLE_DEVICES``, as 0..k-1) and
always resumes from its last checkpoint. What it prints goes to the job's
``output.log``, which is why this module, a process of its own, prints:
a user's mistake in one last line (``error: ...``: the job's error), the
whole traceback for anything else. It exits 0, 1,
:data:`~dasktrain.jobs.job.PRUNED` when an epoch callback raised
:class:`~dasktrain.jobs.job.Pruned`, or :data:`~dasktrain.jobs.job.STOPPED`
when a ``stop`` command (``dasktrain ctl``, ChainerUI) ended it.
"""
import json
import os
import sys
import traceback

from dasktrain.config import TrainConfig
from dasktrain.errors import Error, plural
from dasktrain.jobs.job import (
    PRUNED,
    SPEC_LIMIT,
    STOPPED,
    Pruned,
    read_file,
)
from dasktrain.parallel.comm.rendezvous import launched
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
    """The job's ``job.json``: from standard input where ``argv`` says
    ``--spec-stdin`` (a shared cluster's job), else from ``folder``."""
    if list(argv) == ['--spec-stdin']:
        return json.load(sys.stdin)
    return read_file(folder, 'job.json', SPEC_LIMIT)


def run_child(folder, callbacks=(), spec=None):
    """Train the job's config, calling ``callbacks`` after each epoch; the
    exit code (see the module).

    Examples
    --------
    >>> sys.exit(run_child(folder, callbacks=[reporter]))  # doctest: +SKIP
    """
    if spec is None:
        spec = read_spec(folder)
    config = TrainConfig.from_json(json.dumps(spec['config']))
    if launched():
        # A rank of a gang (jobs.worker.gang): its peers are launch's.
        config = config.replace(workers=None, scheduler=None,
                                gpus_per_worker=None)
    elif config.workers is not None:  # its ranks driven from here
        config = config.replace(scheduler=spec['scheduler'])
    from dasktrain.run.train import train  # Chainer: the child only
    try:
        if spec['gpus'] and config.workers is None:
            # CUDA_VISIBLE_DEVICES shows this job its GPUs as 0..k-1.
            config = config.replace(devices=place_devices(
                config.devices, range(spec['gpus'])))
        _log_devices(config.devices if spec['gpus'] else None)
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
    sys.exit(run_child(sys.argv[1], spec=read_spec(sys.argv[1],
                                                    sys.argv[2:])))
