"""How a rank computes: the run's numerics as Chainer's configuration and
CuPy's one process-wide switch, applied around a rank (:func:`computing`),
and what a layer below asks of them (:func:`tf32_allowed`).

A run's options ``dtype``, ``tf32``, ``cudnn`` and ``deterministic``
become Chainer configuration keys, set with ``chainer.using_config`` for
the rank's thread, so every rank, wherever it runs (this process, a worker
process per device, a launched rank, a cluster's rank), computes as the
run says:

* ``dtype``: ``chainer.config.dtype`` (``'mixed16'``: Chainer's own
  ``chainer.mixed16``, float16 activations and parameters, float32
  BatchNorm; the optimizer's side, loss scaling and float32 updates, is
  the loop's); None leaves Chainer's own (``CHAINER_DTYPE``, else
  float32);
* ``cudnn``: ``'off'`` is ``chainer.config.use_cudnn = 'never'``; ``'auto'``
  leaves Chainer's own (``CHAINER_USE_CUDNN``, else ``'auto'``);
* ``deterministic``: ``chainer.config.cudnn_deterministic``;
* ``tf32``: the key ``chainer.config.dasktrain_tf32``, which
  :func:`tf32_allowed` reads (dasktrain's own cuDNN layer asks it), and
  CuPy's compute type for float32 matrix products
  (``cupy._core.set_compute_type``, what ``CUPY_TF32=1`` sets): TF32 on
  GPUs of compute capability 8.0 and newer, float32 otherwise.

CuPy's compute type is one setting for the whole process, not per
thread: two runs in one process asking for different ``tf32`` would
change each other's products, so the second is refused
(:class:`ProcessSetting`). Without ``tf32`` a compute type of TF32 (from
``CUPY_TF32=1``) is set back to CuPy's default while the run computes:
the run's record says float32, and so do its products.

Owns the mapping from a run's options to those settings and their
application; may not decide which devices a rank has.
"""
import contextlib
import logging
import threading

import chainer
import numpy as np

from dasktrain.errors import UserError, argument

logger = logging.getLogger(__name__)

DTYPES = ('float32', 'float64', 'mixed16')
CUDNN = ('auto', 'off')
# TF32's tensor cores came with Ampere (compute capability 8.0); CuPy
# falls back to float32, with a warning, below it.
TF32_CAPABILITY = 80
# The Chainer configuration key tf32_allowed reads.
TF32_KEY = 'dasktrain_tf32'


def chainer_settings(dtype=None, tf32=False, cudnn='auto',
                     deterministic=False):
    """The Chainer configuration a rank computes under: ``{key: value}``
    for ``chainer.using_config``. A key left out keeps Chainer's own
    value.

    Examples
    --------
    >>> sorted(chainer_settings())
    ['cudnn_deterministic', 'dasktrain_tf32']
    >>> s = chainer_settings('mixed16', tf32=True, cudnn='off')
    >>> s['dtype'] is chainer.mixed16, s['use_cudnn'], s['dasktrain_tf32']
    (True, 'never', True)
    >>> chainer_settings('float64')['dtype']
    dtype('float64')
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f'dtype must be one of {", ".join(DTYPES)} or '
                         f'None, got {dtype!r}')
    if cudnn not in CUDNN:
        raise ValueError(f"cudnn must be 'auto' or 'off', got {cudnn!r}")
    settings = {'cudnn_deterministic': bool(deterministic),
                TF32_KEY: bool(tf32)}
    if dtype == 'mixed16':
        settings['dtype'] = chainer.mixed16
    elif dtype is not None:
        settings['dtype'] = np.dtype(dtype)
    if cudnn == 'off':
        settings['use_cudnn'] = 'never'
    return settings


def tf32_allowed():
    """Whether the computation running in this thread may round float32
    inputs of matrix products and convolutions to TF32 (a run's ``tf32``;
    False outside a run, and under ``chainer.config.dasktrain_tf32 =
    False``).

    >>> tf32_allowed()
    False
    >>> with chainer.using_config(TF32_KEY, True):
    ...     tf32_allowed()
    True
    """
    return bool(getattr(chainer.config, TF32_KEY, False))


def float32_compute(tf32, capabilities):
    """CuPy's compute type for float32 products on GPUs of compute
    ``capabilities`` (CuPy's strings, ``'80'`` for 8.0): ``'tf32'`` where
    asked and every GPU has TF32, else ``'float32'``; and the line to log
    where TF32 was asked for and cannot be had (else None).

    >>> float32_compute(True, ['90', '80'])
    ('tf32', None)
    >>> float32_compute(False, ['90'])
    ('float32', None)
    >>> float32_compute(True, ['75'])[0]
    'float32'
    """
    if not tf32:
        return 'float32', None
    old = [c for c in capabilities if int(c) < TF32_CAPABILITY]
    if old:
        return 'float32', (f'tf32: TF32 needs compute capability 8.0 or '
                           f'newer, a GPU here has {int(old[0]) / 10:.1f}: '
                           'float32 products stay float32')
    return 'tf32', None


class ProcessSetting:
    """A setting the whole process shares (CuPy's compute type), held by
    the runs computing in it: the first sets it (``apply(value)`` returns
    what to restore), the last to leave restores it, and a run asking for
    another value while others hold one is refused with one line.

    >>> seen = []
    >>> s = ProcessSetting('tf32', lambda v: seen.append(v) or 'before')
    >>> with s.held(True), s.held(True):
    ...     pass
    >>> seen
    [True, 'before']
    """

    def __init__(self, name, apply):
        self.name, self._apply = name, apply
        self._lock = threading.Lock()
        self._value, self._count, self._before = None, 0, None

    @contextlib.contextmanager
    def held(self, value):
        with self._lock:
            if self._count and self._value != value:
                raise UserError(
                    f'{argument(self.name)}: this run asks for {value}, '
                    f'another run in this process computes with '
                    f'{self._value}, and CuPy holds one setting per '
                    'process; run it in a process of its own, or with the '
                    'same setting')
            if not self._count:
                self._before = self._apply(value)
                self._value = value
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1
                if not self._count:
                    self._apply(self._before)
                    self._value = self._before = None


def _cupy_compute(choice):
    """Set CuPy's compute type for float32 as ``choice`` ('tf32',
    'float32', or a value returned before: restored as it was); return
    what was set before. 'float32' turns TF32 off and leaves any other
    type (CuPy's default, a user's PEDANTIC) as it is. CuPy 13 and 14
    export ``get_compute_type`` and ``set_compute_type`` from
    ``cupy._core``; the constants live in ``_routines_linalg`` (a
    ``cpdef enum``), where CuPy's own tests take them from."""
    import cupy
    from cupy._core import _routines_linalg as linalg
    before = cupy._core.get_compute_type(np.float32)
    if choice == 'tf32':
        wanted = linalg.COMPUTE_TYPE_TF32
    elif choice == 'float32':
        wanted = linalg.COMPUTE_TYPE_DEFAULT \
            if before == linalg.COMPUTE_TYPE_TF32 else before
    else:
        wanted = choice
    if wanted != before:
        cupy._core.set_compute_type(np.float32, wanted)
    return before


_CUPY_FLOAT32 = ProcessSetting('tf32', _cupy_compute)


def _capabilities(gpus):
    import cupy
    return [cupy.cuda.Device(i).compute_capability for i in gpus]


@contextlib.contextmanager
def computing(dtype=None, tf32=False, cudnn='auto', deterministic=False,
              gpus=()):
    """Compute as a run says while inside: Chainer's configuration for
    this thread (:func:`chainer_settings`) and, where the run has GPUs
    (``gpus``: their CUDA ids in this process), CuPy's compute type for
    float32 products (:func:`float32_compute`), for the process.

    A script of its own (a ``Trainer`` with
    :class:`~dasktrain.training.updater.DistributedUpdater`) gets what
    ``dasktrain train --tf32 --cudnn off`` gets with::

        with dasktrain.computing(tf32=True, cudnn='off', gpus=[0, 1]):
            trainer.run()
    """
    settings = chainer_settings(dtype, tf32, cudnn, deterministic)
    with contextlib.ExitStack() as stack:
        for key, value in settings.items():
            stack.enter_context(chainer.using_config(key, value))
        if gpus:
            import cupy
            choice, line = float32_compute(
                tf32, _capabilities(gpus) if tf32 else ())
            if line:
                logger.warning(line)
            # CuPy checks the current GPU's capability when TF32 is set:
            # the run's own, never one it was not given
            stack.enter_context(cupy.cuda.Device(gpus[0]))
            stack.enter_context(_CUPY_FLOAT32.held(choice))
        yield
