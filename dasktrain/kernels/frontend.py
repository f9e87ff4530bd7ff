"""cuDNN 9 through NVIDIA's cuDNN frontend for Python (``nvidia-cudnn-
frontend``, module ``cudnn``): loading it, one handle per thread and GPU,
building a graph once per key, and running it on CuPy's current stream
with its workspace from CuPy's memory pool.

Written against nvidia-cudnn-frontend 1.23.0's ``python/cudnn/__init__.py``
and ``python/pygraph/pygraph.cpp``:

* ``cudnn`` dlopens ``libcudnn.so.9`` at import: from ``nvidia/cudnn/lib``
  under the interpreter's ``purelib``, else by soname. A venv whose wheels
  live elsewhere on ``sys.path`` (a ``--target`` folder, ``nvidia/cu13``)
  would find none, so :func:`load` first loads the library it finds on
  ``sys.path`` with ``RTLD_GLOBAL``: the soname lookup then returns it.
* A graph is built by ``validate``, ``build_operation_graph``,
  ``create_execution_plans([A, FALLBACK])``, then the engines to avoid are
  deselected by numerical note (which indexes the plans just created, so
  it must come after them), ``check_support`` and ``build_plans``; a graph
  cuDNN cannot run raises there, and is kept as unbuildable.
* Outputs whose dimensions or strides are not set default to NHWC strides
  (``generate_NHWC_stride_order`` in every node's ``infer_properties``):
  every tensor here is given its NCHW dims and strides.
* ``_execute_with_ptrs(pointers, workspace, handle)`` takes the device
  pointers in the order ``_get_variant_pack_uids_sorted()`` gives (what
  the frontend's own SDPA op does); ``execute({uid: pointer}, ...)`` is the
  public way, used where those two are missing. A pass-by-value tensor
  (epsilon, momentum) is given a host pointer, as the frontend's tests
  give a CPU tensor's.
* ``set_stream`` is a ``cudnnSetStream``, not free: it is called only when
  a handle's stream changes.

CuPy's memory pool is stream-ordered: the workspace and outputs allocated
here are reused only by work queued after this call's on the same stream.
"""
import ctypes
import glob
import logging
import os
import sys
import threading

import numpy as np

from dasktrain.kernels.choices import (
    GraphCache,
    Unbuildable,
    deselected_notes,
    frontend_problem,
)
from dasktrain.kernels.geometry import packed_strides

log = logging.getLogger(__name__)

_lock = threading.Lock()
_loaded = None       # (module, None) or (None, why not)
_threads = threading.local()
graphs = GraphCache()


def _library_candidates():
    """``libcudnn.so.9`` of the nvidia-cudnn wheels on ``sys.path``
    (``nvidia/cudnn/lib``; ``nvidia/cu13/lib`` for CUDA 13's merged
    layout), when the frontend's own search (``nvidia/cudnn/lib`` and
    ``nvidia/cudnn_jit/lib`` under ``purelib``) finds none."""
    import sysconfig
    purelib = sysconfig.get_path('purelib')
    for sub in ('nvidia/cudnn/lib', 'nvidia/cudnn_jit/lib'):
        if glob.glob(os.path.join(purelib, sub, 'libcudnn.so.*[0-9]')):
            return []  # the frontend loads that one itself
    found = []
    for entry in sys.path:
        if not entry or not os.path.isabs(entry):
            continue  # never a folder relative to where the run stands
        for sub in ('nvidia/cudnn/lib', 'nvidia/cu13/lib', 'nvidia/cu12/lib'):
            found += sorted(glob.glob(os.path.join(entry, sub,
                                                   'libcudnn.so.9')))
    return found


def load():
    """``(cudnn, None)`` once the frontend and cuDNN 9 are usable in this
    process, else ``(None, why)``; tried once per process."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
            if _loaded[0] is None:
                log.info('cuDNN graphs off: %s', _loaded[1])
            else:
                log.info('cuDNN graphs on: cuDNN %s, nvidia-cudnn-frontend '
                         '%s', _loaded[0].backend_version(),
                         _loaded[0].__version__)
    return _loaded


def _load():
    import importlib.util
    if importlib.util.find_spec('cudnn') is None:
        return None, ('nvidia-cudnn-frontend is not installed (make install '
                      "on a GPU machine brings it, or pip install "
                      "'dasktrain[cudnn13]')")
    # Before the frontend's import, which dlopens cuDNN once, by path
    # under purelib or else by soname: a library loaded here (locally: its
    # symbols stay out of the global scope, where a cuDNN 8 may live) is
    # what that soname lookup then finds.
    for path in _library_candidates():
        try:
            ctypes.CDLL(path)
            break
        except OSError:
            continue
    try:
        import cudnn
        backend = int(cudnn.backend_version())
    except Exception as e:  # (cuDNN missing or broken)
        return None, f'cuDNN did not load ({type(e).__name__}: {e})'
    problem = frontend_problem(getattr(cudnn, '__version__', '?'), backend)
    if problem:
        return None, problem
    return cudnn, None


def reset_after_fork():
    """Handles and plans belong to the process that made them: a forked
    child starts with none. Nothing is taken or freed here (another
    thread may have held a lock at the fork; the parent's plans must not
    be destroyed in a child): the old ones are dropped unreferenced."""
    global _threads, graphs, _lock
    _threads = threading.local()
    graphs = GraphCache()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=reset_after_fork)


def disable(why):
    """Turn cuDNN off for this process (a handle or a run failed where a
    refusal was expected): every later call runs Chainer's path."""
    global _loaded
    _loaded = (None, why)
    log.warning('cuDNN graphs off for this process: %s', why)


def handle(cudnn, device, stream):
    """This thread's cuDNN handle for GPU ``device`` (the current one),
    set to run on ``stream`` (a ``cudaStream_t`` as an int)."""
    handles = getattr(_threads, 'handles', None)
    if handles is None:
        handles = _threads.handles = {}
    entry = handles.get(device)
    if entry is None:
        entry = handles[device] = [cudnn.create_handle(), None]
    if entry[1] != stream:
        cudnn.set_stream(handle=entry[0], stream=stream)
        entry[1] = stream
    return entry[0]


#: the byte alignment every pointer handed to cuDNN has (CuPy's pool
#: gives 512; a view into an array may start anywhere)
ALIGNMENT = 16
def ready(a):
    """``a`` packed and aligned as a graph names it (a copy only where it
    is not)."""
    import cupy
    if not a.flags.c_contiguous or a.data.ptr % ALIGNMENT:
        a = cupy.array(a, order='C', copy=True)
    return a


_DATA_TYPES = {'float16': 'HALF', 'float32': 'FLOAT', 'float64': 'DOUBLE'}


def data_type(cudnn, dtype):
    return getattr(cudnn.data_type, _DATA_TYPES[str(dtype)])


def compute_type(cudnn, dtype):
    """float64 computes in double; float16 and float32 in float32 (what
    CuPy's cuDNN convolutions asked for)."""
    return cudnn.data_type.DOUBLE if str(dtype) == 'float64' else \
        cudnn.data_type.FLOAT


class Graph:
    """A built graph and how to feed it: ``roles`` names its tensors'
    uids in the order the caller passes pointers, ``order`` maps the
    frontend's sorted uids onto those, ``host`` holds the host arrays of
    its pass-by-value scalars (kept alive with it)."""

    def __init__(self, graph, roles, host=None):
        self.graph = graph
        self.roles = roles
        self.host = host or {}
        self.workspace = int(graph.get_workspace_size())
        uids = getattr(graph, '_get_variant_pack_uids_sorted', None)
        fast = hasattr(graph, '_execute_with_ptrs') and uids is not None
        self.order = [roles.index(uid) for uid in uids()] if fast else None

    def run(self, cudnn, device, stream, pointers):
        """Queue the graph on ``stream`` with ``pointers`` (device pointers
        in ``roles`` order; a scalar's role may be given as None: its host
        array is used)."""
        import cupy
        pointers = [self.host[uid].ctypes.data if p is None else p
                    for uid, p in zip(self.roles, pointers)]
        # from the pool, freed on return: CuPy's pool hands it out again
        # only to work queued after this on the same stream
        workspace = cupy.empty(self.workspace, dtype=np.uint8)
        h = handle(cudnn, device, stream)
        if self.order is not None:
            self.graph._execute_with_ptrs([pointers[i] for i in self.order],
                                          workspace.data.ptr, h)
        else:
            self.graph.execute(dict(zip(self.roles, pointers)),
                               workspace.data.ptr, handle=h)


def build(cudnn, key, make, dtype, deterministic, tf32, device, stream):
    """The graph of ``key`` from the cache, else built by ``make(cudnn,
    graph)`` (which declares the tensors and returns ``(roles, host)``),
    cached; an :class:`Unbuildable` where cuDNN refuses it."""
    entry = graphs.get(key)
    if entry is not None:
        return entry
    try:
        h = handle(cudnn, device, stream)
    except Exception as e:  # (cuDNN cannot run on this GPU at all)
        disable(f'no cuDNN handle on GPU {device} ({type(e).__name__}: '
                f'{e})')
        return Unbuildable('no cuDNN handle')
    try:
        g = cudnn.pygraph(io_data_type=data_type(cudnn, dtype),
                          intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=compute_type(cudnn, dtype),
                          handle=h)
        roles, host = make(cudnn, g)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A,
                                  cudnn.heur_mode.FALLBACK])
        notes = deselected_notes(str(dtype), deterministic, tf32)
        g.deselect_numeric_notes([getattr(cudnn.numerical_note, n)
                                  for n in notes])
        g.check_support()
        g.build_plans()
        entry = Graph(g, roles, host)
    except Exception as e:  # (cuDNN's refusal, any type)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ''
        entry = Unbuildable(f'{type(e).__name__}: {first}'[:300])
        if not isinstance(e, (RuntimeError, ValueError,
                              cudnn.cudnnGraphNotSupportedError)):
            # not how cuDNN refuses: a mistake of this code's, loudly
            log.warning('cuDNN graph %s: %s', key[0], entry.reason,
                        exc_info=True)
    graphs.put(key, entry)
    return entry


def execute(cudnn, key, entry, device, stream, pointers):
    """Queue ``entry`` (see :meth:`Graph.run`); False where cuDNN failed
    to run it: the key is kept as unbuildable, said once, and the caller
    runs Chainer's path."""
    try:
        entry.run(cudnn, device, stream, pointers)
        return True
    except Exception as e:  # (an execution cuDNN refused at run time)
        reason = f'{type(e).__name__}: {str(e).strip()[:200]}'
        graphs.put(key, Unbuildable(reason))
        log.warning('cuDNN graph %s failed to run, Chainer\'s path '
                    'instead: %s', key[0], reason)
        return False


def nchw(g, name, uid, dims, dtype_enum):
    """A packed NCHW input tensor of graph ``g``."""
    return g.tensor(name=name, dim=list(dims),
                    stride=list(packed_strides(dims)), data_type=dtype_enum,
                    uid=uid)


def output(t, uid, dims, dtype_enum):
    """Mark ``t`` an output of packed NCHW ``dims`` with ``uid``."""
    t.set_output(True)
    t.set_data_type(dtype_enum)
    t.set_dim(list(dims))
    t.set_stride(list(packed_strides(dims)))
    t.set_uid(uid)
    return t
