"""`dasktrain gpus` on a real local cluster: a worker advertising GPU=2
(its GPU ids faked by CUDA_VISIBLE_DEVICES=3,5, no NVIDIA driver here)
shows which command job and user hold each GPU; a worker without GPUs
shows its CPU slots and the job holding one. A worker on a machine whose
GPUs CuPy cannot use (a driver's nvidia-smi faked, no CuPy) says so, and
a training job that could only run there is refused at submit."""
import importlib.util
import os
import sys

import pytest
from distributed import Client
from test_cluster import Processes, wait_until

from dasktrain.cli import main
from dasktrain.cluster.local import worker_info
from dasktrain.config import TrainConfig
from dasktrain.jobs.client.submit import check_resources, submit_command
from dasktrain.jobs.job import JobError, current_user
from dasktrain.jobs.request import JobRequest, Program, Training
from dasktrain.jobs.scheduler.outside_use import busy_outside
from dasktrain.jobs.worker.gpu_use import UNUSABLE_METRIC, USE_METRIC


@pytest.fixture
def cluster(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.close()


def preloaded_worker(procs, resources, visible=None):
    env = None
    if visible is not None:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
    cwd = procs.tmp_path / 'worker-cwd'
    cwd.mkdir(exist_ok=True)
    return procs.spawn('worker', procs.address, '--no-nanny', '--nthreads',
                       '3', '--resources', resources, '--preload',
                       'dasktrain.jobs.worker.preload', '--host',
                       '127.0.0.1',
                       '--local-directory', str(procs.tmp_path / 'space'),
                       cwd=cwd, env=env)


def heartbeat_seen(client):
    def seen(dask_scheduler):
        return all((ws.metrics or {}).get(USE_METRIC)
                   for ws in dask_scheduler.workers.values())
    return client.run_on_scheduler(seen)


def _held(dask_scheduler):
    """Each worker's GPUs held by its jobs, as its last heartbeat says
    (a list: heartbeats come as tuples)."""
    return [list(((ws.metrics or {}).get(USE_METRIC) or {}).get('held')
                 or ()) for ws in dask_scheduler.workers.values()]


def sleeper(client, tmp_path, gpus):
    return submit_command(
        [sys.executable, '-c', 'import time; time.sleep(60)'], gpus=gpus,
        client=client, path=tmp_path / 'jobs', name='nap', grace=1)


def test_gpus_shows_the_job_and_user_holding_each_gpu(cluster, tmp_path,
                                                      capsys):
    preloaded_worker(cluster, 'GPU=2 CPU=1', visible='3,5')
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        wait_until(lambda: heartbeat_seen(client), 30, 'a heartbeat')
        job = sleeper(client, tmp_path, gpus=1)
        wait_until(lambda: job.status()['state'] == 'running', 60,
                   'the job runs')
        try:
            assert main(['gpus', '--scheduler', cluster.address,
                         '--jobs-dir', str(tmp_path / 'jobs')]) == 0
            out = capsys.readouterr().out
            held = job.status()['gpus']
            assert held in (['3'], ['5'])
            free = '5' if held == ['3'] else '3'
            lines = out.splitlines()
            assert lines[0].split() == ['WORKER', 'GPU', 'JOB', 'USER',
                                        'OUTSIDE', 'THE', 'QUEUE']
            row = next(ln for ln in lines if f'  {held[0]}  ' in ln)
            assert f'{job.id} (nap)' in row and current_user() in row
            row = next(ln for ln in lines if f'  {free}  ' in ln)
            assert ' free ' in row
            assert 'CPU slot 1' in out
            assert 'no NVML process list' in out  # no driver here
            # what the queue's planner asks the scheduler: nothing busy
            assert client.run_on_scheduler(busy_outside) == \
                {w: {} for w in client.scheduler_info()['workers']}
            # the worker's heartbeat says which GPU its job holds (what
            # makes a process /proc cannot show there the job's)
            wait_until(lambda: client.run_on_scheduler(_held) == [held], 30,
                       "a heartbeat naming the job's GPU held")
        finally:
            job.cancel(client)


def test_gpus_on_a_machine_without_gpus_lists_cpu_slots(cluster, tmp_path,
                                                        capsys):
    preloaded_worker(cluster, 'CPU=2')
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        job = sleeper(client, tmp_path, gpus=0)
        wait_until(lambda: job.status()['state'] == 'running', 60,
                   'the job runs')
        try:
            assert main(['gpus', '--scheduler', cluster.address,
                         '--jobs-dir', str(tmp_path / 'jobs')]) == 0
            out = capsys.readouterr().out
            slots = [ln for ln in out.splitlines() if 'CPU slot' in ln]
            assert len(slots) == 2
            assert f'{job.id} (nap)' in slots[0] and \
                current_user() in slots[0]
            assert ' free ' in slots[1]
            assert 'NVML' not in out  # no GPU: nothing to say about NVML
        finally:
            job.cancel(client)


@pytest.mark.skipif(importlib.util.find_spec('cupy') is not None,
                    reason='CuPy is installed here')
def test_workers_whose_gpus_cupy_cannot_use_take_no_training_job(
        cluster, gpu_server, tmp_path, capsys):
    # Both on a machine whose driver lists a GPU, without CuPy: one as
    # `cluster start` makes it there (CPU slots only), one given GPU=1 by
    # hand (for programs that need no CuPy).
    preloaded_worker(cluster, 'CPU=1')
    preloaded_worker(cluster, 'GPU=1 CPU=1')
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(2)
        def said():
            return {a: (w.get('metrics') or {}).get(UNUSABLE_METRIC)
                    for a, w in worker_info(client).items()}
        wait_until(lambda: len(said()) == 2 and all(said().values()), 60,
                   'the workers say what their GPUs lack')
        lines = said()
        assert len(set(lines.values())) == 1  # the same machine
        line = next(iter(lines.values()))
        assert line.startswith("nvidia-smi sees 1 GPU, but CuPy cannot use "
                               "it (No module named 'cupy'): install CuPy "
                               'with its CUDA libraries')
        by_hand = next(a for a, w in worker_info(client).items()
                       if w['resources'].get('GPU'))

        def refusal(request):
            with pytest.raises(JobError) as e:
                check_resources(client, request)
            return str(e.value)
        training = Training.of(TrainConfig(model='tiny'))
        assert refusal(JobRequest(training, gpus=1)) == (
            'a training job needs CuPy on its GPUs, and no worker with 1 GPU '
            f'has it: worker {by_hand}: {line}, then start its cluster '
            'again')
        said = refusal(JobRequest(training, gpus=2))
        assert said.startswith('no worker has 2 GPUs (largest: 1 among 2 '
                               'workers); ')
        assert said.endswith(f': {line}, then start its cluster again')
        # what needs no CuPy fits: a program on the GPU, a run on the CPU
        check_resources(client, JobRequest(Program.of(['true']), gpus=1))
        check_resources(client, JobRequest(Training.of(TrainConfig(
            model='tiny', devices=('@numpy',))), gpus=1))
        check_resources(client, JobRequest(training, gpus=0))
    assert main(['submit', '--scheduler', cluster.address, '--jobs-dir',
                 str(tmp_path / 'jobs'), '--', '--model', 'tiny']) == 1
    err = capsys.readouterr().err
    assert err == ('dasktrain submit: error: a training job needs CuPy on '
                   f'its GPUs, and no worker with 1 GPU has it: worker '
                   f'{by_hand}: {line}, then start its cluster again\n')
    assert not (tmp_path / 'jobs').exists() or \
        not any((tmp_path / 'jobs').iterdir())
