"""Chainer's type checks once per input signature: a step whose batch
shapes and dtypes passed them runs without them, forward and backward; a
new one is checked, and fails with Chainer's own message."""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest
from chainer.utils import type_check

from dasktrain.parallel import GPUDistributedGradient
from dasktrain.training.updater import DistributedUpdater


class Probe(chainer.FunctionNode):
    """Identity recording ``chainer.config.type_check`` where it runs, in
    its forward and in its backward; its type check refuses a batch of
    ``refused`` rows (Chainer's own InvalidType)."""

    def __init__(self, seen, refused=None):
        self.seen, self.refused = seen, refused

    def check_type_forward(self, in_types):
        if self.refused is not None:
            type_check.expect(in_types[0].shape[0] != self.refused)

    def forward(self, inputs):
        self.seen.append(('forward', chainer.config.type_check))
        return inputs[0].copy(),

    def backward(self, indexes, grad_outputs):
        self.seen.append(('backward', chainer.config.type_check))
        return grad_outputs


class Net(chainer.Chain):
    def __init__(self, refused=None):
        super().__init__()
        self.seen, self.refused = [], refused
        with self.init_scope():
            self.fc = L.Linear(4, 3)

    def forward(self, x):
        return Probe(self.seen, self.refused).apply((self.fc(x),))[0]


def batch(n, seed=0):
    rng = np.random.RandomState(seed)
    return (rng.randn(n, 4).astype(np.float32),
            rng.randint(0, 3, n).astype(np.int32))


def wrapped(n_devices=1, refused=None, **kw):
    np.random.seed(0)
    net = Net(refused)
    model = GPUDistributedGradient(L.Classifier(net), ['@numpy'] * n_devices,
                                   **kw)
    model.setup(chainer.optimizers.SGD(lr=0.1))
    return model


def checks(model):
    """Each step's type_check, as every replica's forward and backward
    saw it: one value per step where they all agree."""
    per_step = {}
    for replica in model.replicas:
        seen = replica.predictor.seen
        for step in range(0, len(seen), 2):
            per_step.setdefault(step // 2, set()).update(
                value for _, value in seen[step:step + 2])
        replica.predictor.seen.clear()
    assert all(len(values) == 1 for values in per_step.values()), per_step
    return [values.pop() for _, values in sorted(per_step.items())]


def test_a_signature_checked_once_runs_without_type_checks():
    model = wrapped(2)
    sizes = [8, 8, 8, 6, 8, 6, 7]
    for seed, n in enumerate(sizes):
        model.step(*batch(n, seed))
    # 8 images: parts of 4 and 4; 6: 3 and 3; 7: 4 and 3, all new once
    assert checks(model) == [True, False, False, True, False, False, True]


def test_a_new_shape_still_fails_chainer_s_type_check():
    model = wrapped(refused=6)
    for seed in range(3):
        model.step(*batch(4, seed))
    assert checks(model) == [True, False, False]
    with pytest.raises(type_check.InvalidType,
                       match=r'Expect: in_types\[0\]\.shape\[0\] != 6'):
        model.step(*batch(6))
    # the failed signature was not taken as checked: it fails again
    with pytest.raises(type_check.InvalidType):
        model.step(*batch(6, 1))
    model.step(*batch(4))
    assert checks(model)[-1] is False


def test_always_and_chainer_s_own_switch_are_kept():
    model = wrapped(type_check='always')
    for seed in range(3):
        model.step(*batch(4, seed))
    assert checks(model) == [True, True, True]
    model = wrapped()
    with chainer.using_config('type_check', False):  # CHAINER_TYPE_CHECK=0
        for seed in range(2):
            model.step(*batch(4, seed))
    assert checks(model) == [False, False]
    with pytest.raises(ValueError, match="type_check must be 'once' or "
                                         "'always', got 'never'"):
        wrapped(type_check='never')


def test_evaluation_mode_is_a_signature_of_its_own():
    # Chainer picks other functions outside training (BatchNorm's
    # running statistics): the same shapes, checked again.
    model = wrapped()
    x, t = batch(4)
    with model as m:
        m(*model.split(x, t))
    with chainer.using_config('train', False), model as m:
        m(*model.split(x, t))
    with model as m:
        m(*model.split(x, t))
    assert checks(model) == [True, True, False]


class _Iterator(chainer.dataset.Iterator):
    """Batches of 4, then one of 6 (Chainer's iterators end an epoch with
    a smaller one)."""

    def __init__(self, sizes):
        self.sizes, self.epoch, self.is_new_epoch = list(sizes), 0, False

    def __next__(self):
        x, t = batch(self.sizes.pop(0), len(self.sizes))
        self.is_new_epoch = not self.sizes
        return list(zip(x, t))


def test_a_trainer_script_gets_the_rule_through_the_updater():
    np.random.seed(0)
    model = L.Classifier(Net(refused=6))
    optimizer = chainer.optimizers.SGD(lr=0.1)
    optimizer.setup(model)
    updater = DistributedUpdater(_Iterator([4, 4, 4, 6]), optimizer,
                                 devices='cpu:1')
    for _ in range(3):
        updater.update()
    assert checks(updater.model) == [True, False, False]
    with pytest.raises(type_check.InvalidType):
        updater.update()


def test_a_step_without_type_checks_computes_the_same_bits():
    runs = []
    for type_check_mode in ('once', 'always'):
        model = wrapped(2, type_check=type_check_mode)
        for seed in range(3):
            model.step(*batch(8, seed))
        runs.append({n: p.array.copy()
                     for n, p in model.master.namedparams()})
    for name in runs[0]:
        np.testing.assert_array_equal(runs[0][name], runs[1][name])
    assert F.sum(model.master.predictor.fc.W).array != 0
