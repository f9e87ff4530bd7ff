"""``chainermn.nccl`` on a launched rank: ChainerMN's module of NCCL's
names (CuPy's ``cupy.cuda.nccl``: ``get_build_version``,
``NcclCommunicator``, ``NCCL_FLOAT32``, ...), taken from CuPy at their
first use. On a rank without NCCL (a CPU rank: ``dasktrain launch`` hides
its GPUs, and CuPy is not even imported) the module imports, as
ChainerMN's does, and each name is refused with one line
(:class:`~dasktrain.chainermn.mpi.UnsupportedName`, an
``AttributeError`` too: ``hasattr`` says False); ``_available`` says
which, as ChainerMN's.
"""
import os

#: ChainerMN's names of NCCL's (``chainermn/nccl.py``).
NAMES = ('get_build_version', 'get_unique_id', 'get_version', 'NCCL_FLOAT',
         'NCCL_FLOAT16', 'NCCL_FLOAT32', 'NCCL_FLOAT64', 'NCCL_SUM',
         'NcclCommunicator', 'NcclError')


def _cupy_nccl():
    """CuPy's NCCL module, or why there is none (a string)."""
    if os.environ.get('CUDA_VISIBLE_DEVICES') == '':
        return 'this rank has no GPU (CUDA_VISIBLE_DEVICES is empty)'
    try:
        from cupy.cuda import nccl
    except Exception as e:  # no CuPy, or one without NCCL
        return f'cupy.cuda.nccl cannot be imported ({e})'
    return nccl


def __getattr__(name):
    if name == '_available':
        return not isinstance(_cupy_nccl(), str)
    if name not in NAMES:
        raise AttributeError(f"module 'chainermn.nccl' has no attribute "
                             f'{name!r}')
    found = _cupy_nccl()
    if isinstance(found, str):
        from dasktrain.chainermn.mpi import UnsupportedName
        raise UnsupportedName(f'chainermn.nccl.{name}', found)
    value = getattr(found, name)
    globals()[name] = value
    return value
