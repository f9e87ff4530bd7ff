"""Running a job on a worker: the task body (:func:`run_job`) and its child
process (``python -m dasktrain.jobs.worker FOLDER``, :func:`run_child`);
a command job's program (:func:`run_program`, see
:mod:`~dasktrain.jobs.programs`).

The task picks the GPUs no other job on its worker holds and runs the
job's child module (``job.json``'s ``child``, default this one) with
``CUDA_VISIBLE_DEVICES`` set to them, always with ``--resume``: a job that
Dask reruns after its worker died continues from its last checkpoint. In
a shared cluster the child runs as the job's submitter
(:mod:`~dasktrain.jobs.runas`), given its spec on stdin. The
child trains the job's config; what it prints goes to the job's
``output.log``, which is why this module, a process of its own, prints.

Every change a job goes through (running, each epoch's log row, its end)
is sent to the scheduler as a Dask event on
:data:`~dasktrain.jobs.records.EVENTS` by
:meth:`~dasktrain.jobs.records.Job.announce`;
:mod:`dasktrain.monitor` turns them into metrics.

Owns the worker's side only: it never submits a job (that is
:mod:`~dasktrain.jobs.submit`'s).
"""
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from dasktrain import keeper
from dasktrain.config import TrainConfig
from dasktrain.errors import Error
from dasktrain.jobs.records import (
    DONE,
    PRUNED,
    Job,
    JobError,
    Pruned,
    update_status,
)
from dasktrain.jobs.runas import (
    environment,
    job_user,
    last_line,
    open_output,
)
from dasktrain.keeper import cannot_start, popen_options
from dasktrain.parallel.gpus import (
    VISIBLE,
    GpuPool,
    job_environment,
    place_devices,
)
from dasktrain.spawn import python

CHILD = 'dasktrain.jobs.worker'  # the child module of a plain job
# Child modules that job folders written by earlier versions name, and
# what runs them now: such a folder still runs (or resumes) as it was meant.
FORMER_CHILDREN = {
    'dasktrain.jobs': CHILD,
    'dasktrain.cluster.jobs': CHILD,
    'dasktrain.trials': 'dasktrain.tuning.trials',
}


def child_module(spec):
    """The module a job's child process runs, from its ``job.json``:
    its ``child`` (a former name mapped to today's), else :data:`CHILD`.

    Examples
    --------
    >>> child_module({})
    'dasktrain.jobs.worker'
    >>> child_module({'child': 'dasktrain.cluster.jobs'})
    'dasktrain.jobs.worker'
    >>> child_module({'child': 'dasktrain.tuning.trials'})
    'dasktrain.tuning.trials'
    """
    module = spec.get('child', CHILD)
    return FORMER_CHILDREN.get(module, module)


_children = {}  # {pid: job id} of the job children running here


def job_children():
    """``{pid: job id}`` of the jobs' child processes running in this
    worker process now (a command job's is its session's leader too): who
    uses a GPU is told by them (:mod:`dasktrain.gpuuse`)."""
    return dict(_children)


def run_job(folder, gpus=None):
    """The task body: run one attempt of the job in a child process;
    returns the state it ended in. ``gpus``: the ids of this worker's
    GPUs the queue planned for it (see
    :class:`~dasktrain.parallel.gpus.GpuPool`)."""
    want = gpus
    from distributed import get_worker
    folder = Path(folder)
    spec = json.loads((folder / 'job.json').read_text())
    status = json.loads((folder / 'status.json').read_text())
    if (folder / 'cancel').exists() or status['state'] in DONE:
        return status['state']
    if spec.get('kind') == 'program':  # any program (programs.py)
        gpus = GpuPool.acquire(spec['gpus'], want=want) \
            if spec['gpus'] else []
        try:
            return run_program(folder, spec, status, gpus,
                               get_worker().address)
        finally:
            GpuPool.release(gpus)
    module = child_module(spec)
    if not module.startswith('dasktrain.'):  # job.json names code
        return _failed(folder, f'{module!r} is not ours')
    try:
        user = job_user(spec)  # a shared cluster's: its submitter
    except JobError as e:
        return _failed(folder, str(e))
    job = Job(spec['id'], folder)
    rows = job.log_rows()
    gpus = GpuPool.acquire(spec['gpus'], want=want) \
        if spec['gpus'] and not spec.get('workers') else []
    ids = [g.id for g in gpus]  # the worker's CUDA_VISIBLE_DEVICES entries
    attempt = status['attempts'] + 1
    worker = get_worker().address
    update_status(folder, state='running', attempts=attempt, gpus=ids,
                  worker=worker, started=status['started'] or time.time())
    job.announce()
    log_path = folder / 'out' / 'log'
    seen = _mtime(log_path)
    # The child sees exactly its GPUs (as 0..k-1), or none at all.
    env = job_environment(environment(dict(os.environ, PYTHONUNBUFFERED='1'),
                                      user), gpus)
    start = f'resuming after epoch {rows[-1]["epoch"]}' if rows else \
        'starting'
    # Its submitter cannot read root's job.json: the spec comes on stdin.
    argv = python(module, folder) + (['--spec-stdin'] if user else [])
    child = None
    try:
        with open_output(folder, user) as log:
            log.write(f'=== attempt {attempt} on {worker}, GPUs '
                      f'{",".join(ids) or "none"} '
                      f'(CUDA_VISIBLE_DEVICES='
                      f'{env["CUDA_VISIBLE_DEVICES"]!r}), '
                      f'{start}'
                      f' ===\n'.encode())
            log.flush()
            try:
                child = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                    stdin=subprocess.PIPE if user else subprocess.DEVNULL,
                    **popen_options(user, folder))
            except (OSError, subprocess.SubprocessError) as e:
                return _failed(folder, cannot_start(argv[0], user, e), job,
                               log)
            _children[child.pid] = job.id
            if user:
                _hand(child, spec)
            while child.poll() is None:
                if (folder / 'cancel').exists():
                    child.terminate()
                    try:
                        child.wait(10)
                    except subprocess.TimeoutExpired:
                        child.kill()
                if _mtime(log_path) != seen:  # an epoch ended: tell
                    seen = _mtime(log_path)   # the monitor
                    job.announce()
                time.sleep(0.2)
        if (folder / 'cancel').exists():
            state, error = stopped_state(folder, None)
        elif child.returncode == 0:
            state, error = 'finished', None
        elif child.returncode == PRUNED:
            state, error = 'pruned', None
        else:
            state = 'failed'
            error = last_line(folder, user) or \
                f'exit code {child.returncode}'
        # Recorded before the GPUs are free: the next job starts after it.
        update_status(folder, state=state, error=error, ended=time.time())
        job.announce()
    finally:
        _children.pop(child.pid if child is not None else None, None)
        GpuPool.release(gpus)
    return state


def _failed(folder, error, job=None, log=None):
    """Record that the job in ``folder`` failed before its child ran,
    with ``error`` (also written to its output ``log``, when given), and
    tell the job's watchers (``job``, when given); 'failed'."""
    if log is not None:
        log.write(f'error: {error}\n'.encode())
    update_status(folder, state='failed', error=error, ended=time.time())
    if job is not None:
        job.announce()
    return 'failed'


def _hand(child, spec):
    """Give the child its spec on stdin, then close it."""
    try:
        with child.stdin:
            child.stdin.write(json.dumps(spec).encode())
    except OSError:  # it died at once: its exit code tells
        pass


def exit_words(returncode):
    """The end of a program in words, from ``Popen.returncode``.

    >>> exit_words(0), exit_words(3), exit_words(-9)
    ('finished', 'failed (exit 3)', 'failed (killed by SIGKILL)')
    """
    if returncode == 0:
        return 'finished'
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f'signal {-returncode}'
        return f'failed (killed by {name})'
    return f'failed (exit {returncode})'


def run_program(folder, spec, status, gpus, worker):
    """The task body of a command job (see the module); returns the state
    it ended in. ``gpus``: the :class:`~dasktrain.parallel.gpus.Gpu` it
    holds; ``worker``: this worker's address."""
    folder = Path(folder)
    job = Job(spec['id'], folder)
    if status['state'] == 'running' and not spec.get('requeue'):
        # The attempt before never ended: its worker died under it.
        update_status(folder, state='lost', ended=time.time(),
                      error=f'its worker ({status["worker"]}) died while it '
                            'ran; submit it again, or with --requeue if it '
                            'resumes by itself')
        job.announce()
        return 'lost'
    try:
        user = job_user(spec)  # a shared cluster's: its submitter
    except JobError as e:
        return _failed(folder, str(e), job)
    ids = [g.id for g in gpus]
    attempt = status['attempts'] + 1
    update_status(folder, state='running', attempts=attempt, gpus=ids,
                  worker=worker, started=status['started'] or time.time())
    job.announce()
    env = json.loads((folder / 'env.json').read_text())
    env = job_environment(environment(dict(env, PYTHONUNBUFFERED='1'), user,
                                      recorded=True), gpus)
    cancelled, grace = None, spec.get('grace', 30.0)
    with open_output(folder, user) as log:
        log.write(f'=== attempt {attempt} on {worker}, GPUs '
                  f'{",".join(ids) or "none"} (CUDA_VISIBLE_DEVICES='
                  f'{env["CUDA_VISIBLE_DEVICES"]!r}), in {spec["cwd"]}: '
                  f'{" ".join(spec["command"])} ===\n'.encode())
        log.flush()
        # Its keeper: nothing the program starts outlives it.
        child = keeper.start(spec['command'], env, grace, stdout=log,
                             user=user, cwd=spec['cwd'])
        _children[child.pid] = job.id
        try:
            while child.poll() is None:
                if cancelled is None and (folder / 'cancel').exists():
                    cancelled = child.stop(grace)
                    log.write(f'=== cancelled: {cancelled} ===\n'.encode())
                time.sleep(0.2)
        finally:
            _children.pop(child.pid, None)
        error = child.start_error()
        if error is not None:  # no such program; its folder not enterable
            return _failed(folder, error, job, log)
    words = exit_words(child.returncode)
    if cancelled is not None:
        state, error = stopped_state(folder, cancelled)
    elif child.returncode == 0:
        state, error = 'finished', None
    else:
        state, error = 'failed', words[len('failed ('):-1]
    update_status(folder, state=state, error=error, ended=time.time(),
                  exit_code=child.returncode)
    job.announce()
    return state


def stopped_state(folder, how):
    """(state, error) of a job its ``cancel`` flag stopped: ``cancelled``
    (an empty flag: someone cancelled it), or ``failed`` with the reason
    the queue wrote into the flag (its time limit passed); ``how`` it
    was stopped, in words, if known."""
    try:
        reason = (Path(folder) / 'cancel').read_text().strip()
    except OSError:
        reason = ''
    if not reason:
        return 'cancelled', how
    return 'failed', f'{reason}: {how}' if how else reason


def _mtime(path):
    try:  # a symlink's own time: its target may be anyone's
        return os.lstat(path).st_mtime_ns
    except OSError:
        return None


def _log_devices(devices):
    """What this job's process sees and which physical GPUs it trains on,
    for its output.log."""
    print(f'CUDA_VISIBLE_DEVICES={os.environ.get(VISIBLE)!r}', flush=True)
    if devices:
        from dasktrain.parallel.devices import device_uuids, resolve_devices
        uuids = device_uuids(resolve_devices(devices))
        print('devices: ' + ', '.join(f'{d} ({uuids.get(d, "CPU")})'
                                      for d in devices), flush=True)


def run_child(folder, callbacks=(), spec=None):
    """The child process: train the job's config, calling ``callbacks``
    after each epoch; one line for a user's mistake, the whole traceback
    for anything else. Returns the exit code: 0, 1, or
    :data:`~dasktrain.jobs.records.PRUNED` when a callback raised
    :class:`~dasktrain.jobs.records.Pruned`.

    Examples
    --------
    >>> sys.exit(run_child(folder, callbacks=[reporter]))  # doctest: +SKIP
    """
    if spec is None:  # a shared cluster's child is given it: see run_job
        spec = json.loads((Path(folder) / 'job.json').read_text())
    config = TrainConfig.from_json(json.dumps(spec['config']))
    if config.workers is not None:
        # Across workers each rank takes its worker's free GPUs itself.
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
    final = summary['final']
    if final:
        print(f"done: epoch {final['epoch']}, test accuracy "
              f"{final['validation/main/accuracy']:.4f}", flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(run_child(sys.argv[1], spec=json.load(sys.stdin)
                       if sys.argv[2:] == ['--spec-stdin'] else None))
