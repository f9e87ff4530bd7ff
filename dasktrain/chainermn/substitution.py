"""``import chainermn`` on a rank of ``dasktrain launch``: ChainerMN's
scripts run as they are written, their import line unchanged.

``dasktrain launch`` (unless ``--no-chainermn``) makes a folder of its
own for the launch (:func:`shim_folder`, next to the ranks' logs,
removed when the launch ends) and puts it first on every rank's
``PYTHONPATH`` (:func:`rank_environment`; both are
:mod:`~dasktrain.parallel.comm.rendezvous`'s, part of a rank's
environment, so that the launching process need not import Chainer). It
holds one package, ``chainermn`` (:data:`SHIM`): a rank's first ``import
chainermn`` finds it, loads the installed ChainerMN (Chainer 7.8.1's
package, whose optimizer wrapper, extensions and datasets
:mod:`dasktrain.chainermn` calls with its own communicator), then
imports :mod:`dasktrain.chainermn`, whose import ends by taking the name
(:func:`take_the_name`): from then on ``chainermn`` and its submodules
(``chainermn.functions``, ``chainermn.links``, ...) are dasktrain's, in
that process and the processes it starts. Rank 0 says so once.

Nothing is installed and nothing is written into site-packages; outside
``launch`` ``import chainermn`` is ChainerMN's, and ``import
dasktrain.chainermn as chainermn`` works everywhere.
"""
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types

from dasktrain.chainermn.support import say
from dasktrain.parallel.comm import rendezvous
from dasktrain.parallel.comm.rendezvous import RANK

#: The launch's side, rendezvous's (see the module).
MARK, SHIM = rendezvous.CHAINERMN_MARK, rendezvous.CHAINERMN_SHIM
shim_folder = rendezvous.chainermn_folder
rank_environment = rendezvous.chainermn_environment

#: ChainerMN's public submodules and dasktrain's modules that take their
#: names (relative to ``dasktrain.chainermn``).
SUBMODULES = {
    'communicators': 'communicator', 'datasets': 'datasets',
    'extensions': 'extensions', 'functions': 'functions',
    'global_except_hook': 'global_except_hook', 'iterators': 'iterators',
    'links': 'links', 'optimizers': 'optimizers', 'nccl': 'nccl',
}
#: Those that stand for a package of ChainerMN's: its other modules
#: (``chainermn.extensions.checkpoint``, ...) stay importable under them.
PACKAGES = ('communicators', 'datasets', 'extensions', 'functions',
            'iterators', 'links')


def is_shim(entry):
    """Whether ``entry`` (of ``sys.path``) is a :func:`shim_folder`."""
    return os.path.isfile(os.path.join(entry or os.curdir, MARK))


def installed_path(name, root):
    """Where the installed ChainerMN (its package folder ``root``) keeps
    the parent of module ``chainermn.a.b`` (``name``): the folder to look
    for ``b`` in.

    Examples
    --------
    >>> installed_path('chainermn.communicators.naive_communicator', '/cm')
    '/cm/communicators'
    """
    return os.path.join(root, *name.split('.')[1:-1])


class InstalledChainerMN(importlib.abc.MetaPathFinder):
    """Finds, for a module ``chainermn.*`` that dasktrain does not stand
    for (``chainermn.testing``, ``chainermn.communicators._memory_utility``,
    ...), the installed ChainerMN's, loaded under that name: ChainerMN's own
    code, calling dasktrain's ``chainermn`` and ``mpi4py``."""

    def __init__(self, root):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith('chainermn.'):
            return None
        return importlib.machinery.PathFinder.find_spec(
            fullname, [installed_path(fullname, self.root)])


def children(name, root):
    """A module ``__getattr__`` for dasktrain's module standing for
    ChainerMN's package ``name``: a name it lacks that is a module of the
    installed package (under ``root``) is imported as ``name.child``, so
    ``from chainermn.communicators import _memory_utility`` works."""
    def __getattr__(child):
        folder = os.path.join(installed_path(f'{name}.{child}', root), child)
        if child.startswith('__') or not (
                os.path.isfile(folder + '.py') or os.path.isdir(folder)):
            raise AttributeError(f'module {name!r} has no attribute '
                                 f'{child!r}')
        return importlib.import_module(f'{name}.{child}')
    return __getattr__


def class_module(name, cls):
    """A module ``name`` holding ChainerMN's communicator class ``cls``."""
    module = types.ModuleType(name, cls.__doc__)
    setattr(module, cls.__name__, cls)
    return module


def take_the_name(package, path=None):
    """Make ``package`` (:mod:`dasktrain.chainermn`) and its modules
    ``chainermn`` and ``chainermn.*`` in this process, where a
    :func:`shim_folder` is on ``path`` (``sys.path``); else do nothing.
    Returns whether it did. The installed ChainerMN's other modules stay
    importable under their names (:class:`InstalledChainerMN`); ChainerMN's
    communicator classes' modules hold dasktrain's. Rank 0 says so, once."""
    if not any(is_shim(entry) for entry in
               (sys.path if path is None else path)):
        return False
    installed = sys.modules.get('chainermn')
    if installed is package:
        return True
    sys.modules['chainermn'] = package
    mine = {f'chainermn.{name}': sys.modules[f'{package.__name__}.{module}']
            for name, module in SUBMODULES.items()}
    root = getattr(installed, '__path__', [None])[0]
    for name in PACKAGES:
        module = mine[f'chainermn.{name}']
        if not hasattr(module, '__path__'):
            module.__path__ = []  # a package's: its children are found
        if root and '__getattr__' not in vars(module):
            module.__getattr__ = children(f'chainermn.{name}', root)
    if root:  # ``from chainermn import testing``
        package.__getattr__ = children('chainermn', root)
    for name, cls in package.communicator.CLASS_MODULES.items():
        mine[f'chainermn.communicators.{name}'] = class_module(
            f'chainermn.communicators.{name}', cls)
    # ChainerMN's modules already loaded: children of dasktrain's too, so
    # ``from chainermn.extensions import checkpoint`` finds them.
    for name, module in list(sys.modules.items()):
        parent, _, child = name.rpartition('.')
        if parent in mine and name not in mine and \
                not hasattr(mine[parent], child):
            setattr(mine[parent], child, module)
    sys.modules.update(mine)
    if root and not any(isinstance(f, InstalledChainerMN)
                        for f in sys.meta_path):
        sys.meta_path.insert(0, InstalledChainerMN(root))
    if os.environ.get(RANK) == '0':
        say("dasktrain.chainermn: the ranks' `import chainermn` is "
            f'dasktrain.chainermn (ChainerMN {package.__version__} on '
            'Dask, no MPI; `from mpi4py import MPI` gets its MPI; '
            '`dasktrain launch --no-chainermn` for the installed ChainerMN '
            'and mpi4py)')
    return True
