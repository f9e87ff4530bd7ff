"""ChainerMN's multi-node optimizer (``chainermn.optimizers``), over a
:class:`~dasktrain.chainermn.communicator.DaskCommunicator`.

ChainerMN's own code, which only calls the communicator's interface: the
same calls in the same order give the same numbers as under MPI. The
multi-node optimizer broadcasts rank 0's parameters at its first update
(and whenever the model's parameters change), skipping that update as
ChainerMN does, then averages the gradients before every update; with
``double_buffering``, ChainerMN's one-step-stale update on any transport.

Owns this wrapper; the communicator is
:mod:`~dasktrain.chainermn.communicator`'s.
"""
import chainermn.optimizers


def create_multi_node_optimizer(actual_optimizer, communicator,
                                double_buffering=False, zero_fill=True):
    """``actual_optimizer`` averaging gradients over the ranks before each
    update, after broadcasting rank 0's parameters at the first.

    Parameters
    ----------
    actual_optimizer : chainer.Optimizer
    communicator : DaskCommunicator
    double_buffering : bool
        ChainerMN's one-step-stale update: each update applies the
        previous step's mean gradient while this step's is summed
        (:meth:`~dasktrain.chainermn.communicator.DaskCommunicator.
        multi_node_mean_grad_async`). ChainerMN offers it with its
        ``pure_nccl`` communicator only; here on every transport.
    zero_fill : bool
        Unused parameters' gradients taken as zeros (ChainerMN's).
    """
    if double_buffering:
        return DoubleBufferingOptimizer(actual_optimizer, communicator,
                                        zero_fill)
    return chainermn.optimizers.create_multi_node_optimizer(
        actual_optimizer, communicator, zero_fill=zero_fill)


class DoubleBufferingOptimizer(
        chainermn.optimizers._DoubleBufferingOptimizer):
    """ChainerMN's double-buffering optimizer, its update as it is (the
    first update broadcasts rank 0's parameters into a second copy of the
    model, the second applies nothing, each later one swaps this step's
    gradients with the copy's mean and applies that), with the all-reduce
    on dasktrain's communicator instead of a CUDA stream of its own."""

    def __init__(self, actual_optimizer, communicator, zero_fill):
        # ChainerMN's __init__ makes a CUDA stream, which a CPU run lacks;
        # its attributes live on the wrapper, not the wrapped optimizer.
        for name, value in (('communicator', communicator),
                            ('actual_optimizer', actual_optimizer),
                            ('needs_update', False),
                            ('communicated_target', None),
                            ('target_params_list', [[], []]),
                            ('zero_fill', zero_fill)):
            object.__setattr__(self, name, value)

    def multi_node_mean_grad_async(self):
        self.communicator.multi_node_mean_grad_async(
            self.communicated_target, self.zero_fill)

    def wait(self):
        self.communicator.wait_mean()
