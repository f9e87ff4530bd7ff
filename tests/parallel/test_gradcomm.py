"""The backward pass that reports gradients early, and the buckets."""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest

from dasktrain.parallel.exchange.backprop import backward_reporting
from dasktrain.parallel.exchange.buckets import parameters, plan_buckets
from dasktrain.training.models import get_model


class Shared(chainer.Chain):
    """One Linear applied twice (its W has two consumers) and a parameter
    no gradient reaches."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.a = L.Linear(6, 6)
            self.b = L.Linear(6, 3)
            self.unused = L.Linear(2, 2)

    def forward(self, x):
        return self.b(F.relu(self.a(F.relu(self.a(x)))))


def _batch(shape, seed=0):
    rng = np.random.RandomState(seed)
    return (rng.randn(*shape).astype(np.float32),
            rng.randint(0, 3, shape[0]).astype(np.int32))


class Count(chainer.FunctionHook):
    """How many functions have been back-propagated so far."""
    done = 0

    def backward_postprocess(self, function, in_data, out_grad):
        self.done += 1


def _grads_both_ways(model, x, t, loss_scale=None):
    """(plain backward's grads, reporting backward's grads, the reports
    with the grads still missing and the functions back-propagated at
    each, in order, and the functions in all); with ``loss_scale``, each
    way's grads come with the scale each parameter was marked with."""
    out = []
    reports = []
    count = Count()
    for reporting in (False, True):
        model.cleargrads()
        np.random.seed(5)  # the same dropout masks both times
        loss = model(x, t)
        if reporting:
            names = {id(p): n for n, p in model.namedparams()}

            def ready(p, names=names):
                missing = [n for n, q in model.namedparams()
                           if q.grad is None]
                reports.append((names[id(p)], missing, count.done))
            with count:
                backward_reporting(loss, ready, loss_scale)
        else:
            loss.backward(loss_scale=loss_scale)
        out.append({n: None if p.grad is None else
                    (p.grad.copy(), p._loss_scale) if loss_scale else
                    p.grad.copy() for n, p in model.namedparams()})
    return out[0], out[1], reports, count.done


@pytest.mark.parametrize('name', ['tiny', 'cifar10', 'resnet20'])
def test_reporting_backward_gives_chainer_s_gradients_bit_for_bit(name):
    np.random.seed(0)
    model = get_model(name)
    x, t = _batch((4, 3, 32, 32))
    plain, reported, reports, functions = _grads_both_ways(model, x, t)
    assert plain.keys() == reported.keys()
    for key in plain:
        np.testing.assert_array_equal(reported[key], plain[key], key)
    # every parameter reported once, the last layer first, and early: the
    # first report comes when few functions have been back-propagated
    assert sorted(n for n, _, _ in reports) == sorted(plain)
    first, missing, done = reports[0]
    assert first.startswith('/predictor/fc')
    assert done <= functions // 3 and len(missing) == len(plain) - 1
    assert [d for _, _, d in reports] == sorted(d for _, _, d in reports)
    assert reports[-1][1] == []


@pytest.mark.parametrize('name', ['tiny', 'resnet20'])
def test_reporting_backward_scales_the_loss_as_chainer_under_mixed16(name):
    # Chainer's mixed16: float16 activations and weights, BatchNorm's
    # float32; the loss scaled by 2**10 before its float16 backward pass
    # (small gradients would flush to zero), every parameter reached
    # marked with the scale its update rule divides by.
    with chainer.using_config('dtype', chainer.mixed16):
        np.random.seed(0)
        model = get_model(name)
        x, t = _batch((4, 3, 32, 32))
        plain, reported, _, _ = _grads_both_ways(
            model, x.astype(np.float16), t, loss_scale=1024.0)
    dtypes = set()
    for key in plain:
        (mine, mark), (theirs, their_mark) = reported[key], plain[key]
        np.testing.assert_array_equal(mine, theirs, key)
        assert mark == their_mark == 1024.0, key
        dtypes.add(mine.dtype)
    assert np.dtype(np.float16) in dtypes


def test_a_parameter_used_twice_is_reported_after_its_last_use():
    np.random.seed(0)
    model = L.Classifier(Shared())
    x, t = _batch((5, 6))
    plain, reported, reports, _ = _grads_both_ways(model, x, t)
    for key in plain:
        if plain[key] is None:
            assert reported[key] is None  # as Chainer leaves it
        else:
            np.testing.assert_array_equal(reported[key], plain[key], key)
    order = [n for n, _, _ in reports]
    assert '/predictor/unused/W' not in order  # no gradient: no report
    assert order.index('/predictor/b/W') < order.index('/predictor/a/W')
    # a's W is final only after its first use is back-propagated too:
    # nothing of a is reported while b's input gradient is pending
    assert order[-2:] in (['/predictor/a/W', '/predictor/a/b'],
                          ['/predictor/a/b', '/predictor/a/W'])


def test_buckets_cut_the_ready_order_at_the_size_limit():
    sizes = [10, 4, 4, 30, 1]
    assert plan_buckets([4, 3, 2, 1, 0], sizes, 8) == [[4, 3], [2, 1], [0]]
    # a parameter never reported joins the last bucket
    assert plan_buckets([3, 1, 0], sizes, 25) == [[3], [1, 0, 2, 4]]
    assert plan_buckets([0, 1], [10, 10], 100) == [[0, 1]]
    assert plan_buckets([], [10, 10], 5) == [[0, 1]]


def test_a_link_registered_twice_contributes_its_parameters_once():
    shared = L.Linear(3, 2)
    chain = chainer.Chain()
    with chain.init_scope():
        chain.first = shared
        chain.second = shared
    assert len(list(chain.namedparams())) == 4  # Chainer lists both names
    assert [p.name for p in parameters(chain)] == ['W', 'b']
    assert parameters(chain)[0] is shared.W
