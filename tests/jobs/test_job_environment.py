"""A job's environment is its submitter's, plus the queue's own variables,
and nothing of its worker's: on a cluster of one's own (`dasktrain
cluster start`, whose worker's nanny sets OMP_NUM_THREADS=1 and whose
owner's variables reach its processes) and on a `dask worker` joined by
hand; a command job and a training job alike. A shared cluster's: in
test_shared.py. Each submitter is a `dasktrain submit` of its own, with
an environment the test writes whole."""
import json
import os
import subprocess
import sys

import pytest
from children import child
from test_cluster import Processes, wait_until
from test_shared import LINEAR

from dasktrain.jobs.job import DONE, Job
from dasktrain.jobs.worker.environment import job_threads

KEYS = ('SUBMITTER_MARK', 'OWNER_MARK', 'WORKER_MARK', 'OMP_NUM_THREADS',
        'MKL_NUM_THREADS', 'MALLOC_TRIM_THRESHOLD_', 'CUDA_VISIBLE_DEVICES',
        'PYTHONUNBUFFERED')
SHOW = (f'import json, os; print("ENV " + json.dumps({{k: os.environ.get(k) '
        f'for k in {KEYS!r}}}), flush=True)')
# The shared queue's one-layer test model, which first says its environment.
NET = SHOW + '\n' + LINEAR


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(100, 50, 11)


def submitter(tmp_path, **more):
    """A submitter's whole environment: no variable of this test's
    process (a Dask cluster made in it writes the nanny's into it)."""
    return {'PATH': os.environ['PATH'], 'HOME': str(tmp_path),
            'SUBMITTER_MARK': 'mine', **more}


def submit(env, *args):
    done = subprocess.run([sys.executable, '-m', 'dasktrain.cli', 'submit',
                           '--gpus', '0', *args], env=env, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]  # its id, last


def seen(jobs, job_id):
    """The variables the job's program printed (its first ENV line)."""
    job = Job(job_id, jobs / job_id)
    wait_until(lambda: job.status()['state'] in DONE, 180, f'{job_id}')
    assert job.status()['state'] == 'finished', job.logs()
    line = next(line for line in job.logs().splitlines()
                if line.startswith('ENV '))
    return json.loads(line[len('ENV '):])


def both_jobs(tmp_path, data_dir, env, *where):
    """A command job and a training job (its model file says what it
    sees, at import in the job's program) from the submitter ``env``."""
    net = tmp_path / 'net.py'
    net.write_text(NET)
    command = submit(env, *where, '--', sys.executable, '-c', SHOW)
    training = submit(env, *where, '--', '--model', f'{net}:Net',
                      '--epochs', '1', '--batch-size', '50', '--train-size',
                      '100', '--test-size', '50', '--devices', 'cpu',
                      '--data-dir', str(data_dir))
    return command, training


def expect(threads):
    return {'SUBMITTER_MARK': 'mine', 'OWNER_MARK': None, 'WORKER_MARK': None,
            'OMP_NUM_THREADS': str(threads), 'MKL_NUM_THREADS': str(threads),
            'MALLOC_TRIM_THRESHOLD_': None, 'CUDA_VISIBLE_DEVICES': '',
            'PYTHONUNBUFFERED': '1'}


def test_on_a_cluster_of_ones_own(tmp_path, data_dir):
    home, jobs = tmp_path / 'home', tmp_path / 'jobs'
    owner = dict(os.environ, DASKTRAIN_HOME=str(home), OWNER_MARK='owner',
                 DASKTRAIN_JOBS_DIR=str(jobs))
    cli = [sys.executable, '-m', 'dasktrain.cli']
    with child(cli + ['cluster', 'start', '--port', '0', '--dashboard-port',
                      '0', '--gpus', '0', '--cpu-slots', '1'],
               env=owner) as c:
        assert c.wait(120) == 0, c.stderr()
    try:
        env = submitter(tmp_path, DASKTRAIN_HOME=str(home),
                        DASKTRAIN_JOBS_DIR=str(jobs))
        ids = both_jobs(tmp_path, data_dir, env)
        # The worker offers one CPU slot: the job's share is every core.
        want = expect(job_threads(os.sched_getaffinity(0), 0, {'CPU': 1}))
        for job_id in ids:
            assert seen(jobs, job_id) == want
    finally:
        with child(cli + ['cluster', 'stop'], env=owner) as c:
            c.wait(120)


@pytest.fixture
def cluster(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.close()


def test_on_a_dask_worker_joined_by_hand(cluster, tmp_path, data_dir):
    # `dask worker ADDRESS --preload dasktrain.jobs.worker.preload` with a
    # nanny (OMP_NUM_THREADS=1, MALLOC_TRIM_THRESHOLD_ in its worker
    # process) and a variable of whoever started it.
    cluster.spawn('worker', cluster.address, '--nthreads', '3',
                  '--resources', 'CPU=2', '--preload',
                  'dasktrain.jobs.worker.preload', '--host', '127.0.0.1',
                  '--local-directory', str(tmp_path / 'space'),
                  env=dict(cluster.environ(), WORKER_MARK='worker'))
    jobs = tmp_path / 'jobs'
    env = submitter(tmp_path)
    wait_until(lambda: subprocess.run(
        [sys.executable, '-c', 'import sys; from distributed import Client;'
         ' c = Client(sys.argv[1], timeout=10); '
         'sys.exit(0 if c.scheduler_info()["workers"] else 1)',
         cluster.address], capture_output=True).returncode == 0, 60,
        'the worker')
    ids = both_jobs(tmp_path, data_dir, env, '--scheduler', cluster.address,
                    '--jobs-dir', str(jobs))
    want = expect(job_threads(os.sched_getaffinity(0), 0, {'CPU': 2}))
    for job_id in ids:
        assert seen(jobs, job_id) == want
