"""The GPU hooks' decisions, held on the CPU: Chainer's convolution
arguments as cuDNN graph geometry (against Chainer's own shape rules), the
fallback and engine choices, the graph cache's bound, the batch
normalization maths (against Chainer's own implementation, float64), and
the hooks' installation at Chainer's import."""
import itertools
import subprocess
import sys

import chainer
import chainer.functions as F
import numpy as np
import pytest
from chainer.functions.connection import convolution_2d as conv2d
from chainer.functions.connection import deconvolution_2d as deconv2d
from chainer.functions.normalization import batch_normalization as bn
from chainer.utils import conv

import dasktrain.kernels as kernels
from dasktrain.kernels import batchnorm, choices, geometry

# (x shape, W shape, stride, pad, dilate, groups): the table the GPU suite
# compares with Chainer's own path too (tests/gpu/test_gpu_kernels.py)
CONV_CASES = {
    '1x1': ((4, 8, 9, 9), (16, 8, 1, 1), 1, 0, 1, 1),
    '3x3': ((4, 3, 32, 32), (16, 3, 3, 3), 1, 1, 1, 1),
    'strided': ((4, 16, 32, 32), (32, 16, 3, 3), 2, 1, 1, 1),
    'padded-5x5': ((2, 3, 17, 13), (8, 3, 5, 5), 1, 2, 1, 1),
    'asymmetric': ((2, 4, 11, 7), (6, 4, 3, 2), (2, 1), (1, 0), 1, 1),
    'grouped': ((2, 8, 10, 10), (12, 2, 3, 3), 1, 1, 1, 4),
    'depthwise': ((2, 8, 10, 10), (8, 1, 3, 3), 1, 1, 1, 8),
    'dilated': ((2, 4, 16, 16), (8, 4, 3, 3), 1, 2, 2, 1),
    'strided-dilated': ((2, 4, 15, 15), (8, 4, 3, 3), 2, 1, (2, 3), 1),
}
COVER_ALL = {
    'cover_all': ((2, 3, 10, 10), (4, 3, 3, 3), 2, 0, 1, 1),
    'cover_all-odd': ((2, 3, 11, 9), (4, 3, 4, 2), 3, 1, 1, 1),
}


def pair(v):
    return tuple(v) if isinstance(v, tuple) else (v, v)


@pytest.mark.parametrize('cover_all', [False, True])
@pytest.mark.parametrize('case', sorted({**CONV_CASES, **COVER_ALL}))
def test_forward_geometry_is_chainer_s_output_shape(case, cover_all):
    x, w, s, p, d, groups = {**CONV_CASES, **COVER_ALL}[case]
    g = geometry.forward(x, w, s, p, cover_all, d)
    (sy, sx), (ph, pw), (dy, dx) = pair(s), pair(p), pair(d)
    want = (x[0], w[0],
            conv.get_conv_outsize(x[2], w[2], sy, ph, cover_all, dy),
            conv.get_conv_outsize(x[3], w[3], sx, pw, cover_all, dx))
    assert g.output == want
    assert g.groups == groups
    assert g.pre_padding == (ph, pw)
    # cover_all's partial windows are exactly one stride of extra padding
    extra = (sy - 1, sx - 1) if cover_all else (0, 0)
    for size, out, k, st, pre, post, dil in zip(
            x[2:], want[2:], w[2:], g.stride, g.pre_padding,
            g.post_padding, g.dilation):
        assert geometry.conv_outsize(size, k, st, pre, post, dil) == out
    if cover_all:
        # the smallest post-padding that gives the size: cover_all's or,
        # where the division is exact, the plain one
        assert all(q <= pre + e for q, pre, e in
                   zip(g.post_padding, g.pre_padding, extra))
    else:
        assert g.post_padding == g.pre_padding


def chainer_conv(x, w, s, p, d, groups, cover_all=False):
    return F.convolution_2d(x, w, stride=s, pad=p, dilate=d, groups=groups,
                            cover_all=cover_all)


@pytest.mark.parametrize('case', sorted({**CONV_CASES, **COVER_ALL}))
def test_gradient_geometries_match_the_forward_one(case):
    """The data and filter gradients of Chainer's convolution (the
    deconvolution and Convolution2DGradW it backpropagates through) are
    the same cuDNN convolution as its forward pass."""
    x, w, s, p, d, groups = {**CONV_CASES, **COVER_ALL}[case]
    cover_all = case in COVER_ALL
    fwd = geometry.forward(x, w, s, p, cover_all, d)
    dgrad = geometry.data_gradient(fwd.output, w, x[2:], groups, s, p, d)
    wgrad = geometry.filter_gradient(x, fwd.output, w, s, p, d)
    assert dgrad == fwd == wgrad


@pytest.mark.parametrize('outsize', [None, (32, 30)])
def test_a_deconvolution_s_outsize_is_the_image_of_its_data_gradient(
        outsize):
    """Deconvolution2D with any outsize Chainer accepts: the geometry's
    image is the output Chainer computes, and its convolution maps it back
    onto the input."""
    x = np.zeros((2, 6, 16, 15), np.float64)
    w = np.zeros((6, 4, 3, 3), np.float64)
    y = F.deconvolution_2d(x, w, stride=2, pad=1, outsize=outsize)
    g = geometry.data_gradient(x.shape, w.shape, y.shape[2:], 1, 2, 1)
    assert g.image == y.shape and g.output == x.shape
    for size, out, k, st, pre, post in zip(g.image[2:], x.shape[2:], (3, 3),
                                           g.stride, g.pre_padding,
                                           g.post_padding):
        assert geometry.conv_outsize(size, k, st, pre, post) == out


def test_shapes_cudnn_cannot_be_told_are_reasons():
    assert isinstance(geometry.forward((1, 1, 2, 2), (1, 1, 5, 5)), str)
    assert 'split' in geometry.data_gradient((1, 6, 4, 4), (6, 1, 3, 3),
                                             (4, 4), 4)
    assert 'do not convolve' in geometry.filter_gradient(
        (1, 1, 8, 8), (1, 1, 5, 5), (1, 1, 3, 3), 1, 1)


def test_batch_normalization_views():
    assert geometry.batchnorm_view((5, 3, 4, 2), 1, (0, 2, 3)) == (5, 3, 8)
    assert geometry.batchnorm_view((5, 3, 4, 2, 2), 1,
                                   (0, 2, 3, 4)) == (5, 3, 16)
    assert isinstance(geometry.batchnorm_view((5, 3, 4), 2, (0,)), str)


def test_choices():
    assert choices.deselected_notes('float64', True, False) == \
        ('NONDETERMINISTIC', 'DOWN_CONVERT_INPUTS')
    assert choices.conv_problem(('float32',) * 2, (None, None), 5)
    assert choices.conv_problem(('int32',) * 2, (None, None))
    with pytest.raises(ValueError, match="got 'sometimes'"):
        choices.use_cudnn('sometimes')
    assert choices.frontend_problem('1.23.7', 90000) is None
    assert choices.frontend_problem('1.22.1', 91000)
    assert choices.frontend_problem('garbage', 91000)


def test_the_graph_cache_is_bounded_and_least_recently_used_goes():
    cache = choices.GraphCache(3)
    for key in 'abc':
        cache.put(key, key.upper())
    assert cache.get('a') == 'A'          # a is now the most recent
    cache.put('d', choices.Unbuildable('no engine'))
    assert cache.get('b') is None and cache.evicted == 1
    assert [cache.get(k) for k in 'acd'][:2] == ['A', 'C']
    assert cache.unbuildable() == {'d': 'no engine'}
    for i in range(100):
        cache.put(i, i)
    assert len(cache) == 3 and cache.evicted == 101
    with pytest.raises(ValueError, match='got 0'):
        choices.GraphCache(0)


def _bn_through(impl, x, gamma, beta, rmean, rvar, decay=0.9, eps=2e-5):
    """y, the running averages and the gradients of x, gamma, beta through
    Chainer's BatchNormalization node with ``impl``."""
    x, gamma, beta = (chainer.Variable(a.copy()) for a in (x, gamma, beta))
    f = bn.BatchNormalization(eps, rmean, rvar, decay,
                              impl_selector=lambda fn, inputs: impl)
    y, = f.apply((x, gamma, beta))
    gy = np.cos(np.arange(y.size)).reshape(y.shape).astype(y.dtype)
    y.grad = gy
    y.backward()
    return y.array, rmean, rvar, x.grad, gamma.grad, beta.grad


@pytest.mark.equivalence
@pytest.mark.parametrize('shape', [(8, 3, 5, 4), (2, 4, 1, 1), (16, 5),
                                   (3, 2, 7)])
def test_the_reductions_are_chainer_s_batch_normalization(shape):
    rng = np.random.RandomState(0)
    c = shape[1]
    x = rng.normal(3.0, 2.0, shape)           # a mean far from 0
    gamma, beta = rng.normal(1, .2, c), rng.normal(0, .2, c)
    ours = _bn_through(batchnorm.Reductions(), x, gamma, beta,
                       rng.rand(c), 1 + rng.rand(c))
    rng = np.random.RandomState(0)
    rng.normal(3.0, 2.0, shape), rng.normal(1, .2, c), rng.normal(0, .2, c)
    theirs = _bn_through(bn.GeneralBatchNormalizationImpl(), x, gamma, beta,
                         rng.rand(c), 1 + rng.rand(c))
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.equivalence
def test_the_reductions_double_backward_is_chainer_s():
    rng = np.random.RandomState(1)
    x = rng.normal(size=(6, 3, 4, 4))
    gamma, beta = rng.normal(1, .1, 3), rng.normal(size=3)
    gy, ggx = rng.normal(size=x.shape), rng.normal(size=x.shape)

    def grads(impl):
        xs = [chainer.Variable(a.copy()) for a in (x, gamma, beta)]
        f = bn.BatchNormalization(2e-5, impl_selector=lambda fn, i: impl)
        y, = f.apply(tuple(xs))
        gx, = chainer.grad([y], [xs[0]], [chainer.Variable(gy)],
                           enable_double_backprop=True)
        return [None if g is None else g.array for g in chainer.grad(
            [gx], xs, [chainer.Variable(ggx)])]

    ours = grads(batchnorm.Reductions())
    theirs = grads(bn.GeneralBatchNormalizationImpl())
    assert [g is None for g in ours] == [False, False, True]
    for a, b in zip(ours[:2], theirs[:2]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_the_selector_leaves_the_cpu_to_chainer():
    kernels.install()
    x = np.ones((2, 3, 2, 2), np.float32)
    f = bn.BatchNormalization()
    f.apply((x, np.ones(3, np.float32), np.zeros(3, np.float32)))
    assert type(f._impl) is bn.GeneralBatchNormalizationImpl


def _child(code, **env):
    import os
    done = subprocess.run([sys.executable, '-c', code], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


HOOKED = '''
import chainer
from chainer.functions.connection import convolution_2d as c
from chainer.functions.connection import deconvolution_2d as d
from chainer.functions.normalization import batch_normalization as b
print(c.Convolution2DFunction.forward_gpu.__module__,
      c.Convolution2DGradW.forward_gpu.__module__,
      d.Deconvolution2DFunction.forward_gpu.__module__,
      b.FixedBatchNormalization.forward.__module__,
      b.BatchNormalization.__init__.__defaults__[-1].__module__)
'''


def test_a_plain_chainer_script_gets_the_hooks_at_chainer_s_import():
    """Installed dasktrain hooks Chainer in any process of its
    environment, with nothing imported but chainer; DASKTRAIN_KERNELS=off
    leaves Chainer as it is."""
    assert _child(HOOKED) == ['dasktrain.kernels'] * 4 + [
        'dasktrain.kernels.batchnorm']
    assert not any(m.startswith('dasktrain') for m in _child(
        HOOKED, DASKTRAIN_KERNELS='off'))
    # a lookup is no import: the hooks still come with the import after it
    probed = 'import importlib.util; importlib.util.find_spec("chainer")'
    assert _child(probed + HOOKED) == _child(HOOKED)


def test_uninstall_restores_chainer():
    kernels.install()
    assert conv2d.Convolution2DFunction.forward_gpu.__wrapped__
    original = conv2d.Convolution2DFunction.forward_gpu.__wrapped__
    kernels.uninstall()
    try:
        assert conv2d.Convolution2DFunction.forward_gpu is original
        assert bn.BatchNormalization.__init__.__defaults__[-1] is \
            batchnorm.CHAINER_SELECTOR
        assert not hasattr(deconv2d.Deconvolution2DFunction.forward_gpu,
                           '__wrapped__')
    finally:
        kernels.install()


@pytest.mark.parametrize('dtype', ['float32', 'float64'])
def test_the_cpu_paths_are_untouched(dtype):
    """A CPU convolution and its gradients through the hooked classes are
    Chainer's own, bit for bit."""
    rng = np.random.RandomState(2)
    x = rng.normal(size=(2, 4, 9, 9)).astype(dtype)
    w = rng.normal(size=(6, 2, 3, 3)).astype(dtype)

    def run():
        xv, wv = chainer.Variable(x.copy()), chainer.Variable(w.copy())
        y = F.convolution_2d(xv, wv, stride=2, pad=1, groups=2)
        F.sum(y * y).backward()
        return y.array, xv.grad, wv.grad

    kernels.install()
    hooked = run()
    kernels.uninstall()
    try:
        plain = run()
    finally:
        kernels.install()
    for a, b in zip(hooked, plain):
        assert np.array_equal(a, b)


def test_every_case_has_a_distinct_cache_key():
    keys = {('fprop', 0, geometry.forward(x, w, s, p, False, d), 'float32',
             det, tf32)
            for (x, w, s, p, d, _), det, tf32 in itertools.product(
                CONV_CASES.values(), (False, True), (False, True))}
    assert len(keys) == len(CONV_CASES) * 4


@pytest.mark.parametrize('name', ['geometry', 'choices', 'kernels'])
def test_the_examples_hold(name):
    import doctest
    import importlib
    module = importlib.import_module(
        'dasktrain.kernels' + ('' if name == 'kernels' else f'.{name}'))
    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0, name


def test_the_cudnn_extras_pin_the_frontend_this_code_speaks():
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / 'pyproject.toml') \
        .read_text()
    pins = re.findall(r'"nvidia-cudnn-frontend>=(\d+)\.(\d+),<(\d+)\.(\d+)"',
                      text)
    assert len(pins) == 2  # cudnn12, cudnn13
    low, high = choices.FRONTEND
    for pin in pins:
        assert ((int(pin[0]), int(pin[1])), (int(pin[2]), int(pin[3]))) == \
            (low, high)
