import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import chainer
import numpy as np
import pytest
from cifar_fixture import ArchiveServer, make_batches, write_archive

import dasktrain  # noqa: F401  (restores numpy.sctypes before chainer)
from dasktrain.data import extract_archive

# A shell's background job (`make test &`, nohup) starts with SIGINT
# ignored, which every child would inherit: the tests of a terminal's
# Ctrl-C need its default, as a terminal gives it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The suite follows the package's folders; a test may import another's
# helpers by module name wherever it lies (``from test_cluster import
# Processes``), and the checkout's tools (not installed: nothing runs them
# at run time) for the tests that hold their decisions: ``import nbrun``.
TESTS = Path(__file__).resolve().parent
FOLDERS = [TESTS] + sorted(p for p in TESTS.iterdir()
                           if p.is_dir() and p.name != '__pycache__')
sys.path.extend(str(p) for p in FOLDERS[1:] + [TESTS.parent / 'tools']
                if str(p) not in sys.path)

# Hermetic: the suite talks to no queue it did not start. A cluster of the
# machine's user (~/.dasktrain), a shared queue running on the machine
# (/var/lib/dasktrain) or one a shell names ($DASKTRAIN_QUEUE) is never
# found: every process the suite starts inherits this, and a test that
# wants a cluster of its own or a shared place names it.
QUIET = Path(tempfile.mkdtemp(prefix='dasktrain-suite-'))
os.environ.update({'DASKTRAIN_HOME': str(QUIET / 'home'),
                   'DASKTRAIN_SHARED_DIR': str(QUIET / 'no-shared-queue')})
for name in ('QUEUE', 'JOBS_DIR', 'NOTIFY', 'NOTIFY_ALLOW', 'BUSY_MIB',
             'MAX_GRACE', 'PIDS_PER_JOB', 'MAX_QUEUED', 'MAX_BYTES',
             'KEEP_FINISHED', 'CONTAIN', 'CLUSTER_MARK', 'SHARED_SERVE',
             'SHARED_OWNER', 'JOB_MARK'):  # a cluster's, or a job's
    os.environ.pop(f'DASKTRAIN_{name}', None)


def pytest_unconfigure(config):
    shutil.rmtree(QUIET, ignore_errors=True)  # the suite's own, gone


@pytest.fixture
def float64(monkeypatch):
    """Chainer in float64 while the test runs: links made now get float64
    parameters (``chainer.global_config.dtype``, which every thread sees),
    and so do processes started now (``CHAINER_DTYPE``: Dask workers, job
    children); inputs are cast to the model's dtype.

    An equivalence test compares two orders of the same sums; in float32
    they differ in the last bits with the BLAS kernel (OpenBLAS picks one
    per CPU) and its thread count, and Adam, momentum and BatchNorm
    magnify that past any fixed tolerance. In float64 the same
    differences are ~1e-16 relative, so a tolerance of 1e-10 proves the
    maths on any machine and still catches a wrong sum.
    """
    monkeypatch.setenv('CHAINER_DTYPE', 'float64')
    before = chainer.global_config.dtype
    chainer.global_config.dtype = np.dtype(np.float64)
    try:
        yield np.float64
    finally:
        chainer.global_config.dtype = before


@pytest.fixture
def gpu_server(tmp_path, monkeypatch):
    """This process made to look like a GPU server with only the NVIDIA
    driver: an ``nvidia-smi`` first on ``PATH`` that lists one H100 (and,
    without ``-L``, prints the header of a CUDA 13.0 driver), no
    ``CUDA_VISIBLE_DEVICES``. Processes started now inherit it. Returns
    the ``PATH`` it set. (CuPy is as this machine has it: absent on the
    CPU machines the suite runs on; a test that needs it absent checks.)
    """
    folder = tmp_path / 'driver-bin'
    folder.mkdir()
    smi = folder / 'nvidia-smi'
    smi.write_text(
        '#!/bin/sh\n'
        'if [ "$1" = "-L" ]; then\n'
        '  echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: '
        'GPU-5e0b7bd2-6b2c-4bd2-a3c3-2f9b0c1d2e3f)"\n'
        'else\n'
        '  echo "| NVIDIA-SMI 580.65.06   Driver Version: 580.65.06   '
        'CUDA Version: 13.0 |"\n'
        'fi\n')
    smi.chmod(0o755)
    path = f'{folder}{os.pathsep}{os.environ.get("PATH", "")}'
    monkeypatch.setenv('PATH', path)
    monkeypatch.delenv('CUDA_VISIBLE_DEVICES', raising=False)
    return path


@pytest.fixture(scope='session')
def cifar_batches():
    """Arrays of the small CIFAR-format fixture: 5 x 20 train, 20 test."""
    return make_batches()


@pytest.fixture(scope='session')
def cifar_archive(tmp_path_factory, cifar_batches):
    """(path, md5) of the fixture archive, written once per session."""
    path = tmp_path_factory.mktemp('mirror') / 'cifar-10-python.tar.gz'
    return path, write_archive(path, cifar_batches)


@pytest.fixture
def archive_server(cifar_archive):
    """A real HTTP server on 127.0.0.1 serving the fixture archive."""
    with ArchiveServer(cifar_archive[0].parent) as server:
        yield server


@pytest.fixture(scope='session')
def make_cifar_dir(tmp_path_factory):
    """make(per_batch, n_test, seed): a data dir with an extracted archive
    of 5 training batches of ``per_batch`` images and ``n_test`` tests."""
    def make(per_batch, n_test, seed):
        root = tmp_path_factory.mktemp('cifar')
        write_archive(root / 'a.tar.gz', make_batches(
            n_train=(per_batch,) * 5, n_test=n_test, seed=seed))
        extract_archive(root / 'a.tar.gz', root)
        return root
    return make


@pytest.fixture
def cifar_dir(tmp_path, cifar_archive):
    """A data dir holding the extracted fixture, ready for load_cifar10."""
    extract_archive(cifar_archive[0], tmp_path)
    return tmp_path


@pytest.fixture(scope='session')
def local_cluster():
    """A real 2-process dask.distributed cluster on 127.0.0.1."""
    from distributed import LocalCluster
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      host='127.0.0.1', dashboard_address=None) as cluster:
        yield cluster


@pytest.fixture
def dask_client(local_cluster):
    from distributed import Client
    with Client(local_cluster) as client:
        yield client


@pytest.fixture(autouse=True)
def dask_default_scheduler_untouched():
    """No test (nor the code under it) may leave dask pointed at a client
    that is gone: later computes would fail far from the cause."""
    import dask
    before = dask.config.config.get('scheduler', '<unset>')
    yield
    assert dask.config.config.get('scheduler', '<unset>') == before


@pytest.fixture
def listening():
    """listening(pids): {(pid, ip, port)} of the sockets that the
    processes ``pids`` and all their descendants listen on (psutil)."""
    import psutil

    def listening(pids):
        found = set()
        for pid in pids:
            try:
                root = psutil.Process(pid)
                family = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for process in family:
                try:
                    connections = process.net_connections('inet')
                except psutil.NoSuchProcess:
                    continue
                found |= {(process.pid, c.laddr.ip, c.laddr.port)
                          for c in connections
                          if c.status == psutil.CONN_LISTEN}
        return found
    return listening
