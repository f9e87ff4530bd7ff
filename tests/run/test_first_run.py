"""A first run works anywhere: without CIFAR-10 and without a network,
``dasktrain train`` trains on the built-in sample of real images (and
says so first, with how to get CIFAR-10); without a GPU it trains a short
run (and says how to ask for the full one); each epoch's line says how
long the run still needs."""
import doctest
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import dasktrain.commands.options as options
import dasktrain.commands.train as train_command
import dasktrain.data.sample as sample
import dasktrain.training.outdir as outdir
import dasktrain.training.progress as progress
from dasktrain.cli import main
from dasktrain.config import TrainConfig


@pytest.mark.parametrize('module', [sample, train_command, progress,
                                    options, outdir])
def test_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_the_sample_is_real_balanced_licensed_and_small():
    x_train, y_train, x_test, y_test = sample.load_sample()
    assert x_train.shape == (4000, 3, 32, 32) and x_train.dtype == np.uint8
    assert x_test.shape == (1000, 3, 32, 32)
    assert np.bincount(y_train).tolist() == [400] * 10
    assert np.bincount(y_test).tolist() == [100] * 10
    # grey in every channel, a black 2-pixel border, real photographs
    # (many grey levels, not a synthetic pattern)
    assert (x_train[:, 0] == x_train[:, 2]).all()
    assert x_train[:, :, :2].max() == 0 and x_train[:, :, -2:].max() == 0
    assert len(np.unique(x_train[:50])) > 200
    assert sample.SAMPLE_FILE.stat().st_size < 3 * 2 ** 20
    licence = sample.SAMPLE_FILE.with_suffix('.LICENSE').read_text()
    assert 'MIT' in licence and 'Zalando SE' in licence
    with zipfile.ZipFile(sample.SAMPLE_FILE) as z:  # no pickles inside
        assert sorted(z.namelist()) == ['x_test.npy', 'x_train.npy',
                                        'y_test.npy', 'y_train.npy']


def test_cifar10_in_the_data_folder_or_a_mirror_needs_no_fallback(tmp_path):
    offline = lambda url: 'offline'  # noqa: E731
    assert sample.cifar10_unavailable(tmp_path, env={}, probe=offline) == \
        f'CIFAR-10 is not in {tmp_path} and offline'
    assert sample.cifar10_unavailable(
        tmp_path, env={'DASKTRAIN_CIFAR10_URL': 'http://m/c.tgz'},
        probe=offline) is None
    (tmp_path / 'cifar-10-batches-py').mkdir()
    assert sample.cifar10_unavailable(tmp_path, env={}, probe=offline) \
        is None


def test_a_closed_port_is_unreachable_in_words():
    import socket
    with socket.socket() as s:  # a port nobody listens on
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    why = sample.reachable(f'http://127.0.0.1:{port}/x', timeout=2)
    assert why is not None and f'127.0.0.1:{port}' in why


def test_offline_without_a_gpu_the_first_run_trains_on_the_sample(
        tmp_path, monkeypatch, capsys):
    # The official host unreachable, as on a machine without a network.
    monkeypatch.setattr(sample, 'reachable',
                        lambda url, timeout=3.0: 'offline (test)')
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv('DASKTRAIN_CIFAR10_URL', raising=False)
    assert main(['train', '--model', 'tiny', '--out', 'first']) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith('CIFAR-10 is not in data and offline (test): '
                               'training on the built-in sample instead')
    assert 'copy cifar-10-python.tar.gz into data/' in lines[0]
    assert lines[1].startswith('no GPU: a short run, 2 epochs of 2,000 '
                               'training images')
    assert 'pass --epochs 20' in lines[1]
    epoch1 = next(line for line in lines if line.startswith('epoch   1/2'))
    assert ' ETA ' in epoch1
    args = TrainConfig.from_json((tmp_path / 'first' / 'args').read_text())
    assert (args.dataset, args.epochs, args.train_size, args.test_size) == \
        ('sample', 2, 2000, 1000)
    done = next(line for line in lines if line.startswith('done:'))
    accuracy = float(done.split('test accuracy ')[1].split(',')[0])
    assert accuracy > 0.6  # Fashion-MNIST learns fast: 10 classes, not 0.1
    assert not (tmp_path / 'data').exists() or \
        not any((tmp_path / 'data').iterdir())


def test_a_named_dataset_or_size_is_trained_as_asked(tmp_path, monkeypatch,
                                                     capsys):
    monkeypatch.setattr(sample, 'reachable',
                        lambda url, timeout=3.0: 'offline (test)')
    monkeypatch.chdir(tmp_path)
    # --dataset cifar10 named: no fallback, the download's one line
    assert main(['train', '--dataset', 'cifar10', '--url',
                 'http://127.0.0.1:9/cifar-10-python.tar.gz']) == 1
    err = capsys.readouterr().err
    assert 'cannot download http://127.0.0.1:9/' in err
    # a size named: no short run
    config = train_command.Train.first_run(
        TrainConfig(dataset='sample', epochs=1), {'dataset', 'epochs'})
    assert (config.epochs, config.train_size) == (1, None)


@pytest.mark.skipif(importlib.util.find_spec('cupy') is not None,
                    reason='CuPy is installed here')
def test_a_gpu_server_without_cupy_refuses_to_train_on_its_cpu(gpu_server,
                                                               tmp_path):
    # The real command, on a machine whose driver lists a GPU (a fake
    # nvidia-smi first on PATH) and without CuPy: one line, exit 1,
    # nothing trained, nothing written; with --devices cpu it trains.
    command = [str(Path(sys.executable).with_name('dasktrain')), 'train',
               '--model', 'tiny']
    env = dict(os.environ, PATH=gpu_server)
    done = subprocess.run(command + ['--out', 'refused'], cwd=tmp_path,
                          env=env, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout) == (1, '')
    assert done.stderr.splitlines() == [
        "dasktrain train: error: nvidia-smi sees 1 GPU, but CuPy cannot use "
        "it (No module named 'cupy'): install CuPy with its CUDA libraries: "
        "`make install` in dasktrain's checkout (it picks them for the "
        "driver), or pip install 'dasktrain[cuda13]' for a CUDA 13 driver "
        "('dasktrain[cuda12]' for CUDA 12; docs/install.md); or pass "
        '--devices cpu to train on the CPU']
    assert not (tmp_path / 'refused').exists()
    done = subprocess.run(command + [
        '--devices', 'cpu', '--dataset', 'sample', '--epochs', '1',
        '--train-size', '256', '--test-size', '128', '--out', 'cpu'],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == \
        'training on the CPU, 1 replica (@numpy)'
    assert 'done: epoch 1, test accuracy ' in done.stdout
    assert 'CuPy' not in done.stdout + done.stderr  # asked for: no warning


def test_each_train_run_gets_a_folder_of_its_own_and_refusals_come_first(
        tmp_path, monkeypatch, capsys):
    # README's next commands after `make train`: another `dasktrain train`
    # trains into a new folder under runs/, never meeting the first's
    # checkpoint; a refusal is the only line, before any other.
    monkeypatch.setattr(sample, 'reachable',
                        lambda url, timeout=3.0: 'offline (test)')
    monkeypatch.chdir(tmp_path)
    small = ['--model', 'tiny', '--epochs', '1', '--train-size', '200',
             '--test-size', '100', '--no-progress']
    for _ in range(2):
        assert main(['train', *small]) == 0
    first, second = sorted((tmp_path / 'runs').iterdir())
    assert first.name.startswith('train-') and \
        second.name.startswith('train-')
    assert (first / 'checkpoint.npz').is_file()
    assert (second / 'checkpoint.npz').is_file()
    done = capsys.readouterr().out
    assert f'outputs in runs/{second.name}' in done
    # A run into a folder that holds one: refused, nothing said before
    # (no sample line, no short-run line), nothing trained.
    assert main(['train', '--model', 'tiny', '--out', str(first)]) == 1
    out, err = capsys.readouterr()
    assert out == ''
    assert err.splitlines() == [
        f'dasktrain train: error: {first} already holds a run '
        '(checkpoint.npz); pass --resume to continue it, or choose another '
        '--out']
    # --resume names the folder it continues: the newest, as a hint
    assert main(['train', '--resume']) == 1
    out, err = capsys.readouterr()
    assert out == ''
    assert err.splitlines() == [
        'dasktrain train: error: --resume continues the run in --out: pass '
        f'--out runs/{second.name} (the newest run here)']
    # a folder another run holds now: the same, one line first
    from dasktrain.training.outdir import claim
    with claim(tmp_path / 'busy'):
        assert main(['train', '--model', 'tiny', '--out', 'busy']) == 1
    out, err = capsys.readouterr()
    assert out == ''
    assert err.startswith('dasktrain train: error: --out busy is in use by '
                          f'another run (pid {os.getpid()} on ')
    assert len(os.listdir(tmp_path / 'runs')) == 2


@pytest.mark.skipif(importlib.util.find_spec('cupy') is not None,
                    reason='CuPy is installed here')
def test_a_device_that_is_not_there_is_refused_before_anything_is_said(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sample, 'reachable',
                        lambda url, timeout=3.0: 'offline (test)')
    monkeypatch.chdir(tmp_path)
    assert main(['train', '--devices', '0', '--model', 'tiny']) == 1
    out, err = capsys.readouterr()
    assert out == ''
    assert err.splitlines() == [
        "dasktrain train: error: device '@cupy:0' is not available (No "
        "module named 'cupy'); available: @numpy"]
    assert not (tmp_path / 'runs').exists()


def test_a_run_stopped_by_sigterm_before_its_first_checkpoint_leaves_nothing(
        tmp_path):
    # `kill PID` (SIGTERM) while the first epoch trains: the folder the
    # run created goes, as after Ctrl-C; one line, no traceback.
    import signal
    import time

    from children import child
    with child('train', '--dataset', 'sample', '--model', 'tiny',
               '--epochs', '1', '--train-size', '2000', '--out', 'r',
               cwd=tmp_path) as run:
        deadline = time.monotonic() + 120
        while not (tmp_path / 'r' / 'args').exists() and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / 'r' / 'args').exists()
        assert not (tmp_path / 'r' / 'checkpoint.npz').exists()
        run.signal(signal.SIGTERM)
        assert run.wait(60) == 130
        err = run.stderr()
    assert 'Traceback' not in err
    assert err.strip().splitlines()[-1] == 'dasktrain train: interrupted'
    assert not (tmp_path / 'r').exists()
