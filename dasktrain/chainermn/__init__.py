"""ChainerMN's API on Dask, without MPI: change one line of a ChainerMN
script, ``import chainermn`` to ``import dasktrain.chainermn as
chainermn``, and start it with ``dasktrain launch -n N -- python
train.py`` (see docs/chainermn.md).

The communicator is :mod:`~dasktrain.chainermn.communicator`'s; the
optimizer wrapper and extensions
:mod:`~dasktrain.chainermn.extensions`'; datasets
:mod:`~dasktrain.chainermn.datasets`'; batch normalisation
:mod:`~dasktrain.chainermn.links`'. A ChainerMN name not offered here
(model parallelism: ``functions``, ``MultiNodeChainList``, the
multi-node iterators) raises :class:`Unsupported`, one line naming it.
"""
import chainer
from chainermn.communicators.communicator_base import CommunicatorBase

from dasktrain.chainermn import datasets, extensions, links
from dasktrain.chainermn.communicator import (
    NAMES,
    DaskCommunicator,
    create_communicator,
)
from dasktrain.chainermn.datasets import (
    DataSizeError,
    create_empty_dataset,
    scatter_dataset,
    scatter_index,
)
from dasktrain.chainermn.extensions import (
    DoubleBufferingOptimizer,
    create_multi_node_checkpointer,
    create_multi_node_early_stopping_trigger,
    create_multi_node_evaluator,
    create_multi_node_optimizer,
)
from dasktrain.chainermn.support import MISSING, Unsupported

__version__ = chainer.__version__

__all__ = ['NAMES', 'CommunicatorBase', 'DaskCommunicator', 'DataSizeError',
           'DoubleBufferingOptimizer', 'Unsupported', 'create_communicator',
           'create_empty_dataset',
           'create_multi_node_checkpointer',
           'create_multi_node_early_stopping_trigger',
           'create_multi_node_evaluator', 'create_multi_node_optimizer',
           'datasets', 'extensions', 'links', 'scatter_dataset',
           'scatter_index']


def __getattr__(name):
    if name in MISSING:
        raise Unsupported(f'chainermn.{name}',
                          'model parallelism and multi-node iterators are '
                          'not offered')
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
