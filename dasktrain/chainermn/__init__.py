"""ChainerMN's API on Dask, without MPI: a ChainerMN script started with
``dasktrain launch -n N -- python train.py`` runs as it is written (its
``import chainermn`` gets this package, see
:mod:`~dasktrain.chainermn.substitution`); ``import dasktrain.chainermn
as chainermn`` does the same anywhere (see docs/chainermn.md).

Data parallelism: the communicator
(:mod:`~dasktrain.chainermn.communicator`), the multi-node optimizer
(:mod:`~dasktrain.chainermn.optimizers`), extensions
(:mod:`~dasktrain.chainermn.extensions`), datasets
(:mod:`~dasktrain.chainermn.datasets`) and batch normalisation
(:mod:`~dasktrain.chainermn.links`). Model parallelism: differentiable
messages and collectives (:mod:`~dasktrain.chainermn.functions`),
``MultiNodeChainList`` and ``create_multi_node_n_step_rnn``
(:mod:`~dasktrain.chainermn.links`), the multi-node iterators
(:mod:`~dasktrain.chainermn.iterators`) and ``comm.split`` for both at
once. :mod:`~dasktrain.chainermn.global_except_hook` as ChainerMN's;
:mod:`~dasktrain.chainermn.mpi` is mpi4py's ``MPI`` on the same ranks
(``comm.mpi_comm``, and a launched rank's ``from mpi4py import MPI``),
:mod:`~dasktrain.chainermn.nccl` ChainerMN's ``chainermn.nccl``.
"""
import sys

import chainer

from dasktrain.chainermn import (
    communicator,
    datasets,
    extensions,
    functions,
    global_except_hook,
    iterators,
    links,
    mpi,
    nccl,
    optimizers,
    substitution,
)
from dasktrain.chainermn.communicator import (
    NAMES,
    CommunicatorBase,
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
    create_multi_node_checkpointer,
    create_multi_node_early_stopping_trigger,
    create_multi_node_evaluator,
)
from dasktrain.chainermn.links import (
    MultiNodeBatchNormalization,
    MultiNodeChainList,
    create_mnbn_model,
    create_multi_node_n_step_rnn,
)
from dasktrain.chainermn.optimizers import (
    DoubleBufferingOptimizer,
    create_multi_node_optimizer,
)
from dasktrain.chainermn.support import Unsupported

__version__ = chainer.__version__
communicators = communicator  # ChainerMN's name for the module

__all__ = ['NAMES', 'CommunicatorBase', 'DaskCommunicator', 'DataSizeError',
           'DoubleBufferingOptimizer', 'MultiNodeBatchNormalization',
           'MultiNodeChainList', 'Unsupported', 'communicators',
           'create_communicator', 'create_empty_dataset',
           'create_mnbn_model', 'create_multi_node_checkpointer',
           'create_multi_node_early_stopping_trigger',
           'create_multi_node_evaluator', 'create_multi_node_n_step_rnn',
           'create_multi_node_optimizer', 'datasets', 'extensions',
           'functions', 'global_except_hook', 'iterators', 'links', 'mpi',
           'nccl', 'optimizers', 'scatter_dataset', 'scatter_index']

global_except_hook._add_hook_if_enabled()
substitution.take_the_name(sys.modules[__name__])
