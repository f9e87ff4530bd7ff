"""ChainerMN's trainer extensions (``chainermn.extensions``), over a
:class:`~dasktrain.chainermn.communicator.DaskCommunicator`: the
multi-node evaluator, checkpointer, snapshot and early-stopping trigger,
``AllreducePersistent`` and ``ObservationAggregator``.

They are ChainerMN's own code, which only calls the communicator's
interface: the same calls in the same order give the same numbers as
under MPI. Owns these wrappers; the communicator is
:mod:`~dasktrain.chainermn.communicator`'s.
"""
import chainermn.extensions
from chainermn.extensions import (
    AllreducePersistent,
    GenericMultiNodeEvaluator,
    MultiNodeEarlyStoppingTrigger,
    ObservationAggregator,
    multi_node_snapshot,
)


def create_multi_node_evaluator(actual_evaluator, communicator):
    """``actual_evaluator`` reporting the mean of the ranks' results on
    every rank (each rank evaluates its own share of the data)."""
    return chainermn.extensions.create_multi_node_evaluator(
        actual_evaluator, communicator)


def create_multi_node_checkpointer(name, comm, cp_interval=5,
                                   gc_interval=5, path=None):
    """ChainerMN's checkpointer: each rank saves its own state (``path``,
    default the trainer's out) and ``maybe_load`` resumes from the last
    iteration every rank has."""
    return chainermn.extensions.create_multi_node_checkpointer(
        name, comm, cp_interval=cp_interval, gc_interval=gc_interval,
        path=path)


def create_multi_node_early_stopping_trigger(comm, **kwargs):
    """ChainerMN's early stopping on the ranks' mean of the monitor
    (:class:`MultiNodeEarlyStoppingTrigger`)."""
    return MultiNodeEarlyStoppingTrigger(comm, **kwargs)


__all__ = ['AllreducePersistent', 'GenericMultiNodeEvaluator',
           'MultiNodeEarlyStoppingTrigger', 'ObservationAggregator',
           'create_multi_node_checkpointer',
           'create_multi_node_early_stopping_trigger',
           'create_multi_node_evaluator', 'multi_node_snapshot']
