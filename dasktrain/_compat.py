"""Let Chainer 7.8.1 import on today's NumPy and Python.

Chainer 7.8.1 was released for NumPy 1.x and Python <= 3.9; the two
breakages it meets today are restored by :func:`patch`:

* ``numpy.sctypes`` (removed in NumPy 2.0) is read at import time by
  ``chainer.functions.array.as_strided``.
* ``numpy.distutils`` (gone on Python >= 3.12) is imported at start-up by
  ``chainer._environment_check``, which uses it only on macOS.

The patch must run before Chainer's first import, in any script, notebook or
worker, whichever it imports first. So :func:`install` puts a finder on
``sys.meta_path`` that applies the patch when ``chainer`` is first looked
up, and ``dasktrain-chainer.pth`` (installed into site-packages with the
package, normal or editable install alike) calls it at interpreter start.
Until Chainer is imported this costs nothing: NumPy is not even loaded.
``import dasktrain`` calls :func:`install` too, for a checkout that is on
``sys.path`` without being installed.
"""
import sys


def patch():
    """Restore what Chainer 7.8.1 reads from NumPy (idempotent)."""
    import importlib.util
    import types
    import warnings

    import numpy

    # chainer imports pkg_resources, which warns on import with recent
    # setuptools.
    warnings.filterwarnings('ignore', message='pkg_resources is deprecated',
                            category=UserWarning)
    try:
        numpy.sctypes  # noqa: B018  (raises on NumPy 2)
    except AttributeError:
        # The exact table NumPy 1.26 exposed on 64-bit Linux.
        numpy.sctypes = {
            'int': [numpy.int8, numpy.int16, numpy.int32, numpy.int64],
            'uint': [numpy.uint8, numpy.uint16, numpy.uint32, numpy.uint64],
            'float': [numpy.float16, numpy.float32, numpy.float64,
                      numpy.longdouble],
            'complex': [numpy.complex64, numpy.complex128,
                        numpy.clongdouble],
            'others': [bool, object, bytes, str, numpy.void],
        }
    if 'numpy.distutils' not in sys.modules and \
            importlib.util.find_spec('numpy.distutils') is None:
        distutils = types.ModuleType('numpy.distutils')
        system_info = types.ModuleType('numpy.distutils.system_info')
        # chainer asks only for the BLAS configuration, to warn about macOS
        # Accelerate; an empty answer means "nothing to warn about".
        system_info.get_info = lambda name, notfound_action=0: {}
        distutils.system_info = system_info
        sys.modules['numpy.distutils'] = distutils
        sys.modules['numpy.distutils.system_info'] = system_info
        numpy.distutils = distutils


class _AfterChainer:
    """Chainer's loader, which steps the finder aside and runs the hooks
    given to :func:`install` once Chainer's package has been executed;
    everything else is the loader's own."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        uninstall()  # Chainer is being imported for real: no more lookups
        self._loader.exec_module(module)
        _run_after()

    def __getattr__(self, name):
        return getattr(self._loader, name)


_after = []


def _run_after():
    """The hooks, each at most once; one that fails is logged, never
    breaks Chainer's import."""
    while _after:
        hook = _after.pop(0)
        try:
            hook()
        except Exception:  # (a hook is an optimisation)
            import logging
            logging.getLogger(__name__).warning(
                'dasktrain: a hook after Chainer\'s import failed; Chainer '
                'runs as it is', exc_info=True)


class _PatchBeforeChainer:
    """A meta path finder: on a lookup of ``chainer`` it patches NumPy and
    hands back the real finders' spec with a loader that runs the
    :func:`install` hooks after Chainer's import. It stays on
    ``sys.meta_path`` until Chainer is executed (a lookup alone, e.g.
    ``importlib.util.find_spec``, is no import), and never removes itself
    while importlib walks that list."""

    _looking = False

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != 'chainer' or cls._looking:
            return None
        patch()
        if not _after:
            return None
        import importlib.util
        cls._looking = True  # the real finders' turn: not ours again
        try:
            spec = importlib.util.find_spec(name)
        finally:
            cls._looking = False
        if spec is None or not hasattr(spec.loader, 'exec_module'):
            return spec
        spec.loader = _AfterChainer(spec.loader)
        return spec


def install(after_chainer=None):
    """Patch NumPy before ``chainer`` is imported (at once if it already
    is), then call ``after_chainer()`` once Chainer is imported (at once if
    it already is). Idempotent; cheap until Chainer's import."""
    if after_chainer is not None and after_chainer not in _after:
        _after.append(after_chainer)
    if 'chainer' in sys.modules:
        patch()
        if getattr(sys.modules['chainer'], '__version__', None):
            _run_after()  # imported and done (not mid-import)
    elif _PatchBeforeChainer not in sys.meta_path:
        sys.meta_path.insert(0, _PatchBeforeChainer)


def uninstall():
    while _PatchBeforeChainer in sys.meta_path:
        sys.meta_path.remove(_PatchBeforeChainer)
