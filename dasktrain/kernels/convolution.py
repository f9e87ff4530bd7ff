"""Chainer's 2-D convolutions on cuDNN 9 graphs: the forward pass, the
data gradient and the filter gradient.

Chainer 7.8.1 computes a convolution's gradients with other function
nodes: the data gradient is ``deconvolution_2d`` (a
``Deconvolution2DFunction``, whose forward is a convolution's backward
data pass) and the filter gradient is ``Convolution2DGradW``. So the
three ``forward_gpu`` methods below are all there is to hook, and double
backward, ``Deconvolution2D`` links and grouped or dilated convolutions
come with them. Each returns None where cuDNN does not run (Chainer's
``use_cudnn`` is ``'never'``, no cuDNN frontend, a case cuDNN refuses):
the hook then calls Chainer's own method, and the reason is logged once.

Each call: the geometry (:mod:`~dasktrain.kernels.geometry`), a graph
looked up by (op, GPU, geometry, dtype, deterministic, TF32) and built on
its first use, the output allocated from CuPy's pool, and the graph
queued on CuPy's current stream. A bias is added by CuPy afterwards, as
Chainer's own cuDNN path added it with a second call.
"""
import logging

import chainer
import numpy as np

from dasktrain.kernels import frontend, geometry
from dasktrain.kernels.choices import (
    SaidOnce,
    Unbuildable,
    conv_problem,
    use_cudnn,
)
from dasktrain.numerics import tf32_allowed

log = logging.getLogger(__name__)
said = SaidOnce()
def cudnn_now():
    """The cuDNN frontend when cuDNN may run here now, else None."""
    if not use_cudnn(chainer.config.use_cudnn):
        return None
    return frontend.load()[0]


def stay(topic, reason):
    """Chainer's path for ``topic``, saying why once per process."""
    if said.first(topic, reason):
        log.info("%s: Chainer's own GPU path (%s)", topic, reason)
    return None


_OPS = {
    # kind: (the output's role, the frontend's call)
    'fprop': 'output',
    'dgrad': 'image',
    'wgrad': 'filter',
}


def run(kind, geom, dtype, image, filt, output):
    """Queue ``kind`` (fprop, dgrad, wgrad) of ``geom`` on the current GPU
    and stream; two of ``image``, ``filt``, ``output`` are given, the
    third (the output of ``kind``) is None and allocated here. Returns
    it, or None where cuDNN refused the graph."""
    import cupy
    cudnn = frontend.load()[0]
    device = cupy.cuda.runtime.getDevice()
    stream = cupy.cuda.get_current_stream().ptr
    deterministic = bool(chainer.config.cudnn_deterministic)
    tf32 = tf32_allowed()
    key = (kind, device, geom, dtype.name, deterministic, tf32)

    def make(cudnn, g):
        io = frontend.data_type(cudnn, dtype)
        compute = frontend.compute_type(cudnn, dtype)
        attrs = dict(pre_padding=list(geom.pre_padding),
                     post_padding=list(geom.post_padding),
                     stride=list(geom.stride),
                     dilation=list(geom.dilation),
                     compute_data_type=compute)
        if kind == 'fprop':
            x = frontend.nchw(g, 'X', 1, geom.image, io)
            w = frontend.nchw(g, 'W', 2, geom.filter, io)
            y = g.conv_fprop(image=x, weight=w, name='fprop', **attrs)
            frontend.output(y, 3, geom.output, io)
        elif kind == 'dgrad':
            w = frontend.nchw(g, 'W', 2, geom.filter, io)
            dy = frontend.nchw(g, 'DY', 3, geom.output, io)
            dx = g.conv_dgrad(loss=dy, filter=w, name='dgrad', **attrs)
            frontend.output(dx, 1, geom.image, io)
        else:
            x = frontend.nchw(g, 'X', 1, geom.image, io)
            dy = frontend.nchw(g, 'DY', 3, geom.output, io)
            dw = g.conv_wgrad(image=x, loss=dy, name='wgrad', **attrs)
            frontend.output(dw, 2, geom.filter, io)
        return [1, 2, 3], None

    entry = frontend.build(cudnn, key, make, dtype, deterministic, tf32,
                           device, stream)
    if isinstance(entry, Unbuildable):
        return stay(f'convolution {kind}', entry.reason)
    arrays = {'image': image, 'filter': filt, 'output': output}
    role = _OPS[kind]
    shape = getattr(geom, role)
    arrays[role] = cupy.empty(shape, dtype=dtype)
    if not frontend.execute(cudnn, key, entry, device, stream,
                            [arrays[r].data.ptr for r in
                             ('image', 'filter', 'output')]):
        return None
    return arrays[role]


def forward(fn, inputs):
    """``Convolution2DFunction.forward_gpu`` through cuDNN, or None."""
    if cudnn_now() is None:
        return None
    x, w = inputs[:2]
    b = inputs[2] if len(inputs) == 3 else None
    if fn.cudnn_fast and fn.cover_all:
        return None  # Chainer says why it cannot
    problem = conv_problem((x.dtype.name, w.dtype.name),
                           fn.input_layouts[:2], x.ndim)
    if problem:
        return stay('convolution', problem)
    geom = geometry.forward(x.shape, w.shape, (fn.sy, fn.sx),
                            (fn.ph, fn.pw), fn.cover_all, (fn.dy, fn.dx))
    if isinstance(geom, str):
        return stay('convolution', geom)
    if geom.groups != fn.groups:
        return stay('convolution', f'{geom.groups} groups, not {fn.groups}')
    y = run('fprop', geom, x.dtype, frontend.ready(x), frontend.ready(w),
            None)
    if y is None:
        return None
    if b is not None:
        y += b.reshape(1, b.size, 1, 1)
    return y,


def data_gradient(fn, inputs):
    """``Deconvolution2DFunction.forward_gpu`` (a convolution's data
    gradient) through cuDNN, or None. Chainer's ``_calc_out_size`` and
    ``_set_cover_all`` run first, as in Chainer's own method: the output
    size and ``cover_all`` are the function's state for its backward."""
    if cudnn_now() is None:
        return None
    x, w = inputs[:2]
    b = inputs[2] if len(inputs) == 3 else None
    problem = conv_problem((x.dtype.name, w.dtype.name),
                           fn.input_layouts[:2], x.ndim)
    if problem:
        return stay('deconvolution', problem)
    fn._calc_out_size(x.shape, w.shape)
    fn._set_cover_all(x.shape, w.shape)
    geom = geometry.data_gradient(x.shape, w.shape, (fn.outh, fn.outw),
                                  fn.groups, (fn.sy, fn.sx), (fn.ph, fn.pw),
                                  (fn.dy, fn.dx))
    if isinstance(geom, str):
        return stay('deconvolution', geom)
    y = run('dgrad', geom, x.dtype, None, frontend.ready(w),
            frontend.ready(x))
    if y is None:
        return None
    if b is not None:
        y += b.reshape(1, b.size, 1, 1)
    return y,


def filter_gradient(fn, inputs):
    """``Convolution2DGradW.forward_gpu`` through cuDNN, or None."""
    if cudnn_now() is None:
        return None
    x, gy = inputs
    # x and gy come in the forward pass's layouts (a channel-last x with a
    # channel-first W is Chainer's): only all-standard ones are NCHW here
    problem = conv_problem((x.dtype.name, gy.dtype.name,
                            np.dtype(fn.W_dtype).name),
                           (fn.w_layout, *fn.input_layouts), x.ndim)
    if problem:
        return stay('convolution filter gradient', problem)
    geom = geometry.filter_gradient(x.shape, gy.shape, fn.W_shape,
                                    (fn.sy, fn.sx), (fn.ph, fn.pw),
                                    (fn.dy, fn.dx))
    if isinstance(geom, str):
        return stay('convolution filter gradient', geom)
    if geom.groups != fn.groups:
        return stay('convolution filter gradient',
                    f'{geom.groups} groups, not {fn.groups}')
    gw = run('wgrad', geom, x.dtype, frontend.ready(x), None,
             frontend.ready(gy))
    return None if gw is None else (gw,)
