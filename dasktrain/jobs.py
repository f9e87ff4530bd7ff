"""Training jobs on a dask.distributed cluster, queued by GPUs.

``submit`` writes the job's folder (under the jobs dir, which must be on
storage every worker sees, as a lab NAS is) and hands one task to the
scheduler with ``resources={'GPU': K}``: Dask itself holds it until a worker
has K free GPUs. The task picks K GPU ids no other job on that worker holds
and runs ``dasktrain train`` in a child process with
``CUDA_VISIBLE_DEVICES`` set to them, always with ``--resume``: a job that
Dask reruns after its worker died continues from its last checkpoint.

A job folder holds ``job.json`` (the TrainConfig and request),
``status.json`` (state, times, GPUs, attempts), ``output.log`` (what the
training printed, across attempts) and ``out/`` (its log, checkpoint and
models).

A job ends ``finished``, ``failed``, ``cancelled`` or ``pruned``: its
training was stopped by an epoch callback raising :class:`Pruned` (a
hyperparameter search's pruner, see trials.py), and its GPUs went back to
the queue at once.
"""
import ctypes
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

from dasktrain.cluster import connect, home
from dasktrain.gpus import (VISIBLE, GpuError, GpuPool, job_environment,
                            place_devices)
from dasktrain.config import TrainConfig
from dasktrain.errors import UserError
from dasktrain.files import write_json

KEY_PREFIX = 'dasktrain-job-'
JOBS_ENV = 'DASKTRAIN_JOBS_DIR'
DONE = ('finished', 'failed', 'cancelled', 'pruned')
PRUNED = 3  # exit code of a job child whose training was pruned


class Pruned(Exception):
    """Raised by an epoch callback of a job: stop its training now; the job
    ends ``pruned``, not failed."""


class JobError(UserError):
    pass


def jobs_dir(path=None):
    """``path``, else ``$DASKTRAIN_JOBS_DIR``, else ``$DASKTRAIN_HOME/jobs``."""
    return Path(path or os.environ.get(JOBS_ENV) or home() / 'jobs')


def _update_status(folder, **changes):
    path = folder / 'status.json'
    status = json.loads(path.read_text())
    status.update(changes)
    write_json(path, status)
    return status


@dataclasses.dataclass
class Job:
    """A submitted job; everything about it is read from its folder.

    Examples
    --------
    >>> job = dasktrain.submit(TrainConfig(epochs=5), gpus=2)  # doctest: +SKIP
    >>> job.status()['state']  # doctest: +SKIP
    'queued'
    >>> job.result()['final']['validation/main/accuracy']  # doctest: +SKIP
    """
    id: str
    folder: Path

    @classmethod
    def find(cls, job_id, path=None):
        folder = jobs_dir(path) / job_id
        if not (folder / 'job.json').is_file():
            raise JobError(f'no job {job_id!r} in {jobs_dir(path)}; '
                           '`dasktrain jobs` lists them')
        return cls(job_id, folder)

    @property
    def key(self):
        return KEY_PREFIX + self.id

    def spec(self):
        return json.loads((self.folder / 'job.json').read_text())

    def log_rows(self):
        try:
            return json.loads((self.folder / 'out' / 'log').read_text())
        except (OSError, ValueError):
            return []

    def status(self):
        """State, GPUs, times, attempts, and progress from the job's log."""
        status = json.loads((self.folder / 'status.json').read_text())
        rows = self.log_rows()
        status['epoch'] = rows[-1]['epoch'] if rows else 0
        status['epochs'] = self.spec()['config']['epochs']
        status['accuracy'] = (rows[-1]['validation/main/accuracy']
                              if rows else None)
        return status

    def logs(self):
        try:
            return (self.folder / 'output.log').read_text()
        except OSError:
            return ''

    def cancel(self, client=None):
        """Cancel: dropped from the queue, or its training stopped."""
        if self.status()['state'] in DONE:
            return
        (self.folder / 'cancel').touch()
        if self.status()['state'] == 'queued':
            _update_status(self.folder, state='cancelled', ended=time.time())
        try:
            from distributed import Future
            owned = client is None
            client = client or connect(self.spec().get('scheduler'))
            try:
                client.cancel([Future(self.key, client)], force=True)
            finally:
                if owned:
                    client.close()
        except UserError:
            pass  # scheduler gone: the flag file stops it on its next run

    def requeue(self, client):
        """Hand a job the scheduler lost (a restarted cluster, a submitter
        killed mid-submit) to it again; it resumes from its checkpoint."""
        _queue(client, self.folder, self.spec())

    def result(self, timeout=None, poll=0.5):
        """Wait until the job ends; its summary, or JobError if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status()
            if status['state'] in DONE:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f'job {self.id} still {status["state"]}')
            time.sleep(poll)
        if status['state'] != 'finished':
            raise JobError(f"job {self.id} {status['state']}: "
                           f"{status.get('error') or ''}".rstrip(': '))
        rows = self.log_rows()
        return {'id': self.id, 'final': rows[-1] if rows else None,
                'log': rows, 'out': str(self.folder / 'out'),
                'gpus': status.get('gpus')}


def list_jobs(path=None):
    """Every job in the jobs dir, oldest first."""
    root = jobs_dir(path)
    if not root.is_dir():
        return []
    jobs = [Job(p.name, p) for p in root.iterdir()
            if (p / 'status.json').is_file()]
    return sorted(jobs, key=lambda j: j.spec()['submitted'])


def _slug(text):
    return re.sub(r'[^A-Za-z0-9_.-]+', '-', text).strip('-')[:40] or 'job'


def check_resources(client, config, gpus):
    """Refuse a job no worker of ``client``'s cluster can ever run: more
    GPUs (or CPU slots, for ``gpus=0``) than any worker offers."""
    resource = 'GPU' if gpus else 'CPU'
    need = max(gpus, 1)
    workers = client.scheduler_info()['workers']
    have = {addr: w.get('resources', {}).get(resource, 0)
            for addr, w in workers.items()}
    if config.workers is not None:
        able = sum(1 for n in have.values() if n >= gpus)
        if able < config.workers:
            raise JobError(f'workers={config.workers} needs as many '
                           f'Dask workers with {gpus} GPUs; the cluster '
                           f'has {able}; add workers or lower --workers')
    elif not have or max(have.values()) < need:
        largest = max(have.values(), default=0)
        raise JobError(f'no worker has {need} {resource} (largest: '
                       f'{largest:g} among {len(have)} workers); ask '
                       'for fewer, or add a worker with '
                       f'`dask worker ADDRESS --resources {resource}='
                       f'{need}`')


def submit(config, gpus=1, name=None, client=None, scheduler=None,
           path=None, extra=None, check=True):
    """Queue a training job; returns at once with its :class:`Job`.

    Parameters
    ----------
    config : TrainConfig
        The run; ``out`` is replaced by the job's own folder.
    gpus : int, default 1
        GPUs the job reserves (0: one ``CPU`` slot). If ``config.devices``
        names devices itself (e.g. ``('@numpy',)``), those are used. With
        ``config.workers`` set, GPUs per worker: the job's driver then
        holds no GPU and its ranks queue for theirs (see scaleout.py).
    name : str, optional
        A label for listings; default the model's name.
    client : distributed.Client, optional
        Default: connect to ``scheduler`` or the recorded cluster.
    path : str, optional
        Jobs dir; must be on storage every worker sees.
    extra : dict, optional
        More keys for ``job.json``; ``'child'`` names the ``dasktrain``
        module the job's child process runs as ``python -m MODULE FOLDER``
        (default ``dasktrain.jobs``; trials.py's report to their study).
    check : bool, default True
        Refuse a job no worker can run; False queues it regardless (until
        such a worker joins), as a search does once it has checked.
    """
    if not isinstance(gpus, int) or gpus < 0:
        raise JobError(f'gpus must be an int >= 0, got {gpus!r}')
    check_devices(config, gpus)
    owned = client is None
    client = client or connect(scheduler)
    try:
        if check:
            check_resources(client, config, gpus)
        job_id = (f'{_slug(name or config.model)}-'
                  f'{time.strftime("%Y%m%d-%H%M%S")}-{uuid.uuid4().hex[:6]}')
        folder = jobs_dir(path).resolve() / job_id
        folder.mkdir(parents=True)
        config = config.replace(out=str(folder / 'out'), resume=True,
                                progress=True)
        spec = {
            'id': job_id, 'name': name or config.model, 'gpus': gpus,
            'workers': config.workers,
            'config': json.loads(config.to_json()),
            'scheduler': client.scheduler.address,
            'submitted': time.time(), **(extra or {})}
        write_json(folder / 'job.json', spec)
        write_json(folder / 'status.json', {
            'state': 'queued', 'attempts': 0, 'gpus': None, 'worker': None,
            'started': None, 'ended': None, 'error': None})
        _queue(client, folder, spec)
        return Job(job_id, folder)
    finally:
        if owned:
            client.close()


def _queue(client, folder, spec):
    from distributed import fire_and_forget
    resource = 'GPU' if spec['gpus'] else 'CPU'
    # A scale-out job's driver needs a thread only: its ranks hold the
    # GPUs (or CPU slots).
    future = client.submit(
        run_job, str(folder), key=KEY_PREFIX + spec['id'], pure=False,
        resources=None if spec['workers'] else
        {resource: max(spec['gpus'], 1)})
    fire_and_forget(future)  # runs on after this client goes away


def scheduler_states(keys, client):
    """What the scheduler knows of each job key ('no-worker', ...)."""
    def states(dask_scheduler, keys):
        return {k: dask_scheduler.tasks[k].state for k in keys
                if k in dask_scheduler.tasks}
    return client.run_on_scheduler(states, keys=list(keys))


# ----------------------------------------------------------- on a worker

def _die_with_parent():
    # The training must not outlive a killed worker: its rerun elsewhere
    # would share the output folder with a ghost.
    libc = ctypes.CDLL('libc.so.6', use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_job(folder):
    """The task body: run one attempt of the job in a child process."""
    from distributed import get_worker
    folder = Path(folder)
    spec = json.loads((folder / 'job.json').read_text())
    status = json.loads((folder / 'status.json').read_text())
    if (folder / 'cancel').exists() or status['state'] in DONE:
        return status['state']
    child_module = spec.get('child', 'dasktrain.jobs')
    if not child_module.startswith('dasktrain.'):  # job.json names code
        return _update_status(folder, state='failed', ended=time.time(),
                              error=f'{child_module!r} is not ours')['state']
    rows = Job(spec['id'], folder).log_rows()
    gpus = GpuPool.acquire(spec['gpus']) \
        if spec['gpus'] and not spec.get('workers') else []
    ids = [g.id for g in gpus]  # the worker's CUDA_VISIBLE_DEVICES entries
    attempt = status['attempts'] + 1
    worker = get_worker().address
    _update_status(folder, state='running', attempts=attempt, gpus=ids,
                   worker=worker, started=status['started'] or time.time())
    # The child sees exactly its GPUs (as 0..k-1), or none at all.
    env = job_environment(dict(os.environ, PYTHONUNBUFFERED='1'), gpus)
    try:
        with open(folder / 'output.log', 'ab') as log:
            log.write(f'=== attempt {attempt} on {worker}, GPUs '
                      f'{",".join(ids) or "none"} '
                      f'(CUDA_VISIBLE_DEVICES={env["CUDA_VISIBLE_DEVICES"]!r}), '
                      f'{"resuming after epoch %d" % rows[-1]["epoch"] if rows else "starting"}'
                      f' ===\n'.encode())
            log.flush()
            child = subprocess.Popen(
                [sys.executable, '-m', child_module, str(folder)],
                stdout=log, stderr=subprocess.STDOUT, env=env,
                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            while child.poll() is None:
                if (folder / 'cancel').exists():
                    child.terminate()
                    try:
                        child.wait(10)
                    except subprocess.TimeoutExpired:
                        child.kill()
                time.sleep(0.2)
        if (folder / 'cancel').exists():
            state, error = 'cancelled', None
        elif child.returncode == 0:
            state, error = 'finished', None
        elif child.returncode == PRUNED:
            state, error = 'pruned', None
        else:
            state = 'failed'
            lines = (folder / 'output.log').read_text().strip().splitlines()
            error = lines[-1] if lines else f'exit code {child.returncode}'
        # Recorded before the GPUs are free: the next job starts after it.
        _update_status(folder, state=state, error=error, ended=time.time())
    finally:
        GpuPool.release(gpus)
    return state


def _log_devices(devices):
    """What this job's process sees and which physical GPUs it trains on,
    for its output.log."""
    print(f'CUDA_VISIBLE_DEVICES={os.environ.get(VISIBLE)!r}', flush=True)
    if devices:
        from dasktrain.devices import device_uuids, resolve_devices
        uuids = device_uuids(resolve_devices(devices))
        print('devices: ' + ', '.join(f'{d} ({uuids.get(d, "CPU")})'
                                      for d in devices), flush=True)


def check_devices(config, gpus):
    """Refuse, at submit time, a job whose own --devices name GPUs other
    than the ones it reserves (the cluster picks which GPUs a job gets)."""
    if config.workers is not None or config.devices is None:
        return
    try:
        place_devices(config.devices, range(gpus))
    except GpuError as e:
        raise JobError(str(e)) from None


def run_child(folder, callbacks=()):
    """The child process: train the job's config, calling ``callbacks``
    after each epoch; one line for a user's mistake, the whole traceback
    for anything else. Returns the exit code: 0, 1, or :data:`PRUNED` when
    a callback raised :class:`Pruned`."""
    spec = json.loads((Path(folder) / 'job.json').read_text())
    config = TrainConfig.from_json(json.dumps(spec['config']))
    if config.workers is not None:
        # Across workers each rank takes its worker's free GPUs itself.
        config = config.replace(scheduler=spec['scheduler'])
    from dasktrain.scaleout import train
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
    except UserError as e:
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
    sys.exit(run_child(sys.argv[1]))
