"""Chainer's convolutions and batch normalization on a GPU as fast as the
card allows: cuDNN 9 graphs, and batch normalization statistics at full
occupancy.

How it hooks in: it replaces, in Chainer's own classes, the GPU methods of
four function nodes (no fork of Chainer, no change to a model):

=======================================  ==================================
Chainer 7.8.1                            here
=======================================  ==================================
``Convolution2DFunction.forward_gpu``    :func:`convolution.forward`
``Deconvolution2DFunction.forward_gpu``  :func:`convolution.data_gradient`
``Convolution2DGradW.forward_gpu``       :func:`convolution.filter_gradient`
``BatchNormalization``'s impl selector   :func:`batchnorm.select`
``FixedBatchNormalization.forward``      :func:`batchnorm.cudnn_inference`
=======================================  ==================================

Each replacement runs only on CuPy arrays and falls back to Chainer's own
method wherever it does not apply, saying why once in the log (never an
error). cuDNN runs where the cuDNN extra (``cudnn12``/``cudnn13``:
``nvidia-cudnn-frontend`` and the cuDNN 9 wheels) is installed and
Chainer's ``use_cudnn`` is not ``'never'`` (``dasktrain train --cudnn off``
sets it); ``cudnn_deterministic`` picks deterministic engines only;
float32 runs on tensor cores (TF32) only where the run allows it
(:func:`dasktrain.numerics.tf32_allowed`, ``--tf32``). Batch normalization
without cuDNN runs on the project's two-stage reductions.

:func:`install` runs when Chainer is first imported in any process that has
dasktrain installed (``dasktrain-chainer.pth`` puts the hook in place at
interpreter start, see :mod:`dasktrain._compat`): the project's models, a
user's ``--model file.py:Net``, a ``DistributedUpdater`` script and ChainerMN
scripts under ``dasktrain launch`` all get it. ``DASKTRAIN_KERNELS=off`` in
the environment leaves Chainer as it is; :func:`uninstall` restores it in a
running process. Nothing here touches a GPU before the first call on one.
"""
import os
import threading

_lock = threading.Lock()
_originals = {}


def _targets():
    from chainer.functions.connection import convolution_2d as conv
    from chainer.functions.connection import deconvolution_2d as deconv
    from chainer.functions.normalization import batch_normalization as bn
    return conv, deconv, bn


def install():
    """Hook Chainer's function nodes (idempotent; cheap: no CUDA call)."""
    with _lock:
        if _originals:
            return
        conv, deconv, bn = _targets()
        from dasktrain.kernels import batchnorm, convolution

        def wrap(cls, name, ours, retain=None):
            original = getattr(cls, name)
            _originals[(cls, name)] = original

            def method(self, inputs):
                if retain is not None:
                    self.retain_inputs(retain)
                out = ours(self, inputs)
                return original(self, inputs) if out is None else out
            method.__name__ = name
            method.__doc__ = (f'{ours.__module__}.{ours.__name__}, else '
                              f"Chainer's own {cls.__name__}.{name}.")
            method.__wrapped__ = original
            setattr(cls, name, method)

        wrap(conv.Convolution2DFunction, 'forward_gpu', convolution.forward,
             (0, 1))
        wrap(conv.Convolution2DGradW, 'forward_gpu',
             convolution.filter_gradient, (0, 1))
        wrap(deconv.Deconvolution2DFunction, 'forward_gpu',
             convolution.data_gradient, (0, 1))
        wrap(bn.FixedBatchNormalization, 'forward', _fixed_forward)
        defaults = bn.BatchNormalization.__init__.__defaults__
        _originals[(bn.BatchNormalization, '__defaults__')] = defaults
        bn.BatchNormalization.__init__.__defaults__ = \
            defaults[:-1] + (batchnorm.select,)


def uninstall():
    """Restore Chainer's own methods."""
    with _lock:
        conv, deconv, bn = _targets()
        for (cls, name), original in _originals.items():
            if name == '__defaults__':
                cls.__init__.__defaults__ = original
            else:
                setattr(cls, name, original)
        _originals.clear()


def installed():
    return bool(_originals)


def wanted(environ=os.environ):
    """Whether :func:`install` should run at Chainer's import.

    >>> wanted({}), wanted({'DASKTRAIN_KERNELS': 'off'})
    (True, False)
    """
    return environ.get('DASKTRAIN_KERNELS', 'on').lower() not in (
        'off', '0', 'no', 'false')


def status():
    """``{'cudnn': 'on' or why not, 'graphs': n, 'unbuildable': {...}}``
    for reports (loads the frontend: call it where a GPU is in use)."""
    from dasktrain.kernels import frontend
    cudnn, why = frontend.load()
    return {'hooks': installed(),
            'cudnn': why if cudnn is None else
            f'on (cuDNN {cudnn.backend_version()}, frontend '
            f'{cudnn.__version__})',
            'graphs': len(frontend.graphs),
            'unbuildable': frontend.graphs.unbuildable()}


def _fixed_forward(fn, inputs):
    """``FixedBatchNormalization.forward`` through cuDNN's inference node
    for CuPy arrays, or None. Sets what Chainer's method sets for the
    backward pass (retained inputs, axes, expander); ``inv_std`` and
    ``inv_var`` stay None, which ``FixedBatchNormalizationGrad`` computes
    when it needs them (as after Chainer's own cuDNN path)."""
    from chainer.functions.normalization import batch_normalization as bn

    from dasktrain.kernels import batchnorm, convolution
    x, gamma, beta, mean, var = inputs
    if not batchnorm._is_cupy(x) or convolution.cudnn_now() is None:
        return None
    axis = bn._compute_axis(x.ndim, gamma.ndim, fn.axis)
    y = batchnorm.cudnn_inference(x, gamma, beta, mean, var, fn.eps, axis)
    if y is None:
        return None
    fn.retain_inputs((0, 1, 3, 4))
    fn.axis = axis
    fn.key_axis = bn._compute_key_axis(x.ndim, gamma.ndim, axis)
    expander = [None for _ in range(x.ndim)]
    for i in fn.key_axis:
        expander[i] = slice(None)
    fn.expander = tuple(expander)
    return y,
