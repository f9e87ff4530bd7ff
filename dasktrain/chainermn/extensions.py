"""ChainerMN's optimizer wrapper and trainer extensions, over a
:class:`~dasktrain.chainermn.communicator.DaskCommunicator`.

They are ChainerMN's own code (``chainermn.optimizers``,
``chainermn.extensions``), which only call the communicator's interface:
the same calls in the same order give the same numbers as under MPI. The
multi-node optimizer broadcasts rank 0's parameters at its first update
(and whenever the model's parameters change), skipping that update as
ChainerMN does, then averages the gradients before every update. What
ChainerMN does only with MPI or NCCL is :class:`Unsupported`, one line.

Owns these wrappers; the communicator is
:mod:`~dasktrain.chainermn.communicator`'s.
"""
import chainermn.extensions
import chainermn.optimizers

from dasktrain.chainermn.support import Unsupported


def create_multi_node_optimizer(actual_optimizer, communicator,
                                double_buffering=False, zero_fill=True):
    """``actual_optimizer`` averaging gradients over the ranks before each
    update, after broadcasting rank 0's parameters at the first.

    Parameters
    ----------
    actual_optimizer : chainer.Optimizer
    communicator : DaskCommunicator
    double_buffering : bool
        ChainerMN's one-step-stale update (only with its ``pure_nccl``
        communicator): not offered here (:class:`Unsupported`).
    zero_fill : bool
        Unused parameters' gradients taken as zeros (ChainerMN's).
    """
    if double_buffering:
        raise Unsupported(
            'create_multi_node_optimizer(double_buffering=True)',
            'use dasktrain train --double-buffering, or leave it off')
    return chainermn.optimizers.create_multi_node_optimizer(
        actual_optimizer, communicator, zero_fill=zero_fill)


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
    """ChainerMN's early stopping on the ranks' mean of the monitor."""
    from chainermn.extensions import multi_node_early_stopping_trigger as m
    return m.MultiNodeEarlyStoppingTrigger(comm, **kwargs)
