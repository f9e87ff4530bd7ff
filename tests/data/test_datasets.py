"""A lab's own data (`--dataset`): npz files and functions of their own,
1-channel 16x16 images and feature vectors, CIFAR-100 from an archive
served over HTTP here; every mistake one line; resume bit-identical."""
import hashlib
import io
import json
import tarfile

import dask.array as da
import numpy as np
import pytest
from cifar_fixture import ArchiveServer, py2_pickle

from dasktrain.cli import main
from dasktrain.config import TrainConfig
from dasktrain.data.datasets import load_dataset
from dasktrain.errors import DataError
from dasktrain.run.train import train

NETS = '''
import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np


class Small(chainer.Chain):
    """A convnet for 1-channel images of any size."""

    def __init__(self, n_classes=10):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(None, 8, 3, pad=1)
            self.fc = L.Linear(None, n_classes)

    def forward(self, x):
        return self.fc(F.max_pooling_2d(F.relu(self.conv(x)), 2))


class MLP(chainer.Chain):
    def __init__(self, n_classes=10):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(None, 32)
            self.l2 = L.Linear(32, n_classes)

    def forward(self, x):
        return self.l2(F.relu(self.l1(x)))


def features():
    """Feature vectors as Dask arrays: 4 classes around their centres."""
    import dask.array as da
    rng = np.random.RandomState(0)
    centres = rng.randn(4, 20) * 2

    def make(n):
        y = rng.randint(0, 4, n)
        x = centres[y] + rng.randn(n, 20)
        return da.from_array(x.astype(np.float32), chunks=100), y
    return make(400) + make(100)


def failing():
    return 1 / 0
'''


def gray(n, seed=0, classes=5):
    """1-channel 16x16 uint8 images, N x H x W x C, learnable."""
    rng = np.random.RandomState(seed)
    y = rng.randint(0, classes, n)
    x = y[:, None, None] * 40 + rng.randint(0, 60, (n, 16, 16))
    return x[..., None].astype(np.uint8), y


@pytest.fixture
def lab(tmp_path, monkeypatch):
    folder = tmp_path / 'lab'
    folder.mkdir()
    (folder / 'nets.py').write_text(NETS)
    (x, y), (xt, yt) = gray(300), gray(100, 1)
    np.savez(folder / 'gray.npz', x_train=x, y_train=y, x_test=xt,
             y_test=yt)
    monkeypatch.chdir(folder)
    return folder


def run_args(out, *more):
    return ['train', '--epochs', '3', '--batch-size', '20', '--lr', '0.01',
            '--out', str(out), '--no-progress', *more]


@pytest.mark.parametrize('devices', ['cpu', 'cpu:2'])
def test_gray_16x16_images_from_an_npz_file(lab, devices, capsys):
    assert main(run_args(lab / 'r', '--model', 'nets.py:Small',
                         '--dataset', 'npz:gray.npz', '--devices',
                         devices)) == 0
    rows = json.loads((lab / 'r' / 'log').read_text())
    assert rows[-1]['validation/main/accuracy'] > 0.5  # chance: 0.2
    data = json.loads((lab / 'r' / 'args').read_text())['data']
    x, _ = gray(300)
    assert data['input_shape'] == [1, 16, 16] and data['n_classes'] == 5
    assert data['layout'] == 'N x H x W x C, transposed'
    np.testing.assert_allclose(data['mean'], [x.mean()], rtol=1e-9)
    np.testing.assert_allclose(data['std'], [x.std()], rtol=1e-9)


@pytest.mark.parametrize('devices', ['cpu', 'cpu:2'])
def test_auto_augmentation_flips_only_the_built_in_natural_images(
        lab, devices, capsys):
    """A lab's own images are cropped, never flipped by default (a
    mirrored digit is another digit, or none); the run says so first,
    here and where ranks train (one process per device)."""
    data = load_dataset('npz:gray.npz', 'data')
    assert data.augmentation('auto') == {'pad': 2, 'flip': False}
    assert data.augmentation(True) == {'pad': 2, 'flip': False}
    assert data.augmentation('crop-flip') == {'pad': 2, 'flip': True}
    assert data.augmentation('none') is None
    from dasktrain.data.datasets import augmentation_plan
    assert augmentation_plan('cifar100', True, (32,))[0] == \
        {'pad': 4, 'flip': True}
    assert main(['train', '--epochs', '1', '--batch-size', '20',
                 '--out', str(lab / 'r'), '--model', 'nets.py:Small',
                 '--dataset', 'npz:gray.npz', '--devices', devices]) == 0
    lines = capsys.readouterr().out.splitlines()
    said = [line for line in lines if line.startswith('augmentation:')]
    assert said == ['augmentation: random crop (padding 2), no flip: '
                    '--augment auto, on your own images, whose meaning a '
                    'flip may change (digits, text); --augment crop-flip '
                    'flips them']
    assert lines.index(said[0]) <= 4  # among the first lines
    assert main(['train', '--epochs', '1', '--batch-size', '20',
                 '--out', str(lab / 'f'), '--model', 'nets.py:Small',
                 '--dataset', 'npz:gray.npz', '--devices', devices,
                 '--augment', 'crop-flip']) == 0
    assert 'augmentation: random crop (padding 2), horizontal flip: ' \
        '--augment crop-flip' in capsys.readouterr().out


def test_feature_vectors_from_a_function_of_their_own(lab, capsys):
    assert main(run_args(lab / 'r', '--model', 'nets.py:MLP', '--dataset',
                         'nets.py:features', '--devices', 'cpu:2')) == 0
    out = capsys.readouterr().out
    rows = json.loads((lab / 'r' / 'log').read_text())
    assert rows[-1]['validation/main/accuracy'] > 0.5  # chance: 0.25
    data = json.loads((lab / 'r' / 'args').read_text())['data']
    assert data['images'] is False and data['mean'] is None
    assert data['input_shape'] == [20] and data['n_classes'] == 4
    assert 'done: epoch 3' in out


def test_dask_inputs_stay_lazy(lab):
    x = da.random.random((1000, 20), chunks=250).astype(np.float32)
    y = da.from_array(np.arange(1000) % 3, chunks=250)
    from dasktrain.data.datasets import from_arrays
    data = from_arrays('mine', x, y, x[:100], y[:100])
    assert isinstance(data.train_images, da.Array)
    assert data.train_images.chunks == x.chunks  # not read into memory
    assert data.n_classes == 3 and not data.images


@pytest.mark.parametrize('arrays,message', [
    (dict(y_test=None), 'has no y_test (it holds x_train, y_train, '
                        'x_test)'),
    (dict(y_train=np.zeros(299, int)), 'y_train has shape (299,) for 300 '
                                       'inputs'),
    (dict(y_test=np.full(100, 7)), 'y_test holds label 7, outside 0..4'),
    (dict(y_train=np.full(300, -1)), 'y_train holds label -1'),
    (dict(x_train=np.full((300, 16, 16, 1), np.nan)), 'x_train holds 76800 '
                                                     'NaN or inf values'),
    (dict(x_test=np.zeros((0, 16, 16, 1), np.uint8),
          y_test=np.zeros(0, int)), 'x_test is empty'),
    (dict(y_train=np.zeros(300)), 'y_train must hold integer class labels'),
    (dict(x_test=np.zeros((100, 8, 8, 1), np.uint8)),
     'x_train inputs are (1, 16, 16) but x_test inputs (1, 8, 8)'),
])
def test_every_mistake_in_the_data_is_one_line(lab, arrays, message,
                                               capsys):
    (x, y), (xt, yt) = gray(300), gray(100, 1)
    given = dict(x_train=x, y_train=y, x_test=xt, y_test=yt)
    given.update(arrays)
    np.savez(lab / 'bad.npz', **{k: v for k, v in given.items()
                                 if v is not None})
    assert main(run_args(lab / 'r', '--model', 'nets.py:Small',
                         '--dataset', 'npz:bad.npz')) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (lab / 'r' / 'checkpoint.npz').exists()


@pytest.mark.parametrize('argv,message', [
    (['--dataset', 'npz:none.npz'], 'no file none.npz'),
    (['--dataset', 'nets.py:nothing'], "nets.py has no attribute "
                                       "'nothing'"),
    (['--dataset', 'cifar1000'],
     'must be cifar10, cifar100, sample, npz:PATH'),
    (['--model', 'nets.py:MLP', '--dataset', 'nets.py:features',
      '--augment', 'crop-flip'], 'crops and flips images'),
    (['--dataset', 'npz:gray.npz'], '--model cifar10 takes images of 3 x H '
                                    'x W; npz:'),
])
def test_every_wrong_dataset_option_is_one_line(lab, argv, message, capsys):
    argv = argv if '--model' in argv else argv + ['--model', 'cifar10'] \
        if 'gray' in argv[1] else argv + ['--model', 'nets.py:Small']
    assert main(run_args(lab / 'r', *argv)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_the_users_function_failing_shows_their_traceback(lab, capsys):
    assert main(run_args(lab / 'r', '--model', 'nets.py:MLP', '--dataset',
                         'nets.py:failing')) == 1
    err = capsys.readouterr().err
    assert 'nets.py", line' in err and 'ZeroDivisionError' in err
    assert 'dasktrain/' not in err


@pytest.mark.equivalence
def test_an_own_model_and_data_resume_bit_identical(lab, float64):
    common = dict(model=str(lab / 'nets.py') + ':Small',
                  dataset=f'npz:{lab / "gray.npz"}', batch_size=20, lr=0.01,
                  devices=('@numpy',) * 2, in_process=True, progress=False)
    whole = train(TrainConfig(out=str(lab / 'whole'), epochs=3, **common))
    train(TrainConfig(out=str(lab / 'cut'), epochs=1, **common))
    resumed = train(TrainConfig(out=str(lab / 'cut'), epochs=3, resume=True,
                                **common))
    for a, b in zip(whole['log'], resumed['log']):
        for key in ('main/loss', 'main/accuracy', 'validation/main/loss'):
            assert a[key] == b[key], key
    with np.load(lab / 'whole' / 'model_final.npz') as one, \
            np.load(lab / 'cut' / 'model_final.npz') as two:
        for key in one.files:
            np.testing.assert_array_equal(one[key], two[key], err_msg=key)


def test_a_job_across_dask_workers_gets_the_files(lab, local_cluster):
    # The workers run in another folder; the model and data files reach
    # them by path here and by Dask's upload_file.
    from distributed import Client
    config = TrainConfig(model='nets.py:MLP', dataset='nets.py:features',
                         epochs=2, batch_size=20, lr=0.01, workers=2,
                         devices=('@numpy',), out=str(lab / 'job'),
                         progress=False)
    with Client(local_cluster) as client:
        summary = train(config, client=client)
        cwd = set(client.run(lambda: __import__('os').getcwd()).values())
    assert str(lab) not in cwd
    assert len(summary['workers']) == 2
    assert summary['final']['validation/main/accuracy'] > 0.4


# ----------------------------------------------------------- CIFAR-100

def cifar100_archive(path):
    """A small CIFAR-100-format archive (train, test, meta); its MD5."""
    rng = np.random.RandomState(0)
    files = {}
    for name, n in (('train', 60), ('test', 20)):
        fine = rng.randint(0, 100, n)
        images = ((fine[:, None] * 7) % 200 +
                  rng.randint(0, 50, (n, 3072))).astype(np.uint8)
        files[name] = py2_pickle({
            b'filenames': [b'x.png'] * n, b'batch_label': name.encode(),
            b'fine_labels': [int(f) for f in fine],
            b'coarse_labels': [int(f) // 5 for f in fine],
            b'data': images})
    files['meta'] = py2_pickle({
        b'fine_label_names': [b'f%d' % i for i in range(100)],
        b'coarse_label_names': [b'c%d' % i for i in range(20)]})
    with tarfile.open(path, 'w:gz') as tar:
        folder = tarfile.TarInfo('cifar-100-python')
        folder.type, folder.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(folder)
        for name, content in files.items():
            info = tarfile.TarInfo(f'cifar-100-python/{name}')
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_cifar100_downloaded_checked_and_trained(tmp_path, capsys):
    md5 = cifar100_archive(tmp_path / 'cifar-100-python.tar.gz')
    with ArchiveServer(tmp_path) as server:
        url = server.url('cifar-100-python.tar.gz')
        # a wrong MD5: one line, nothing left behind
        assert main(['download', '--dataset', 'cifar100', '--url', url,
                     '--data-dir', str(tmp_path / 'bad'), '--md5',
                     '0' * 32]) == 1
        assert 'does not match' in capsys.readouterr().err
        assert not (tmp_path / 'bad').exists()  # made, and removed
        assert main(['download', '--dataset', 'cifar100', '--url', url,
                     '--md5', md5, '--data-dir', str(tmp_path / 'd')]) == 0
    fine = load_dataset('cifar100', tmp_path / 'd', download=False)
    coarse = load_dataset('cifar100', tmp_path / 'd', download=False,
                          label_set='coarse')
    assert len(fine.train_labels) == 60 and fine.train_images.shape[1:] == \
        (3, 32, 32)
    np.testing.assert_array_equal(coarse.train_labels.compute(),
                                  fine.train_labels.compute() // 5)
    assert fine.n_classes <= 100 and coarse.n_classes <= 20
    assert main(['train', '--dataset', 'cifar100', '--label-set', 'coarse',
                 '--model', 'tiny', '--epochs', '1', '--batch-size', '20',
                 '--data-dir', str(tmp_path / 'd'), '--out',
                 str(tmp_path / 'r'), '--no-progress']) == 0
    args = json.loads((tmp_path / 'r' / 'args').read_text())
    assert args['data']['n_classes'] == coarse.n_classes
    with pytest.raises(DataError, match='label_set must be fine or coarse'):
        load_dataset('cifar100', tmp_path / 'd', label_set='medium')
