"""The project's scripts in ChainerMN's style (bench/chainermn_example:
model parallel, model and data parallel, channel-parallel convolutions)
run unchanged under ``dasktrain launch`` as under ``mpiexec`` with real
ChainerMN: the same accuracy curve and (float64) the same parameters.

The data is small and synthetic, made by each script: nothing is
downloaded. The ``mpiexec`` halves skip, saying why, where Open MPI or
mpi4py is missing. (Whether ChainerMN's own examples run unmodified is a
measurement to make on fetched copies, not code the project holds.)"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_chainermn import _mpi_problem, launch, mpiexec

TESTS = Path(__file__).resolve().parent
PROJECT = TESTS.parents[1] / 'bench' / 'chainermn_example'
MPI = _mpi_problem()
SCRIPTS = [  # (ranks, script, its arguments)
    (2, 'train_mnist_model_parallel.py',
     ['--n-train', '160', '--n-test', '48', '--batchsize', '16',
      '--unit', '20']),
    (4, 'train_mnist_dual_parallel.py',
     ['--n-train', '160', '--n-test', '48', '--batchsize', '16',
      '--unit', '20']),
    (2, 'train_parallel_convolution.py',
     ['--n-train', '32', '--n-test', '16', '--batchsize', '8'])]
IDS = ['model', 'dual', 'convolution']


@pytest.fixture
def one_thread(monkeypatch):
    for blas in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS'):
        monkeypatch.setenv(blas, '1')  # as launch gives CPU ranks


def under_launch(folder, n, script, *args):
    code, out, err = launch(folder, n, [script, *args, '--out',
                                        folder / 'dask'], timeout=300)
    assert code == 0, err
    return err


def under_mpiexec(folder, n, script, *args):
    argv, env = mpiexec(n)
    env['CHAINERMN_FORCE_ABORT_ON_EXCEPTION'] = '1'  # no hang on a failure
    for name in ('PYTHONPATH', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS',
                 'CHAINERMN_FORCE_ABORT_ON_EXCEPTION', 'CHAINER_DTYPE'):
        if name in env:
            argv += ['-x', name]
    done = subprocess.run(
        [*argv, sys.executable, TESTS / 'ranks' / 'under_mpi.py',
         script, *map(str, args), '--out', folder / 'mpi'], cwd=folder,
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def curve(folder):
    log = json.loads((folder / 'log').read_text())
    return [(row['epoch'], row['main/loss'], row['validation/main/accuracy'])
            for row in log]


def same_curves(tmp_path, epochs):
    dask, mpi = curve(tmp_path / 'dask'), curve(tmp_path / 'mpi')
    assert [row[0] for row in dask] == list(range(1, epochs + 1))
    np.testing.assert_allclose(np.array(dask), np.array(mpi), rtol=0,
                               atol=1e-6)


@pytest.mark.parametrize('n, name, args', SCRIPTS, ids=IDS)
def test_the_project_scripts_run_under_launch(tmp_path, one_thread, n, name,
                                              args):
    under_launch(tmp_path, n, PROJECT / name, '--epoch', '2', *args)
    assert [row[0] for row in curve(tmp_path / 'dask')] == [1, 2]
    for r in range(n):  # every rank's part of the model, trained
        assert (tmp_path / 'dask' / f'model{r}.npz').exists()
    if name == 'train_parallel_convolution.py':  # rank 0's PlotReports
        for figure in ('loss.png', 'accuracy.png'):
            assert (tmp_path / 'dask' / figure).read_bytes()[:4] == \
                b'\x89PNG'


@pytest.mark.equivalence
@pytest.mark.parametrize('n, name, args', SCRIPTS, ids=IDS)
@pytest.mark.skipif(MPI is not None, reason=str(MPI))
def test_the_project_scripts_as_under_mpiexec(tmp_path, float64, one_thread,
                                              n, name, args):
    under_launch(tmp_path, n, PROJECT / name, '--epoch', '2', *args)
    under_mpiexec(tmp_path, n, PROJECT / name, '--epoch', '2', *args)
    same_curves(tmp_path, 2)
    for r in range(n):
        dask, mpi = (np.load(tmp_path / d / f'model{r}.npz')
                     for d in ('dask', 'mpi'))
        assert sorted(dask.files) == sorted(mpi.files)
        for key in dask.files:
            np.testing.assert_allclose(dask[key], mpi[key], rtol=0,
                                       atol=1e-10, err_msg=f'{r} {key}')


@pytest.mark.skipif(importlib.util.find_spec('mpi4py') is None,
                    reason="run alone, a script's `import chainermn` is "
                    "ChainerMN's own, which needs mpi4py (pip install -e "
                    "'.[mpi]')")
def test_the_project_scripts_run_alone_as_one_rank_says_why():
    """Outside a launch a model-parallel script is a job of one rank,
    which the example refuses with its own message (as under MPI)."""
    run = subprocess.run([sys.executable,
                          PROJECT / 'train_mnist_model_parallel.py'],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ))
    assert run.returncode != 0
    assert 'This example runs on exactly 2 processes.' in run.stderr
