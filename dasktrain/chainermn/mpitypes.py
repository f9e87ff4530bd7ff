"""mpi4py's values on dasktrain's communicators (:mod:`dasktrain.chainermn.mpi`
re-exports them as ``MPI.*``): its constants (``ANY_SOURCE``, ``ANY_TAG``,
``IN_PLACE``, ...), datatypes (``MPI.FLOAT``, ``MPI._typedict``, which
ChainerMN reads), reduction ops (``MPI.SUM``, ...), ``Status``, and the
pure decisions of what a buffer argument names (:func:`buffer_of`) and how
received data fills one (:func:`into`). :class:`UnsupportedName`: an
mpi4py name not offered, refused in one line. And the answers about
the environment (``Is_initialized``, ``Wtime``, ...).
"""
import operator
import os
import socket
import time

import numpy as np

from dasktrain.chainermn.support import Unsupported
from dasktrain.parallel.comm.rendezvous import LISTEN, launched
from dasktrain.parallel.placement import machine_place

ANY_SOURCE = -1
ANY_TAG = -1
PROC_NULL = -2
UNDEFINED = -32766
SUCCESS = 0
THREAD_SINGLE, THREAD_FUNNELED, THREAD_SERIALIZED, THREAD_MULTIPLE = \
    range(4)
VERSION, SUBVERSION = 3, 1


class _InPlace:
    """``MPI.IN_PLACE``: the receive buffer is also the send buffer."""

    def __repr__(self):
        return 'MPI.IN_PLACE'


IN_PLACE = _InPlace()


class UnsupportedName(Unsupported, AttributeError):
    """An mpi4py name this module does not offer: one line naming it;
    an ``AttributeError`` too, so ``hasattr`` says False."""


class Datatype:
    """An MPI datatype: the NumPy dtype of its elements."""

    def __init__(self, name, dtype):
        self.name, self.dtype = name, np.dtype(dtype)

    def Get_size(self):
        return self.dtype.itemsize

    size = property(Get_size)

    def __repr__(self):
        return f'MPI.{self.name}'


BYTE = Datatype('BYTE', np.uint8)
CHAR = Datatype('CHAR', np.int8)
SIGNED_CHAR = Datatype('SIGNED_CHAR', np.int8)
UNSIGNED_CHAR = Datatype('UNSIGNED_CHAR', np.uint8)
BOOL = C_BOOL = Datatype('C_BOOL', np.bool_)
SHORT = Datatype('SHORT', np.int16)
UNSIGNED_SHORT = Datatype('UNSIGNED_SHORT', np.uint16)
INT = Datatype('INT', np.intc)
UNSIGNED = Datatype('UNSIGNED', np.uintc)
LONG = Datatype('LONG', np.int_)
UNSIGNED_LONG = Datatype('UNSIGNED_LONG', np.uint)
LONG_LONG = Datatype('LONG_LONG', np.longlong)
UNSIGNED_LONG_LONG = Datatype('UNSIGNED_LONG_LONG', np.ulonglong)
INT8_T, INT16_T = Datatype('INT8_T', np.int8), Datatype('INT16_T', np.int16)
INT32_T = Datatype('INT32_T', np.int32)
INT64_T = Datatype('INT64_T', np.int64)
UINT8_T = Datatype('UINT8_T', np.uint8)
UINT16_T = Datatype('UINT16_T', np.uint16)
UINT32_T = Datatype('UINT32_T', np.uint32)
UINT64_T = Datatype('UINT64_T', np.uint64)
FLOAT = Datatype('FLOAT', np.float32)
DOUBLE = Datatype('DOUBLE', np.float64)
LONG_DOUBLE = Datatype('LONG_DOUBLE', np.longdouble)
C_FLOAT_COMPLEX = Datatype('C_FLOAT_COMPLEX', np.complex64)
C_DOUBLE_COMPLEX = Datatype('C_DOUBLE_COMPLEX', np.complex128)
#: mpi4py's map of typecodes to datatypes (``MPI._typedict``, which
#: ChainerMN reads).
typedict = {
    'c': CHAR, 'b': SIGNED_CHAR, 'B': UNSIGNED_CHAR, '?': C_BOOL,
    'h': SHORT, 'H': UNSIGNED_SHORT, 'i': INT, 'I': UNSIGNED, 'l': LONG,
    'L': UNSIGNED_LONG, 'q': LONG_LONG, 'Q': UNSIGNED_LONG_LONG,
    'f': FLOAT, 'd': DOUBLE, 'g': LONG_DOUBLE, 'F': C_FLOAT_COMPLEX,
    'D': C_DOUBLE_COMPLEX}


def _typed(dtype):
    """The datatype of NumPy ``dtype`` (an unnamed one for the rest)."""
    dtype = np.dtype(dtype)
    for datatype in typedict.values():
        if datatype.dtype == dtype:
            return datatype
    return Datatype(dtype.str, dtype)


class Op:
    """A reduction: ``fn(a, b)`` on objects, ``ufunc`` on arrays."""

    def __init__(self, name, fn, ufunc):
        self.name, self.fn, self.ufunc = name, fn, ufunc

    def __call__(self, a, b):
        return self.fn(a, b)

    def __repr__(self):
        return f'MPI.{self.name}'


SUM = Op('SUM', operator.add, np.add)
PROD = Op('PROD', operator.mul, np.multiply)
MAX = Op('MAX', max, np.maximum)
MIN = Op('MIN', min, np.minimum)
LAND = Op('LAND', lambda a, b: a and b, np.logical_and)
LOR = Op('LOR', lambda a, b: a or b, np.logical_or)
LXOR = Op('LXOR', lambda a, b: bool(a) != bool(b), np.logical_xor)
BAND = Op('BAND', operator.and_, np.bitwise_and)
BOR = Op('BOR', operator.or_, np.bitwise_or)
BXOR = Op('BXOR', operator.xor, np.bitwise_xor)


def reduce_in_order(values, op):
    """``values`` (in rank order) reduced with ``op``, in rank order."""
    total = values[0]
    for value in values[1:]:
        total = op(total, value)
    return total


class Status:
    """Where a received message came from: its source, tag and size."""

    def __init__(self):
        self.source, self.tag, self.error, self.count = \
            ANY_SOURCE, ANY_TAG, SUCCESS, 0

    def Get_source(self):
        return self.source

    def Set_source(self, source):
        self.source = source

    def Get_tag(self):
        return self.tag

    def Set_tag(self, tag):
        self.tag = tag

    def Get_error(self):
        return self.error

    def Set_error(self, error):
        self.error = error

    def Get_count(self, datatype=BYTE):
        """Elements of ``datatype`` the message held (bytes by default)."""
        return self.count // datatype.Get_size()

    def Get_elements(self, datatype):
        return self.Get_count(datatype)


def fill(status, source, tag, nbytes=0):
    """Set ``status`` (ours or mpi4py's own) to a message's source, tag
    and bytes; nothing for None."""
    if status is None:
        return
    status.Set_source(source)
    status.Set_tag(tag)
    if isinstance(status, Status):
        status.count = nbytes


def buffer_of(spec, what='buffer'):
    """The NumPy array an mpi4py buffer argument names: an array, a
    bytes-like object or ctypes array (as bytes), or a list ``[buf,
    datatype]`` / ``[buf, count, datatype]`` (``buf`` seen as that
    datatype's elements, the first ``count`` of them). Host memory only:
    a GPU array is refused in one line.

    Examples
    --------
    >>> buffer_of(bytearray(8)).dtype, buffer_of([bytearray(8), FLOAT]).size
    (dtype('uint8'), 2)
    """
    count, datatype = None, None
    if isinstance(spec, (list, tuple)):
        if len(spec) == 2:
            spec, datatype = spec
        elif len(spec) == 3:
            spec, count, datatype = spec
        else:
            raise ValueError(f'{what}: [buf, datatype] or [buf, count, '
                             f'datatype], got a list of {len(spec)}')
        if isinstance(count, (list, tuple)):
            raise Unsupported(f'{what} with counts and displacements '
                              '(the v-variants)')
    if hasattr(spec, '__cuda_array_interface__') or (
            not isinstance(spec, np.ndarray) and hasattr(spec, 'device')
            and hasattr(spec, 'get')):
        raise Unsupported(f'a GPU {what} in mpi4py calls',
                          'copy it to the host, or use the ChainerMN '
                          "communicator's calls, which take GPU arrays")
    if isinstance(spec, np.ndarray):
        array = spec
        if not array.flags.c_contiguous:
            raise ValueError(f'{what} must be C-contiguous, got an array '
                             f'of strides {array.strides}')
        array = array.reshape(-1)
    else:
        # writable where ``spec`` is (a bytearray, a ctypes array)
        array = np.frombuffer(memoryview(spec).cast('B'), np.uint8)
    if datatype is not None:
        dtype = datatype.dtype if isinstance(datatype, Datatype) else \
            np.dtype(datatype)
        array = array.view(np.uint8)[:array.nbytes // dtype.itemsize
                                     * dtype.itemsize].view(dtype)
    if count is not None:
        array = array[:count]
    return array


def into(array, data, source):
    """``data``'s elements into the front of ``array`` (as its dtype's
    bytes where the two differ); an error where they do not fit."""
    data = np.asarray(data).reshape(-1)
    if data.dtype != array.dtype:
        raw = array.view(np.uint8)
        if data.nbytes > raw.nbytes:
            raise ValueError(f'{source} sent {data.nbytes} bytes into a '
                             f'buffer of {raw.nbytes}')
        raw[:data.nbytes] = data.view(np.uint8)
        return
    if data.size > array.size:
        raise ValueError(f'{source} sent {data.size} elements into a '
                         f'buffer of {array.size}')
    array[:data.size] = data

_STARTED = time.monotonic()


def Is_initialized():
    return True


def Is_finalized():
    return False


def Init():
    """Nothing to do: ranks join at ``COMM_WORLD``'s first use."""


Init_thread = Init


def Finalize():
    """Nothing to do: the connections close when the process exits."""


def Query_thread():
    return THREAD_MULTIPLE


def Wtime():
    return time.monotonic() - _STARTED


def Wtick():
    return 1e-9


def Get_version():
    return VERSION, SUBVERSION


def Get_library_version():
    return 'dasktrain.chainermn.mpi (mpi4py on Dask, no MPI)'


#: The variables ``mpiexec`` (Open MPI's) gives a rank, which scripts
#: and ChainerMN's tests read: a launched rank whose ``mpi4py`` is this
#: module has them from its ``COMM_WORLD``'s join on.
OMPI = ('OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE',
        'OMPI_COMM_WORLD_LOCAL_RANK', 'OMPI_COMM_WORLD_LOCAL_SIZE',
        'OMPI_COMM_WORLD_NODE_RANK')


def ompi_environment(machines, rank):
    """:data:`OMPI`'s values for ``rank``, given every rank's machine.

    Examples
    --------
    >>> ompi_environment(['a', 'b', 'a'], 2)['OMPI_COMM_WORLD_LOCAL_RANK']
    '1'
    """
    intra, intra_size, inter, _ = machine_place(machines, rank)
    return dict(zip(OMPI, map(str, (rank, len(machines), intra,
                                    intra_size, inter))))


def Get_processor_name():
    """This rank's machine as the ranks tell machines apart: the host it
    listens on under ``dasktrain launch`` (clones of one image share a
    hostname, never an address), else the hostname."""
    listen = os.environ.get(LISTEN)
    if launched() and listen:
        return listen.split('://', 1)[-1]
    return socket.gethostname()


#: What ``MPI.*`` shows of this module: mpi4py's names.
__all__ = sorted(name for name, value in list(globals().items())
                 if name.isupper() and not name.startswith('_') or name in (
                     'Datatype', 'Op', 'Status', 'Is_initialized',
                     'Is_finalized', 'Init', 'Init_thread', 'Finalize',
                     'Query_thread', 'Wtime', 'Wtick', 'Get_version',
                     'Get_library_version', 'Get_processor_name'))
