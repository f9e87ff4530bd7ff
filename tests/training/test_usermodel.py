"""A lab's own model, from a file outside the package: `--model
file.py:NAME` with `--model-arg`, in this process, as worker processes,
sent to Dask workers that have no copy, kept with a submitted job; every
bad spec one line, the user's own errors with their own traceback."""
import json

import numpy as np
import pytest
from distributed import Client
from test_cluster import Processes, job_config

from dasktrain.cli import main
from dasktrain.jobs.client.submit import submit
from dasktrain.training.models import load_model
from dasktrain.training.usermodel import ModelSpecError, build

MODEL = '''
import chainer
import chainer.functions as F
import chainer.links as L


class MLP(chainer.Chain):
    def __init__(self, n_units=64, n_classes=10):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(None, n_units)   # lazy: sized by the data
            self.l2 = L.Linear(n_units, n_classes)

    def forward(self, x):
        return self.l2(F.relu(self.l1(x)))


class OwnLoss(chainer.Chain):
    """The MLP computing its own loss and reporting its own metrics, as
    many Chainer examples do."""

    def __init__(self, n_units=64, n_classes=10):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(None, n_units)
            self.l2 = L.Linear(n_units, n_classes)

    def forward(self, x, t):
        y = self.l2(F.relu(self.l1(x)))
        loss = F.softmax_cross_entropy(y, t)
        chainer.report({'loss': loss, 'accuracy': F.accuracy(y, t)}, self)
        return loss


def broken():
    return helper()


def helper():
    return 1 / 0


def not_a_link():
    return 'a string'


NOT_CALLABLE = 3
'''


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(100, 60, 9)


@pytest.fixture
def lab(tmp_path, monkeypatch):
    """A lab folder with its model file, the working directory."""
    folder = tmp_path / 'lab'
    folder.mkdir()
    (folder / 'mymodel.py').write_text(MODEL)
    monkeypatch.chdir(folder)
    return folder


def train_args(data_dir, out, *more):
    return ['train', '--model', 'mymodel.py:MLP', '--model-arg',
            'n_units=32', '--epochs', '2', '--batch-size', '25',
            '--train-size', '200', '--test-size', '60', '--lr', '0.01',
            '--data-dir', str(data_dir), '--out', str(out), '--no-progress',
            *more]


@pytest.mark.parametrize('devices', ['cpu', 'cpu:2'])
def test_a_model_file_trains_and_is_recorded(lab, data_dir, devices,
                                             capsys):
    out = lab / 'run'
    assert main(train_args(data_dir, out, '--devices', devices)) == 0
    assert 'done: epoch 2' in capsys.readouterr().out
    args = json.loads((out / 'args').read_text())
    assert args['model'] == f'{lab / "mymodel.py"}:MLP'  # absolute
    assert args['model_args'] == {'n_units': 32}
    rows = json.loads((out / 'log').read_text())
    assert rows[-1]['validation/main/accuracy'] > 0.2  # chance: 0.1
    # the run's model comes back from its args
    chain = load_model(out / 'model_final.npz', args['model'],
                       args['model_args'])
    assert chain.predictor.l1.W.shape == (32, 3 * 32 * 32)
    with np.load(out / 'model_final.npz') as saved:
        np.testing.assert_array_equal(chain.predictor.l2.b.array,
                                      saved['predictor/l2/b'])


@pytest.mark.equivalence
@pytest.mark.parametrize('devices', ['cpu', 'cpu:2'])
def test_a_model_computing_its_own_loss_is_trained_as_it_is(
        lab, data_dir, devices, float64):
    # The same network, once returning scores (wrapped in L.Classifier),
    # once its own loss (used as is): the same run, row for row.
    logs = {}
    for name in ('MLP', 'OwnLoss'):
        out = lab / name
        argv = train_args(data_dir, out, '--devices', devices,
                          '--in-process')
        argv[argv.index('mymodel.py:MLP')] = f'mymodel.py:{name}'
        assert main(argv) == 0
        logs[name] = json.loads((out / 'log').read_text())
    assert build('mymodel.py:OwnLoss').__class__.__name__ == 'OwnLoss'
    for a, b in zip(logs['MLP'], logs['OwnLoss']):
        for key in ('main/loss', 'main/accuracy', 'validation/main/loss',
                    'validation/main/accuracy'):
            assert b[key] == pytest.approx(a[key], rel=1e-10), key
    assert logs['OwnLoss'][-1]['validation/main/accuracy'] > 0.2


def test_a_worker_without_the_file_gets_it_from_dask(lab, tmp_path,
                                                     local_cluster):
    with Client(local_cluster) as client:
        client.upload_file(str(lab / 'mymodel.py'), load=False)
        # the path the worker is given does not exist there
        gone = f'{tmp_path / "elsewhere" / "mymodel.py"}:MLP'

        def shape(spec):
            return build(spec, 10, {'n_units': 8}).predictor.l2.W.shape
        assert set(client.run(shape, gone).values()) == {(10, 8)}


@pytest.mark.parametrize('spec,args,message', [
    ('nothere.py:MLP', [], '--model nothere.py:MLP: no file nothere.py'),
    ('mymodel.py:CNN', [], "--model mymodel.py:CNN: mymodel.py has no "
                           "attribute 'CNN'"),
    ('mymodel.py:NOT_CALLABLE', [], 'NOT_CALLABLE is not a class or '
                                    'function (it is int)'),
    ('mymodel.py:not_a_link', [], 'not_a_link returned a str, not a '
                                  'chainer.Link'),
    ('mymodel.py:MLP', ['--model-arg', 'width=3'],
     "calling MLP(width=3, n_classes=10) failed: "),
    ('no_such_pkg.nets:MLP', [], "no module 'no_such_pkg'"),
    ('mymodel.py:', [], 'expected package.module:NAME or '
                        'path/to/file.py:NAME'),
])
def test_a_bad_spec_is_one_line(lab, data_dir, capsys, spec, args, message):
    code = main(['train', '--model', spec, *args, '--data-dir',
                 str(data_dir), '--out', str(lab / 'r'), '--epochs', '1'])
    err = capsys.readouterr().err
    assert code in (1, 2)
    assert err.count('\n') == 1 and 'Traceback' not in err, err
    assert message in err
    assert not (lab / 'r').exists()


def test_the_users_own_error_shows_their_traceback_only(lab, data_dir,
                                                        capsys):
    assert main(['train', '--model', 'mymodel.py:broken', '--data-dir',
                 str(data_dir), '--out', str(lab / 'r')]) == 1
    err = capsys.readouterr().err
    assert err.startswith('dasktrain train: error: --model '
                          'mymodel.py:broken: calling broken failed:\n')
    assert 'mymodel.py", line 36, in broken' in err
    assert 'mymodel.py", line 40, in helper' in err
    assert err.rstrip().endswith('ZeroDivisionError: division by zero')
    assert 'dasktrain/' not in err and 'importlib' not in err


def test_a_submitted_job_keeps_the_file_as_it_was(lab, data_dir, tmp_path):
    procs = Processes(tmp_path)
    try:
        procs.worker(gpus=1)
        with Client(procs.address) as client:
            client.wait_for_workers(1)
            config = job_config(data_dir, model='mymodel.py:MLP',
                                model_args={'n_units': 16}, epochs=1,
                                train_size=200, test_size=60)
            job = submit(config, gpus=1, client=client,
                         path=tmp_path / 'jobs')
        (lab / 'mymodel.py').write_text('raise ImportError("edited")\n')
        kept = job.folder / 'model' / 'mymodel.py'
        assert kept.read_text() == MODEL
        assert job.spec().config['model'] == f'{kept}:MLP'
        assert job.spec().name == 'MLP'
        assert job.result(timeout=180)['final']['epoch'] == 1
        # and a bad spec is refused on the submitter's machine
        with Client(procs.address) as client, \
                pytest.raises(ModelSpecError, match='edited'):
            submit(config.replace(model='mymodel.py:Nope', model_args=None),
                   gpus=1, client=client, path=tmp_path / 'jobs')
    finally:
        procs.close()
