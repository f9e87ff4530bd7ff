"""DistributedUpdater: a Chainer Trainer script on N devices by changing
its updater line only. Real Trainers, Evaluators, LogReports and
snapshots; equivalence with StandardUpdater on the whole batch, in
float64 (see conftest's float64)."""
import json

import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest
from chainer import training
from chainer.training import extensions

from dasktrain import DistributedUpdater

N, BATCH = 48, 12  # 4 iterations an epoch


class MLP(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(8, 16)
            self.l2 = L.Linear(16, 3)

    def forward(self, x):
        return self.l2(F.relu(self.l1(x)))


def data(seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(N, 8).astype(chainer.get_dtype())
    t = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5).astype(np.int32)
    return chainer.datasets.TupleDataset(x, t)


def trainer(updater_of, out, epochs=2, optimizer=None, extend=()):
    np.random.seed(0)  # the same initial weights every time
    model = L.Classifier(MLP())
    optimizer = optimizer or chainer.optimizers.MomentumSGD(lr=0.1)
    optimizer.setup(model)
    iterator = chainer.iterators.SerialIterator(data(), BATCH,
                                                shuffle=False)
    t = training.Trainer(updater_of(iterator, optimizer),
                         (epochs, 'epoch'), out=str(out))
    t.extend(extensions.LogReport())
    for extension in extend:
        t.extend(extension)
    return t, model


def params(link):
    return {n: p.array.copy() for n, p in sorted(link.namedparams())}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-10, atol=1e-12,
                                   err_msg=name)


@pytest.mark.equivalence
@pytest.mark.parametrize('optimizer', ['momentum', 'adam'])
def test_dg_on_two_devices_equals_one_device_on_the_whole_batch(
        tmp_path, float64, optimizer):
    make = {'momentum': lambda: chainer.optimizers.MomentumSGD(lr=0.1),
            'adam': lambda: chainer.optimizers.Adam(alpha=0.01)}[optimizer]
    one, model_one = trainer(training.updaters.StandardUpdater,
                             tmp_path / 'one', optimizer=make())
    one.run()
    two, model_two = trainer(
        lambda it, opt: DistributedUpdater(it, opt, devices='cpu:2'),
        tmp_path / 'two', optimizer=make())
    two.run()
    assert_same(params(model_one), params(model_two))
    logs = [json.loads((tmp_path / d / 'log').read_text())
            for d in ('one', 'two')]
    assert [r['iteration'] for r in logs[1]] == [4, 8]
    for a, b in zip(*logs):  # the batch-weighted mean of the replicas
        for key in ('main/loss', 'main/accuracy'):
            assert b[key] == pytest.approx(a[key], rel=1e-10), key


@pytest.mark.equivalence
def test_ipm_mixing_every_iteration_with_sgd_equals_dg(tmp_path, float64):
    models = {}
    for mode, mix in (('dg', None), ('ipm', 1)):
        t, models[mode] = trainer(
            lambda it, opt, mode=mode, mix=mix: DistributedUpdater(
                it, opt, devices=['@numpy'] * 3, mode=mode, mix_every=mix),
            tmp_path / mode, optimizer=chainer.optimizers.SGD(lr=0.1))
        t.run()
    assert_same(params(models['dg']), params(models['ipm']))


def test_evaluator_and_report_see_the_master(tmp_path):
    test = chainer.iterators.SerialIterator(data(1), 16, repeat=False,
                                            shuffle=False)
    t, model = trainer(
        lambda it, opt: DistributedUpdater(it, opt, devices='cpu:2',
                                           mode='ipm', mix_every='epoch'),
        tmp_path)
    assert t.updater.get_optimizer('main').target is model
    t.extend(extensions.Evaluator(test, model), name='val')
    t.run()
    rows = json.loads((tmp_path / 'log').read_text())
    assert {'main/loss', 'main/accuracy', 'val/main/loss',
            'val/main/accuracy'} <= rows[-1].keys()
    assert rows[-1]['main/accuracy'] > 0.5  # it learns
    updater = t.updater
    # mixed at the epoch's end: the replicas equal the master
    assert_same(params(updater.model.replicas[1]), params(model))


def whole_and_resumed(updater, tmp_path):
    """Three epochs in one run, and one epoch, a snapshot, and a fresh
    trainer resumed from it to the third: (the whole run's trainer, its
    model, the resumed run's model)."""
    whole, model_whole = trainer(updater, tmp_path / 'whole', epochs=3)
    whole.run()
    first, _ = trainer(updater, tmp_path / 'cut', epochs=1, extend=[
        extensions.snapshot(filename='snap')])
    first.run()
    again, model_again = trainer(updater, tmp_path / 'cut2', epochs=3)
    chainer.serializers.load_npz(str(tmp_path / 'cut' / 'snap'), again)
    again.run()
    return whole, model_whole, model_again


@pytest.mark.parametrize('mode', ['dg', 'ipm'])
def test_snapshot_and_resume_continue_the_run(tmp_path, float64, mode):
    def updater(it, opt):
        return DistributedUpdater(it, opt, devices='cpu:2', mode=mode,
                                  mix_every=3 if mode == 'ipm' else None)
    _, model_whole, model_again = whole_and_resumed(updater, tmp_path)
    assert_same(params(model_whole), params(model_again))


@pytest.mark.parametrize('mode', ['dg', 'ipm'])
def test_a_mixed16_script_scales_its_loss_and_resumes_bit_for_bit(
        tmp_path, mode):
    # Chainer's mixed16 recipe in the script (the dtype, loss_scaling,
    # use_fp32_update): every replica back-propagates at its optimizer's
    # scale, and a snapshot keeps the scale and the float32 masters,
    # which Chainer's own snapshot drops.
    def updater(it, opt):
        opt.loss_scaling()
        opt.use_fp32_update()
        return DistributedUpdater(it, opt, devices='cpu:2', mode=mode,
                                  mix_every=3 if mode == 'ipm' else None)

    with chainer.using_config('dtype', chainer.mixed16):
        whole, model_whole, model_again = whole_and_resumed(updater,
                                                            tmp_path)
    optimizers = whole.updater.model.optimizers
    assert all(o._loss_scale == 2.0 ** 12 for o in optimizers)
    assert model_whole.predictor.l1.W.dtype == np.float16
    for name, value in params(model_whole).items():
        np.testing.assert_array_equal(params(model_again)[name], value,
                                      name)


def test_bad_use_is_one_clear_error():
    iterator = chainer.iterators.SerialIterator(data(), BATCH)
    with pytest.raises(ValueError, match=r'optimizer must be set up on the '
                       r'model first'):
        DistributedUpdater(iterator, chainer.optimizers.SGD())
