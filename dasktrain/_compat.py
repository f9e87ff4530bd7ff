"""Let Chainer 7.8.1 import on today's NumPy and Python.

Every entry point imports this module before chainer (``dasktrain/__init__``
does it first), so nothing else needs to care. Chainer 7.8.1 was released for
NumPy 1.x and Python <= 3.9; the two breakages it meets today are restored here:

* ``numpy.sctypes`` (removed in NumPy 2.0) is read at import time by
  ``chainer.functions.array.as_strided``.
* ``numpy.distutils`` (gone on Python >= 3.12) is imported at start-up by
  ``chainer._environment_check``, which uses it only on macOS.
"""
import importlib.util
import sys
import types
import warnings

import numpy

# chainer imports pkg_resources, which warns on import with recent setuptools.
warnings.filterwarnings('ignore', message='pkg_resources is deprecated',
                        category=UserWarning)

try:
    numpy.sctypes
except AttributeError:
    # The exact table NumPy 1.26 exposed on 64-bit Linux.
    numpy.sctypes = {
        'int': [numpy.int8, numpy.int16, numpy.int32, numpy.int64],
        'uint': [numpy.uint8, numpy.uint16, numpy.uint32, numpy.uint64],
        'float': [numpy.float16, numpy.float32, numpy.float64,
                  numpy.longdouble],
        'complex': [numpy.complex64, numpy.complex128, numpy.clongdouble],
        'others': [bool, object, bytes, str, numpy.void],
    }

if importlib.util.find_spec('numpy.distutils') is None:
    _distutils = types.ModuleType('numpy.distutils')
    _system_info = types.ModuleType('numpy.distutils.system_info')
    # chainer asks only for the BLAS configuration, to warn about macOS
    # Accelerate; an empty answer means "nothing to warn about".
    _system_info.get_info = lambda name, notfound_action=0: {}
    _distutils.system_info = _system_info
    sys.modules['numpy.distutils'] = _distutils
    sys.modules['numpy.distutils.system_info'] = _system_info
    numpy.distutils = _distutils
