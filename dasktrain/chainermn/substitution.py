"""``import chainermn`` on a rank of ``dasktrain launch``: ChainerMN's
scripts run as they are written, their import line unchanged.

``dasktrain launch`` (unless ``--no-chainermn``) makes a folder of its own
for the launch (:func:`shim_folder`, next to the ranks' logs, removed
when the launch ends) and puts it first on every rank's ``PYTHONPATH``
(:func:`rank_environment`). It holds one package, ``chainermn``
(:data:`SHIM`): a rank's first ``import chainermn`` finds it, loads the
installed ChainerMN (Chainer 7.8.1's package, whose optimizer wrapper,
extensions and datasets :mod:`dasktrain.chainermn` calls with its own
communicator), then imports :mod:`dasktrain.chainermn`, whose import ends
by taking the name (:func:`take_the_name`): from then on ``chainermn``
and its submodules (``chainermn.functions``, ``chainermn.links``, ...)
are dasktrain's, in that process and the processes it starts. Rank 0
says so once.

Nothing is installed and nothing is written into site-packages; outside
``launch`` ``import chainermn`` is ChainerMN's, and ``import
dasktrain.chainermn as chainermn`` works everywhere.
"""
import contextlib
import os
import shutil
import sys
import tempfile

from dasktrain.chainermn.support import say
from dasktrain.parallel.comm.rendezvous import RANK

#: A file that marks the folder as dasktrain's: the ``sys.path`` entry
#: whose ``chainermn`` is not ChainerMN's.
MARK = '.dasktrain-chainermn'

#: ChainerMN's public submodules and dasktrain's modules that take their
#: names (relative to ``dasktrain.chainermn``).
SUBMODULES = {
    'communicators': 'communicator', 'datasets': 'datasets',
    'extensions': 'extensions', 'functions': 'functions',
    'global_except_hook': 'global_except_hook', 'iterators': 'iterators',
    'links': 'links', 'optimizers': 'optimizers',
}

#: The folder's ``chainermn/__init__.py``. It imports nothing of
#: dasktrain's before the installed ChainerMN is loaded: dasktrain's
#: modules import ChainerMN's, which must not find this package again.
SHIM = '''"""`import chainermn` on a rank of `dasktrain launch`:
dasktrain.chainermn, ChainerMN's API on Dask (`dasktrain launch
--no-chainermn` leaves the installed ChainerMN). Written by
dasktrain.chainermn.substitution for one launch, removed when it ends."""
import importlib.machinery
import importlib.util
import os
import sys


def _load_installed():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec('chainermn', path)
    if spec is None:
        raise ImportError('ChainerMN is not installed (chainer 7.8.1 brings '
                          'it), which dasktrain.chainermn needs',
                          name='chainermn')
    module = importlib.util.module_from_spec(spec)
    hook = sys.excepthook
    sys.modules['chainermn'] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules['chainermn']
        raise
    finally:
        sys.excepthook = hook  # not ChainerMN's MPI_Abort hook
    return module


_load_installed()
import dasktrain.chainermn  # noqa: E402,F401  (then takes the name)
'''


@contextlib.contextmanager
def shim_folder(out):
    """A folder in ``out`` (the launch's output folder, which every rank
    reaches) holding :data:`SHIM` as ``chainermn``; removed on leaving.

    Examples
    --------
    >>> with shim_folder('.') as folder:  # doctest: +SKIP
    ...     env = rank_environment(folder, os.environ)
    """
    folder = tempfile.mkdtemp(prefix='.chainermn-', dir=out)
    try:
        with open(os.path.join(folder, MARK), 'w'):
            pass
        os.mkdir(os.path.join(folder, 'chainermn'))
        with open(os.path.join(folder, 'chainermn', '__init__.py'),
                  'w') as f:
            f.write(SHIM)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def rank_environment(folder, environ):
    """The variables that put ``folder`` (from :func:`shim_folder`) first
    on a rank's ``PYTHONPATH``, given the environment ``environ``.

    Examples
    --------
    >>> rank_environment('/x', {'PYTHONPATH': '/y'})
    {'PYTHONPATH': '/x:/y'}
    """
    before = environ.get('PYTHONPATH')
    return {'PYTHONPATH': os.pathsep.join([str(folder)] + (
        [before] if before else []))}


def is_shim(entry):
    """Whether ``entry`` (of ``sys.path``) is a :func:`shim_folder`."""
    return os.path.isfile(os.path.join(entry or os.curdir, MARK))


def take_the_name(package, path=None):
    """Make ``package`` (:mod:`dasktrain.chainermn`) and its modules
    ``chainermn`` and ``chainermn.*`` in this process, where a
    :func:`shim_folder` is on ``path`` (``sys.path``); else do nothing.
    Returns whether it did. Rank 0 says so, once."""
    if not any(is_shim(entry) for entry in
               (sys.path if path is None else path)):
        return False
    if sys.modules.get('chainermn') is package:
        return True
    sys.modules['chainermn'] = package
    for name, mine in SUBMODULES.items():
        sys.modules[f'chainermn.{name}'] = sys.modules[
            f'{package.__name__}.{mine}']
    if os.environ.get(RANK) == '0':
        say("dasktrain.chainermn: the ranks' `import chainermn` is "
            f'dasktrain.chainermn (ChainerMN {package.__version__} on '
            'Dask, no MPI; `dasktrain launch --no-chainermn` for the '
            'installed ChainerMN)')
    return True
