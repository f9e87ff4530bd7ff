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

Every change a job goes through (queued, running, each epoch's log row,
its end) is also sent to the scheduler as a Dask event on :data:`EVENTS`,
a :meth:`Job.summary`; :mod:`dasktrain.cluster.monitor` turns them into metrics.

A job ends ``finished``, ``failed``, ``cancelled`` or ``pruned``: its
training was stopped by an epoch callback raising :class:`Pruned` (a
hyperparameter search's pruner, see trials.py), and its GPUs went back to
the queue at once.
"""
import ctypes
import dataclasses
import getpass
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

from dasktrain.cluster.local import connect, home, worker_info
from dasktrain.parallel.gpus import (VISIBLE, GpuError, GpuPool,
                                     job_environment, place_devices)
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
EVENTS = 'dasktrain-jobs'  # the Dask event topic of jobs' summaries


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


# What every reader of a job's files needs from them.
_NEEDS = {'job.json': ('submitted', 'config'), 'status.json': ('state',)}


def _read(folder, name):
    """A job file as a dict; JobError saying what is wrong with it (a
    truncated file, an empty one, ``{}``) in one line."""
    path = folder / name
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise JobError(f'job {folder.name}: cannot read {name} '
                       f'({e.strerror})') from None
    except ValueError as e:
        raise JobError(f'job {folder.name}: {name} is not valid JSON '
                       f'({e})') from None
    missing = [k for k in _NEEDS[name]
               if not isinstance(data, dict) or k not in data]
    if not missing and name == 'job.json' and not (
            isinstance(data['config'], dict) and 'epochs' in data['config']):
        missing = ['config.epochs']
    if missing:
        raise JobError(f'job {folder.name}: {name} lacks '
                       f'{", ".join(missing)}')
    return data


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
        if not ((folder / 'job.json').exists() or
                (folder / 'status.json').exists()):
            raise JobError(f'no job {job_id!r} in {jobs_dir(path)}; '
                           '`dasktrain jobs` lists them')
        return cls(job_id, folder)

    @property
    def key(self):
        return KEY_PREFIX + self.id

    def spec(self):
        """``job.json``; JobError if it cannot be read."""
        return _read(self.folder, 'job.json')

    def log_rows(self):
        """The rows of ``out/log`` (none while it is missing or damaged)."""
        try:
            rows = json.loads((self.folder / 'out' / 'log').read_text())
        except (OSError, ValueError):
            return []
        ok = isinstance(rows, list) and all(
            isinstance(r, dict) and 'epoch' in r for r in rows)
        return rows if ok else []

    def status(self):
        """State, GPUs, times, attempts, and progress from the job's log;
        JobError if its files cannot be read."""
        status = _read(self.folder, 'status.json')
        rows = self.log_rows()
        status['epoch'] = rows[-1]['epoch'] if rows else 0
        status['epochs'] = self.spec()['config']['epochs']
        status['accuracy'] = (rows[-1].get('validation/main/accuracy')
                              if rows else None)
        return status

    def summary(self):
        """What the monitor keeps of a job: its request, its status and
        the last row of its log (all msgpack-able, for a Dask event)."""
        spec = self.spec()
        status = json.loads((self.folder / 'status.json').read_text())
        rows = self.log_rows()
        # The last epoch's wall time: elapsed_time runs on across resumes.
        epoch_seconds = rows[-1]['elapsed_time'] - (
            rows[-2]['elapsed_time'] if len(rows) > 1 else 0.0) \
            if rows else None
        return {'id': self.id, 'folder': str(self.folder),
                'name': spec['name'], 'user': spec.get('user', ''),
                'gpus': spec['gpus'], 'workers': spec.get('workers'),
                'epochs': spec['config']['epochs'],
                'submitted': spec['submitted'], 'state': status['state'],
                'held': status['gpus'] or [], 'worker': status['worker'],
                'started': status['started'], 'ended': status['ended'],
                'error': status['error'], 'attempts': status['attempts'],
                'row': rows[-1] if rows else None,
                'epoch_seconds': epoch_seconds}

    def announce(self, client=None):
        """Send :meth:`summary` to the scheduler as an event: from the
        worker this runs on, else through ``client``, else not at all."""
        try:
            summary = self.summary()
            try:
                from distributed import get_worker
                get_worker().log_event(EVENTS, summary)
            except ValueError:  # not on a worker
                if client is not None:
                    client.log_event(EVENTS, summary)
        except Exception:  # monitoring must never fail or stop a job
            pass

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
        queued = self.status()['state'] == 'queued'
        if queued:
            _update_status(self.folder, state='cancelled', ended=time.time())
        try:
            from distributed import Future
            owned = client is None
            client = client or connect(self.spec().get('scheduler'))
            try:
                client.cancel([Future(self.key, client)], force=True)
                if queued:  # a running job's task announces its own end
                    self.announce(client)
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
    """Every job in the jobs dir, oldest first (by submission, else by its
    folder's time when ``job.json`` cannot be read)."""
    root = jobs_dir(path)
    if not root.is_dir():
        return []
    jobs = [Job(p.name, p) for p in root.iterdir()
            if (p / 'status.json').exists() or (p / 'job.json').exists()]

    def submitted(job):
        try:
            return float(job.spec()['submitted'])
        except (JobError, TypeError, ValueError):
            return job.folder.stat().st_mtime
    return sorted(jobs, key=submitted)


def _user():
    try:
        return getpass.getuser()
    except Exception:  # no login name, no passwd entry (containers)
        return str(os.getuid())


def _slug(text):
    return re.sub(r'[^A-Za-z0-9_.-]+', '-', text).strip('-')[:40] or 'job'


def check_resources(client, config, gpus):
    """Refuse a job no worker of ``client``'s cluster can ever run: more
    GPUs (or CPU slots, for ``gpus=0``) than any worker offers."""
    resource = 'GPU' if gpus else 'CPU'
    need = max(gpus, 1)
    workers = worker_info(client)
    have = {addr: w.get('resources', {}).get(resource, 0)
            for addr, w in workers.items()}
    if config.workers is not None:
        able = sum(1 for n in have.values() if n >= gpus)
        if able < config.workers:
            each = f'{gpus} GPUs' if gpus else 'a CPU slot'
            raise JobError(f'--workers {config.workers} needs as many '
                           f'Dask workers with {each}; the cluster has '
                           f'{able}; add workers or lower --workers')
    elif not have or max(have.values()) < need:
        largest = max(have.values(), default=0)
        slots = sum(w.get('resources', {}).get('CPU', 0)
                    for w in workers.values())
        instead = (f'pass --gpus 0 to take one of the {slots:g} CPU '
                   f'slot{"s" * (slots != 1)} the workers offer, '
                   if gpus and slots else 'ask for fewer, ')
        raise JobError(f'no worker has {need} {resource} (largest: '
                       f'{largest:g} among {len(have)} workers); '
                       f'{instead}or add a worker with `dask worker '
                       f'ADDRESS --resources {resource}={need}`')


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
        (default ``dasktrain.cluster.jobs``; trials.py's report to their study).
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
        # Paths as the submitter meant them: the job runs in the worker's
        # working directory.
        config = config.replace(out=str(folder / 'out'), resume=True,
                                progress=True,
                                data_dir=os.path.abspath(config.data_dir))
        spec = {
            'id': job_id, 'name': name or config.model, 'user': _user(),
            'gpus': gpus,
            'workers': config.workers,
            'config': json.loads(config.to_json()),
            'scheduler': client.scheduler.address,
            'submitted': time.time(), **(extra or {})}
        write_json(folder / 'job.json', spec)
        write_json(folder / 'status.json', {
            'state': 'queued', 'attempts': 0, 'gpus': None, 'worker': None,
            'started': None, 'ended': None, 'error': None})
        job = Job(job_id, folder)
        # Before the task: the scheduler sees 'queued' before 'running'.
        job.announce(client)
        _queue(client, folder, spec)
        return job
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
    child_module = spec.get('child', 'dasktrain.cluster.jobs')
    if not child_module.startswith('dasktrain.'):  # job.json names code
        return _update_status(folder, state='failed', ended=time.time(),
                              error=f'{child_module!r} is not ours')['state']
    job = Job(spec['id'], folder)
    rows = job.log_rows()
    gpus = GpuPool.acquire(spec['gpus']) \
        if spec['gpus'] and not spec.get('workers') else []
    ids = [g.id for g in gpus]  # the worker's CUDA_VISIBLE_DEVICES entries
    attempt = status['attempts'] + 1
    worker = get_worker().address
    _update_status(folder, state='running', attempts=attempt, gpus=ids,
                   worker=worker, started=status['started'] or time.time())
    job.announce()
    log_path = folder / 'out' / 'log'
    seen = _mtime(log_path)
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
                if _mtime(log_path) != seen:  # an epoch ended: tell
                    seen = _mtime(log_path)   # the monitor
                    job.announce()
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
        job.announce()
    finally:
        GpuPool.release(gpus)
    return state


def _mtime(path):
    try:
        return path.stat().st_mtime_ns
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
    from dasktrain.cluster.scaleout import train
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
