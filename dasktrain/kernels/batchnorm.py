"""Chainer's batch normalization on a GPU at full occupancy: cuDNN 9's
graphs where they run, else two-stage reductions of the project's own.

Chainer 7.8.1 picks an implementation per call through
``BatchNormalization``'s ``impl_selector`` (its default is bound when the
class is defined); :func:`select` takes that place. Without cuDNN,
Chainer's general implementation computes the statistics with CuPy
reductions over the axes (0, 2, 3) of an NCHW array: CuPy's reduction runs
one output per block and CUB only reduces contiguous axes, so each
channel's sum runs in one block, one or two of an H100's 132
multiprocessors. Here:

:class:`Reductions` (any GPU, any dtype): ``x`` is viewed as (n, c, r),
``r`` the pixels of one image's channel (contiguous). Stage one sums each
(image, channel) row of ``r`` elements, n * c rows in parallel; stage two
adds the n partial sums of each channel. Both accumulate in float64. The
variance is the mean of squared deviations from that mean (a second pass,
as ``x.var`` is): no cancellation. Then, as Chainer's general
implementation::

    inv_std = 1 / sqrt(var + eps)
    y = gamma * (x - mean) * inv_std + beta
    running_mean = decay * running_mean + (1 - decay) * mean
    running_var = decay * running_var + (1 - decay) * m / (m - 1) * var

and backward, with ``m = n * r`` and the same two stages::

    gbeta = sum(gy)
    ggamma = inv_std * sum(gy * (x - mean))
    gx = gamma * inv_std * (gy - ((x - mean) * inv_std * ggamma + gbeta) / m)

:class:`CudnnGraphs` (float16/float32 data, float32 statistics): cuDNN's
batch norm forward-training, backward and inference nodes. Its running
averages are computed here from the saved mean and ``inv_std`` by the
formulas above (``var = 1 / inv_std**2 - eps``), not taken from cuDNN:
Chainer's are the unbiased ones, whatever a cuDNN version does. A shape
cuDNN refuses runs on :class:`Reductions` instead, said once.

The mean and ``inv_std`` kept for the backward pass are Chainer's
(``BatchNormalizationGrad`` and its double backward read them), in the
parameters' dtype. Both classes take NumPy arrays too: the tests hold the
maths against Chainer's own implementation in float64 on the CPU.
"""
import logging
import threading

import chainer
import numpy as np
from chainer.functions.normalization import batch_normalization as _bn

from dasktrain.kernels import frontend, geometry
from dasktrain.kernels.choices import (
    SaidOnce,
    Unbuildable,
    batchnorm_problem,
    cudnn_batchnorm_problem,
    use_cudnn,
)
from dasktrain.numerics import tf32_allowed

log = logging.getLogger(__name__)
said = SaidOnce()

#: Chainer's own selector, for what is not ours (the CPU, iDeep, other
#: axes): the default the class was defined with
CHAINER_SELECTOR = _bn._impl_selector

_gpu = {}
_gpu_lock = threading.Lock()


def _kernels():
    """The CuPy kernels, made on first use (compiled per dtype by CuPy)."""
    if _gpu:
        return _gpu
    with _gpu_lock:
        if not _gpu:
            _gpu.update(_make_kernels())
    return _gpu


def _make_kernels():
    import cupy
    k = {}
    k['sum'] = cupy.ReductionKernel(
        'T x', 'float64 y', 'static_cast<double>(x)', 'a + b', 'y = a',
        '0', 'dasktrain_bn_sum')
    k['sqdev'] = cupy.ReductionKernel(
        'T x, float64 m', 'float64 y',
        '(static_cast<double>(x) - m) * (static_cast<double>(x) - m)',
        'a + b', 'y = a', '0', 'dasktrain_bn_sqdev')
    k['dot'] = cupy.ReductionKernel(
        'T gy, T x, float64 m', 'float64 y',
        'static_cast<double>(gy) * (static_cast<double>(x) - m)',
        'a + b', 'y = a', '0', 'dasktrain_bn_dot')
    k['stats'] = cupy.ElementwiseKernel(
        'float64 mean64, float64 var64, float64 eps',
        'U mean, U var, U inv_std',
        'mean = mean64; var = var64; inv_std = rsqrt(var64 + eps)',
        'dasktrain_bn_stats')
    k['running'] = cupy.ElementwiseKernel(
        'float64 mean, float64 var, float64 decay, float64 adjust',
        'R r_mean, R r_var',
        'r_mean = r_mean * decay + mean * (1 - decay);'
        'r_var = r_var * decay + var * (1 - decay) * adjust',
        'dasktrain_bn_running')
    k['normalize'] = cupy.ElementwiseKernel(
        'T x, U mean, U inv_std, U gamma, U beta', 'T y',
        'y = gamma * (x - mean) * inv_std + beta', 'dasktrain_bn_fwd')
    k['gx'] = cupy.ElementwiseKernel(
        'T gy, T x, X mean, X inv_std, U gamma, U ggamma, U gbeta, '
        'U inv_m', 'T gx',
        'gx = (gamma * inv_std) * (gy - ((x - mean) * inv_std * ggamma'
        ' + gbeta) * inv_m)', 'dasktrain_bn_bwd')
    k['var_of'] = cupy.ElementwiseKernel(
        'U inv_std, float64 eps', 'float64 var',
        'var = fmax(1.0 / ((double)inv_std * (double)inv_std) - eps, '
        '0.0)', 'dasktrain_bn_var_of')
    return k


def _channel_sums(xp, name, *arrays):
    """Per-channel float64 sums over axes 0 and 2 of (n, c, r) arrays, in
    two stages: n * c rows of r, then the n partials of each channel."""
    if xp is np:
        if name == 'sum':
            rows = arrays[0].astype(np.float64).sum(axis=2)
        elif name == 'sqdev':
            d = arrays[0].astype(np.float64) - arrays[1]
            rows = (d * d).sum(axis=2)
        else:
            rows = (arrays[0].astype(np.float64) *
                    (arrays[1].astype(np.float64) - arrays[2])).sum(axis=2)
        return rows.sum(axis=0)
    return _kernels()[name](*arrays, axis=2).sum(axis=0)


def adjust(m):
    """Chainer's unbiased correction of the running variance."""
    return m / max(m - 1., 1.)


class Reductions:
    """Batch normalization by two-stage reductions (see the module)."""

    def forward(self, axis, gamma, x, x_layout, xp, expander, beta, eps,
                decay, running_mean, running_var):
        n, c, r = geometry.batchnorm_view(x.shape, gamma.ndim, axis)
        x3 = x.reshape(n, c, r)
        m = n * r
        interm = np.promote_types(x.dtype, gamma.dtype)
        mean64 = _channel_sums(xp, 'sum', x3) / m
        var64 = _channel_sums(xp, 'sqdev', x3, mean64[None, :, None]) / m
        if xp is np:
            mean = mean64.astype(interm)
            var = var64.astype(interm)
            inv_std = (1 / np.sqrt(var64 + eps)).astype(interm)
            y = (gamma[expander] * (x - mean[expander]) *
                 inv_std[expander] + beta[expander]).astype(x.dtype)
        else:
            mean = xp.empty(c, interm)
            var = xp.empty(c, interm)
            inv_std = xp.empty(c, interm)
            k = _kernels()
            k['stats'](mean64, var64, float(eps), mean, var, inv_std)
            y = k['normalize'](x, mean[expander], inv_std[expander],
                               gamma[expander].astype(interm, copy=False),
                               beta[expander].astype(interm, copy=False))
        if running_mean is not None:
            _update_running(xp, mean64, var64, decay, adjust(m),
                            running_mean, running_var)
        return y, x_layout, running_mean, running_var, mean, var, inv_std, \
            None

    def backward(self, axis, gamma, gy, x, x_layout, xp, expander, mean,
                 inv_std, eps, var, forward_data):
        n, c, r = geometry.batchnorm_view(x.shape, gamma.ndim, axis)
        m = n * r
        x3, gy3 = x.reshape(n, c, r), gy.reshape(n, c, r)
        mean64 = mean.astype(np.float64)
        gbeta = _channel_sums(xp, 'sum', gy3).astype(gamma.dtype)
        ggamma = (_channel_sums(xp, 'dot', gy3, x3, mean64[None, :, None]) *
                  inv_std).astype(gamma.dtype)
        inv_m = gamma.dtype.type(1. / m)
        if xp is np:
            x_hat = (x - mean[expander]) * inv_std[expander]
            gx = (gamma * inv_std)[expander] * (
                gy - (x_hat * ggamma[expander] + gbeta[expander]) * inv_m)
            gx = gx.astype(x.dtype, copy=False)
        else:
            gx = _kernels()['gx'](gy, x, mean[expander], inv_std[expander],
                                  gamma[expander], ggamma[expander],
                                  gbeta[expander], inv_m)
        return gx, x_layout, ggamma, gbeta


def _update_running(xp, mean64, var64, decay, adj, running_mean,
                    running_var):
    if xp is np:
        running_mean *= decay
        running_mean += (1 - decay) * mean64
        running_var *= decay
        running_var += (1 - decay) * adj * var64
    else:
        _kernels()['running'](mean64, var64, float(decay), float(adj),
                              running_mean, running_var)


class CudnnGraphs:
    """Batch normalization through cuDNN's graphs (see the module); the
    shapes cuDNN refuses run on :class:`Reductions`."""

    def __init__(self):
        self.fallback = Reductions()

    def forward(self, axis, gamma, x, x_layout, xp, expander, beta, eps,
                decay, running_mean, running_var):
        done = _cudnn_forward(x, gamma, beta, axis, eps, decay,
                              running_mean, running_var)
        if done is None:
            return self.fallback.forward(axis, gamma, x, x_layout, xp,
                                         expander, beta, eps, decay,
                                         running_mean, running_var)
        y, mean, inv_std = done
        return y, x_layout, running_mean, running_var, mean, None, inv_std, \
            None

    def backward(self, axis, gamma, gy, x, x_layout, xp, expander, mean,
                 inv_std, eps, var, forward_data):
        done = _cudnn_backward(gy, x, gamma, axis, mean, inv_std)
        if done is None:
            return self.fallback.backward(axis, gamma, gy, x, x_layout, xp,
                                          expander, mean, inv_std, eps, var,
                                          forward_data)
        gx, ggamma, gbeta = done
        return gx, x_layout, ggamma, gbeta


def _stay(topic, reason):
    if said.first(topic, reason):
        log.info('%s: the project\'s reductions (%s)', topic, reason)
    return None


def _context():
    import cupy
    device = cupy.cuda.runtime.getDevice()
    stream = cupy.cuda.get_current_stream().ptr
    return (device, stream, bool(chainer.config.cudnn_deterministic),
            tf32_allowed())


def _cudnn_forward(x, gamma, beta, axis, eps, decay, running_mean,
                   running_var):
    import cupy
    cudnn = frontend.load()[0]
    n, c, r = geometry.batchnorm_view(x.shape, gamma.ndim, axis)
    dims, per_channel = (n, c, r, 1), (1, c, 1, 1)
    device, stream, det, tf32 = _context()
    # cuDNN's own running averages are not used (the module says why):
    # its momentum is a constant, so that a decay changing every step
    # (Chainer's finetune mode) builds no graph of its own
    key = ('bn', device, dims, x.dtype.name, gamma.dtype.name, float(eps),
           det, tf32)
    host = {6: np.array([eps], np.float32), 7: np.array([0.1], np.float32)}

    def make(cudnn, g):
        io = frontend.data_type(cudnn, x.dtype)
        f32 = cudnn.data_type.FLOAT
        t = [frontend.nchw(g, 'X', 1, dims, io)]
        t += [frontend.nchw(g, name, uid, per_channel, f32) for name, uid in
              (('scale', 2), ('bias', 3), ('mean_in', 4), ('var_in', 5))]
        scalars = [g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                            data_type=f32, is_pass_by_value=True, uid=uid)
                   for name, uid in (('epsilon', 6), ('momentum', 7))]
        outs = g.batchnorm(input=t[0], scale=t[1], bias=t[2],
                           in_running_mean=t[3], in_running_var=t[4],
                           epsilon=scalars[0], momentum=scalars[1],
                           compute_data_type=f32, name='bn')
        y, mean, inv_var, next_mean, next_var = outs
        frontend.output(y, 8, dims, io)
        for out, uid in ((mean, 9), (inv_var, 10), (next_mean, 11),
                         (next_var, 12)):
            frontend.output(out, uid, per_channel, f32)
        return list(range(1, 13)), host

    entry = frontend.build(cudnn, key, make, x.dtype, det, tf32, device,
                           stream)
    if isinstance(entry, Unbuildable):
        return _stay('batch normalization', entry.reason)
    x = frontend.ready(x)
    f32 = np.float32
    gamma32 = cupy.ascontiguousarray(gamma, f32)
    beta32 = cupy.ascontiguousarray(beta, f32)
    y = cupy.empty_like(x)
    mean, inv_std = cupy.empty(c, f32), cupy.empty(c, f32)
    # cuDNN's own running averages, in and out: four arrays of the pool
    # (rows of one array would start unaligned where c % 4)
    scratch = [cupy.zeros(c, f32) for _ in range(4)]
    if not frontend.execute(
            cudnn, key, entry, device, stream,
            [x.data.ptr, gamma32.data.ptr, beta32.data.ptr,
             scratch[0].data.ptr, scratch[1].data.ptr, None, None,
             y.data.ptr, mean.data.ptr, inv_std.data.ptr,
             scratch[2].data.ptr, scratch[3].data.ptr]):
        return None
    if running_mean is not None:
        var64 = _kernels()['var_of'](inv_std, float(eps))
        _update_running(cupy, mean.astype(np.float64), var64, decay,
                        adjust(n * r), running_mean, running_var)
    return y, mean.astype(gamma.dtype, copy=False), \
        inv_std.astype(gamma.dtype, copy=False)


def _cudnn_backward(gy, x, gamma, axis, mean, inv_std):
    import cupy
    cudnn = frontend.load()[0]
    n, c, r = geometry.batchnorm_view(x.shape, gamma.ndim, axis)
    dims, per_channel = (n, c, r, 1), (1, c, 1, 1)
    device, stream, det, tf32 = _context()
    key = ('dbn', device, dims, x.dtype.name, gamma.dtype.name, det, tf32)

    def make(cudnn, g):
        io = frontend.data_type(cudnn, x.dtype)
        f32 = cudnn.data_type.FLOAT
        dy = frontend.nchw(g, 'DY', 1, dims, io)
        xx = frontend.nchw(g, 'X', 2, dims, io)
        scale, m, iv = [frontend.nchw(g, name, uid, per_channel, f32)
                        for name, uid in (('scale', 3), ('mean', 4),
                                          ('inv_var', 5))]
        dx, dscale, dbias = g.batchnorm_backward(
            grad=dy, input=xx, scale=scale, mean=m, inv_variance=iv,
            compute_data_type=f32, name='dbn')
        frontend.output(dx, 6, dims, io)
        frontend.output(dscale, 7, per_channel, f32)
        frontend.output(dbias, 8, per_channel, f32)
        return list(range(1, 9)), None

    entry = frontend.build(cudnn, key, make, x.dtype, det, tf32, device,
                           stream)
    if isinstance(entry, Unbuildable):
        return _stay('batch normalization backward', entry.reason)
    f32 = np.float32
    gy, x = frontend.ready(gy), frontend.ready(x)
    gamma32 = cupy.ascontiguousarray(gamma, f32)
    mean32 = cupy.ascontiguousarray(mean, f32)
    inv32 = cupy.ascontiguousarray(inv_std, f32)
    gx = cupy.empty_like(x)
    ggamma, gbeta = cupy.empty(c, f32), cupy.empty(c, f32)
    if not frontend.execute(
            cudnn, key, entry, device, stream,
            [gy.data.ptr, x.data.ptr, gamma32.data.ptr, mean32.data.ptr,
             inv32.data.ptr, gx.data.ptr, ggamma.data.ptr, gbeta.data.ptr]):
        return None
    return gx, ggamma.astype(gamma.dtype, copy=False), \
        gbeta.astype(gamma.dtype, copy=False)


def cudnn_inference(x, gamma, beta, mean, var, eps, axis):
    """``FixedBatchNormalization``'s output through cuDNN's batch norm
    inference node, or None (Chainer's path runs)."""
    import cupy
    view = geometry.batchnorm_view(x.shape, gamma.ndim, axis)
    if isinstance(view, str):
        return None
    problem = batchnorm_problem(x.dtype.name, gamma.dtype.name, None) or \
        cudnn_batchnorm_problem(x.dtype.name, gamma.dtype.name)
    if problem:
        return _stay('batch normalization inference', problem)
    cudnn = frontend.load()[0]
    n, c, r = view
    dims, per_channel = (n, c, r, 1), (1, c, 1, 1)
    device, stream, det, tf32 = _context()
    key = ('bn_inference', device, dims, x.dtype.name, det, tf32)

    def make(cudnn, g):
        io = frontend.data_type(cudnn, x.dtype)
        f32 = cudnn.data_type.FLOAT
        xx = frontend.nchw(g, 'X', 1, dims, io)
        m, iv, scale, bias = [frontend.nchw(g, name, uid, per_channel, f32)
                              for name, uid in (('mean', 2), ('inv_var', 3),
                                                ('scale', 4), ('bias', 5))]
        y = g.batchnorm_inference(input=xx, mean=m, inv_variance=iv,
                                  scale=scale, bias=bias,
                                  compute_data_type=f32, name='bn_inference')
        frontend.output(y, 6, dims, io)
        return list(range(1, 7)), None

    entry = frontend.build(cudnn, key, make, x.dtype, det, tf32, device,
                           stream)
    if isinstance(entry, Unbuildable):
        return _stay('batch normalization inference', entry.reason)
    f32 = np.float32
    x = frontend.ready(x)
    inv = (1 / cupy.sqrt(var.astype(np.float64) + eps)).astype(f32)
    params = [cupy.ascontiguousarray(a, f32) for a in (mean, gamma, beta)]
    y = cupy.empty_like(x)
    if not frontend.execute(
            cudnn, key, entry, device, stream,
            [x.data.ptr, params[0].data.ptr, inv.data.ptr,
             params[1].data.ptr, params[2].data.ptr, y.data.ptr]):
        return None
    return y


def select(bn, inputs):
    """``BatchNormalization``'s ``impl_selector``: cuDNN's graphs, else the
    project's reductions, for per-channel batch normalization of CuPy
    arrays; Chainer's choice for anything else."""
    x, gamma, _ = inputs
    if not _is_cupy(x) or \
            isinstance(geometry.batchnorm_view(x.shape, gamma.ndim, bn.axis),
                       str) or \
            batchnorm_problem(x.dtype.name, gamma.dtype.name,
                              bn.input_layouts[0]):
        return CHAINER_SELECTOR(bn, inputs)
    if use_cudnn(chainer.config.use_cudnn) and \
            cudnn_batchnorm_problem(x.dtype.name, gamma.dtype.name) is None \
            and frontend.load()[0] is not None:
        return CudnnGraphs()
    return Reductions()


def _is_cupy(a):
    cupy = chainer.backends.cuda.cupy
    return chainer.backends.cuda.available and isinstance(a, cupy.ndarray)
