"""ChainerMN's own examples (tests/chainermn/examples, Chainer v7.8.1's,
byte for byte) and the project's model- and dual-parallel scripts
(bench/chainermn_example) run unchanged under ``dasktrain launch`` as
under ``mpiexec`` with real ChainerMN: the same accuracy curve and, for
the project's (float64), the same parameters.

The data is small and synthetic, in Chainer's dataset cache
(``CHAINER_DATASET_ROOT``): nothing is downloaded. ChainerMN's examples
do not seed NumPy, so both runs get a ``sitecustomize`` that seeds it per
rank. The ``mpiexec`` halves skip, saying why, where Open MPI or mpi4py is
missing."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_chainermn import _mpi_problem, launch, mpiexec

TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS / 'examples'
PROJECT = TESTS.parents[1] / 'bench' / 'chainermn_example'
MPI = _mpi_problem()
SEED = '''import os
import numpy
numpy.random.seed(1000 + int(os.environ.get('DASKTRAIN_RANK') or
                             os.environ.get('OMPI_COMM_WORLD_RANK') or 0))
'''


@pytest.fixture
def world(tmp_path, monkeypatch):
    """Chainer's MNIST and CIFAR-10 caches with small random data, and
    NumPy seeded per rank at every start-up."""
    rng = np.random.RandomState(0)
    mnist = tmp_path / 'datasets' / 'pfnet' / 'chainer' / 'mnist'
    mnist.mkdir(parents=True)
    for name, n in (('train', 160), ('test', 40)):
        np.savez_compressed(mnist / f'{name}.npz',
                            x=rng.randint(0, 256, (n, 784)).astype(np.uint8),
                            y=rng.randint(0, 10, n).astype(np.uint8))
    cifar = mnist.parent / 'cifar'
    cifar.mkdir()
    np.savez_compressed(
        cifar / 'cifar-10.npz',
        train_x=rng.randint(0, 256, (16, 3072)).astype(np.uint8),
        train_y=rng.randint(0, 10, 16).astype(np.uint8),
        test_x=rng.randint(0, 256, (8, 3072)).astype(np.uint8),
        test_y=rng.randint(0, 10, 8).astype(np.uint8))
    seeded = tmp_path / 'seeded'
    seeded.mkdir()
    (seeded / 'sitecustomize.py').write_text(SEED)
    monkeypatch.setenv('CHAINER_DATASET_ROOT', str(tmp_path / 'datasets'))
    monkeypatch.setenv('PYTHONPATH', str(seeded))
    for blas in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS'):
        monkeypatch.setenv(blas, '1')  # as launch gives CPU ranks
    return tmp_path


def under_launch(folder, n, script, *args, fails=False):
    code, out, err = launch(folder, n, [script, *args, '--out',
                                        folder / 'dask'], timeout=300)
    assert (code != 0) if fails else (code == 0), err
    return err


def under_mpiexec(folder, n, script, *args, fails=False):
    argv, env = mpiexec(n)
    env['CHAINERMN_FORCE_ABORT_ON_EXCEPTION'] = '1'  # no hang on a failure
    for name in ('PYTHONPATH', 'CHAINER_DATASET_ROOT', 'OMP_NUM_THREADS',
                 'OPENBLAS_NUM_THREADS', 'CHAINERMN_FORCE_ABORT_ON_EXCEPTION',
                 'CHAINER_DTYPE'):
        if name in env:
            argv += ['-x', name]
    done = subprocess.run(
        [*argv, sys.executable, TESTS / 'ranks' / 'under_mpi.py',
         script, *map(str, args), '--out', folder / 'mpi'], cwd=folder,
        env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode != 0) if fails else (done.returncode == 0), \
        done.stderr[-3000:]
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


needs_mpi = pytest.mark.skipif(MPI is not None, reason=str(MPI))


@pytest.mark.parametrize('n, name', [
    (2, 'train_mnist_model_parallel.py'),
    (4, 'train_mnist_dual_parallel.py')], ids=['model', 'dual'])
def test_chainermn_mnist_examples_run_unchanged(world, n, name):
    """The dual-parallel example scatters its data in an order drawn
    from the operating system's entropy (``scatter_dataset(...,
    shuffle=True)`` without a seed): its two runs train on different
    splits, and only their shape is compared."""
    args = ['--epoch', '2', '--batchsize', '16', '--unit', '20']
    under_launch(world, n, EXAMPLES / 'mnist' / name, *args)
    assert len(curve(world / 'dask')) == 2
    if MPI is not None:
        return
    under_mpiexec(world, n, EXAMPLES / 'mnist' / name, *args)
    if n == 2:
        same_curves(world, 2)
    else:
        assert [row[0] for row in curve(world / 'mpi')] == [1, 2]
        assert sorted(json.loads((world / 'dask' / 'log').read_text())[0]) \
            == sorted(json.loads((world / 'mpi' / 'log').read_text())[0])


CHAINER_7 = '''        super(ParallelConvolution2D, self).__init__(
            self._in_channel_size, self._out_channel_size, *args, **kwargs)
'''


def test_chainermn_parallel_convolution_example(world):
    """As it ships, the example fails with Chainer 7.8.1 on more than one
    rank, under ``launch`` as under ``mpiexec``: its ParallelConvolution2D
    reads ``self.in_channels`` for its channels, which Chainer 7's
    Convolution2D overwrites with the rank's share. Those two attributes
    restored after that line, it trains, the same under both."""
    script = EXAMPLES / 'parallel_convolution' / 'train.py'
    args = ['--epoch', '1', '--batchsize', '8']
    err = under_launch(world, 2, script, *args, fails=True)
    assert 'Expect: in_types[0].shape[1] == in_types[1].shape[1] * 1' in err
    if MPI is None:
        out = under_mpiexec(world, 2, script, *args, fails=True)
        assert 'Expect: in_types[0].shape[1] == in_types[1].shape[1] * 1' \
            in out
    fixed = world / 'fixed'
    shutil.copytree(EXAMPLES / 'parallel_convolution', fixed)
    text = (fixed / 'VGG.py').read_text()
    assert CHAINER_7 in text
    (fixed / 'VGG.py').write_text(text.replace(CHAINER_7, CHAINER_7 + (
        '        self.in_channels, self.out_channels = '
        'in_channels, out_channels\n')))
    under_launch(world, 2, fixed / 'train.py', *args)
    assert (world / 'dask' / 'accuracy.png').exists()  # its PlotReport
    if MPI is None:
        under_mpiexec(world, 2, fixed / 'train.py', *args)
        same_curves(world, 1)


@pytest.mark.equivalence
@pytest.mark.parametrize('n, name', [
    (2, 'train_mnist_model_parallel.py'),
    (4, 'train_mnist_dual_parallel.py')], ids=['model', 'dual'])
@needs_mpi
def test_the_project_scripts_as_under_mpiexec(tmp_path, float64, n, name,
                                              monkeypatch):
    for blas in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS'):
        monkeypatch.setenv(blas, '1')
    args = ['--epoch', '2', '--n-train', '160', '--n-test', '48',
            '--batchsize', '16', '--unit', '20']
    under_launch(tmp_path, n, PROJECT / name, *args)
    under_mpiexec(tmp_path, n, PROJECT / name, *args)
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
