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
import os
import sys

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
    'links': 'links', 'optimizers': 'optimizers',
}

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
