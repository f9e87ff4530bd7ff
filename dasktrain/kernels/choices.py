"""What the GPU hooks decide before any CUDA call: pure functions of
Chainer's configuration, the arrays' dtypes and layouts, and the versions
found, plus the bounded cache of built graphs.

* :func:`use_cudnn`: Chainer's ``use_cudnn`` (``'always'``, ``'auto'``,
  ``'never'``) as Chainer reads it: anything but ``'never'`` asks for
  cuDNN where it can run.
* :func:`conv_problem`, :func:`batchnorm_problem`: why a call stays on
  Chainer's own path (None: it need not).
* :func:`deselected_notes`: which cuDNN engines a graph may not run,
  by their numerical notes, as PyTorch and MLX filter them:
  nondeterministic ones under ``cudnn_deterministic``, those that
  down-convert their inputs always, and tensor-core ones for float32
  unless TF32 is allowed (float32 on a tensor core is TF32).
* :func:`frontend_problem`: whether the cuDNN frontend found is one this
  code was written against.
* :class:`GraphCache`: built graphs by key, least recently used evicted
  past ``maxsize``; a key that cannot be built is kept as its reason, so
  that it is neither built again nor logged twice.
"""
import collections
import re
import threading

from dasktrain.kernels.geometry import DTYPES

#: the cuDNN frontend versions whose Python API (``cudnn.pygraph``,
#: ``_get_variant_pack_uids_sorted``, ``_execute_with_ptrs``) this code was
#: written and checked against: 1.23.x (later versions reshaped the API)
FRONTEND = ((1, 23), (1, 24))
#: cuDNN 9 (the graph API's norm and convolution nodes, the wheels)
MIN_BACKEND = 90000
#: dtypes a convolution runs in on cuDNN's graphs: float64 convolutions
#: gave NaN there (cuDNN 9.19 on an H100, through frontend 1.23) and stay
#: on Chainer's path, which is float64 throughout
CONV_DTYPES = ('float16', 'float32')
#: graphs kept per process (each a few engine plans): every distinct
#: shape of every layer of a few models, forward and backward
CACHE_SIZE = 512


def use_cudnn(setting):
    """Whether Chainer's ``use_cudnn`` setting lets cuDNN run (Chainer's
    ``should_use_cudnn('>=auto')``).

    >>> use_cudnn('auto'), use_cudnn('always'), use_cudnn('never')
    (True, True, False)
    """
    if setting not in ('always', 'auto', 'never'):
        raise ValueError("chainer.config.use_cudnn must be 'always', 'auto' "
                         f"or 'never', got {setting!r}")
    return setting != 'never'


def conv_problem(dtypes, layouts, ndim=4):
    """Why a convolution of arrays of ``dtypes`` (names) and Chainer
    memory ``layouts`` stays on Chainer's path, or None.

    >>> conv_problem(('float32', 'float32'), (None, None)) is None
    True
    >>> conv_problem(('float16', 'float32'), (None, None))
    'mixed dtypes float16, float32'
    >>> conv_problem(('float32', 'float32'), ('CUDNN_CHANNEL_LAST_X', None))
    'a non-standard memory layout'
    >>> conv_problem(('float64', 'float64'), (None, None))
    'dtype float64 (cuDNN graphs run float16, float32)'
    """
    if ndim != 4:
        return f'{ndim}-dimensional arrays'
    if any(layout is not None for layout in layouts):
        return 'a non-standard memory layout'
    if len(set(dtypes)) != 1:
        return f'mixed dtypes {", ".join(dtypes)}'
    if dtypes[0] not in CONV_DTYPES:
        return f'dtype {dtypes[0]} (cuDNN graphs run {", ".join(CONV_DTYPES)})'
    return None


def batchnorm_problem(x_dtype, gamma_dtype, layout):
    """Why a batch normalization of ``x_dtype`` with parameters of
    ``gamma_dtype`` stays on Chainer's path, or None. (The axes are
    :func:`~dasktrain.kernels.geometry.batchnorm_view`'s.)

    >>> batchnorm_problem('float16', 'float32', None) is None
    True
    >>> batchnorm_problem('float32', 'float16', None)
    'parameters in float16'
    """
    if layout is not None:
        return 'a non-standard memory layout'
    if x_dtype not in DTYPES:
        return f'dtype {x_dtype}'
    if gamma_dtype not in ('float32', 'float64'):
        return f'parameters in {gamma_dtype}'
    return None


def cudnn_batchnorm_problem(x_dtype, gamma_dtype):
    """Why cuDNN's batch normalization graph is not tried (the project's
    kernels run instead), or None: its statistics are float32, so float64
    runs (and float64 parameters) keep their precision on the kernels.

    >>> cudnn_batchnorm_problem('float32', 'float32') is None
    True
    >>> cudnn_batchnorm_problem('float64', 'float64')
    'float64 statistics'
    """
    if x_dtype == 'float64' or gamma_dtype == 'float64':
        return 'float64 statistics'
    return None


def deselected_notes(dtype, deterministic, tf32):
    """The numerical notes of the engines a graph of ``dtype`` may not
    run (cuDNN's ``numerical_note`` names).

    >>> deselected_notes('float32', False, False)
    ('DOWN_CONVERT_INPUTS', 'TENSOR_CORE')
    >>> deselected_notes('float32', True, True)
    ('NONDETERMINISTIC', 'DOWN_CONVERT_INPUTS')
    >>> deselected_notes('float16', False, False)
    ('DOWN_CONVERT_INPUTS',)
    """
    notes = ['NONDETERMINISTIC'] if deterministic else []
    notes.append('DOWN_CONVERT_INPUTS')
    if dtype == 'float32' and not tf32:
        notes.append('TENSOR_CORE')
    return tuple(notes)


def frontend_problem(version, backend):
    """Why the cuDNN frontend ``version`` (its ``__version__``) over the
    cuDNN ``backend`` (``backend_version()``, e.g. 91000) is not used, or
    None.

    >>> frontend_problem('1.23.0', 91300) is None
    True
    >>> frontend_problem('1.32.0', 91300)
    'nvidia-cudnn-frontend 1.32.0 (this code speaks 1.23.x)'
    >>> frontend_problem('1.23.0', 8902)
    'cuDNN 8902 (cuDNN 9 or later is needed)'
    """
    found = re.match(r'(\d+)\.(\d+)', str(version))
    low, high = FRONTEND
    if not found or not low <= (int(found[1]), int(found[2])) < high:
        return (f'nvidia-cudnn-frontend {version} (this code speaks '
                f'{low[0]}.{low[1]}.x)')
    if backend < MIN_BACKEND:
        return f'cuDNN {backend} (cuDNN 9 or later is needed)'
    return None


class Unbuildable:
    """A key whose graph cuDNN would not build, and why."""
    __slots__ = ('reason',)

    def __init__(self, reason):
        self.reason = reason

    def __repr__(self):
        return f'Unbuildable({self.reason!r})'


class GraphCache:
    """Built graphs by key (a tuple of the op, its device, shapes, dtypes,
    arguments and the engine notes deselected), at most ``maxsize``, the
    least recently used evicted first. Thread-safe; ``get`` moves a hit to
    the recent end.

    >>> c = GraphCache(2)
    >>> c.put('a', 1); c.put('b', 2); c.get('a'); c.put('c', 3)
    1
    >>> c.get('b') is None, len(c), c.evicted
    (True, 2, 1)
    """

    def __init__(self, maxsize=CACHE_SIZE):
        if maxsize < 1:
            raise ValueError(f'maxsize must be >= 1, got {maxsize!r}')
        self.maxsize = maxsize
        self.evicted = 0
        self._entries = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key, entry):
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
                self.evicted += 1

    def clear(self):
        with self._lock:
            self._entries.clear()

    def __len__(self):
        return len(self._entries)

    def entries(self):
        """A copy of ``{key: graph or Unbuildable}``."""
        with self._lock:
            return dict(self._entries)

    def unbuildable(self):
        """``{key: reason}`` of the keys kept as unbuildable."""
        with self._lock:
            return {k: v.reason for k, v in self._entries.items()
                    if isinstance(v, Unbuildable)}


class SaidOnce:
    """Remembers which (topic, reason) pairs were logged: each is said once
    per process.

    >>> s = SaidOnce()
    >>> s.first('conv', 'float64'), s.first('conv', 'float64')
    (True, False)
    """

    def __init__(self):
        self._seen = set()
        self._lock = threading.Lock()

    def first(self, *what):
        with self._lock:
            if what in self._seen:
                return False
            self._seen.add(what)
            return True
