"""The GPU suite (`make test-gpu`): the CuPy and NCCL paths on real GPUs.
Every test says what it needs (gpu_marks.needs) and is skipped, with the
reason, where a machine has less; `make test` collects it too."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest


class GpuCluster:
    """A `dask scheduler` and workers, each worker seeing the GPUs given
    to it through CUDA_VISIBLE_DEVICES (as one worker per GPU runs)."""

    def __init__(self, tmp_path):
        self.tmp_path, self.procs = tmp_path, []
        info = tmp_path / 'scheduler.json'
        self._spawn(['scheduler', '--host', '127.0.0.1', '--port', '0',
                     '--dashboard-address', '127.0.0.1:0',
                     '--scheduler-file', str(info)], os.environ)
        deadline = time.monotonic() + 60
        while not (info.exists() and info.read_text().strip()):
            assert time.monotonic() < deadline, 'no scheduler'
            time.sleep(0.1)
        self.address = json.loads(info.read_text())['address']

    def _spawn(self, args, env):
        self.procs.append(subprocess.Popen(
            [sys.executable, '-m', 'dask', *args], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True))

    def worker(self, visible=None, resources='GPU=1', nthreads=2):
        env = dict(os.environ)
        if visible is not None:
            env['CUDA_VISIBLE_DEVICES'] = visible
        self._spawn(['worker', self.address, '--no-nanny', '--nthreads',
                     str(nthreads), '--resources', resources, '--host',
                     '127.0.0.1', '--local-directory',
                     str(self.tmp_path / 'space')], env)

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def gpu_cluster(tmp_path):
    cluster = GpuCluster(tmp_path)
    yield cluster
    cluster.close()
