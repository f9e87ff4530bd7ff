"""ChainerMN's multi-node iterators (``chainermn.iterators``), over a
:class:`~dasktrain.chainermn.communicator.DaskCommunicator`.

``create_multi_node_iterator(actual_iterator, communicator,
rank_master=0)``: the master rank's batches on every rank, broadcast
batch by batch (an encoder on one rank and its decoder on another see the
same samples; every rank of a channel-parallel convolution the same
images); ``create_synchronized_iterator(actual_iterator, communicator)``:
every rank's iterator shuffles with the same seed, rank 0's, so the ranks
draw the same batches without sending them.

ChainerMN's own code, which only calls the communicator's ``bcast`` and
``bcast_obj``: the same batches as under MPI (sent ChainerMN's way: a
pair dataset's arrays as float32). One line differs: ChainerMN 7.8.1's
other ranks read the dataset's size with ``int()`` of a one-element
array, which NumPy 2 refuses (``TypeError: only 0-dimensional arrays can
be converted to Python scalars``); :class:`MultiNodeIteratorSlave` reads
its element.
"""
import chainer
import numpy
from chainermn.iterators import create_synchronized_iterator
from chainermn.iterators.multi_node_iterator import (
    _MultiNodeIteratorMaster,
    _MultiNodeIteratorSlave,
)


class MultiNodeIteratorSlave(_MultiNodeIteratorSlave):
    """A rank other than the master's: ChainerMN's, the size read as
    NumPy 2 allows (the master broadcasts it as a one-element array)."""

    def __init__(self, communicator, rank_master):
        chainer.dataset.iterator.Iterator.__init__(self)
        self.communicator = communicator
        self.rank_master = rank_master
        self.epoch = 0
        self.current_position = 0
        self.is_new_epoch = False
        size = self.communicator.bcast(None, root=self.rank_master)
        self.dataset_size = int(numpy.asarray(size).reshape(-1)[0])
        self._order = self.communicator.bcast(
            None, root=self.rank_master).astype(numpy.int64)
        if self._order[0] == -1:  # not shuffled
            self._order = None


def create_multi_node_iterator(actual_iterator, communicator,
                               rank_master=0):
    """``actual_iterator``'s batches (on rank ``rank_master``) on every
    rank of ``communicator``; every rank calls it, and then steps and
    serialises its iterator at the same points (ChainerMN's)."""
    chainer.utils.experimental(
        'chainermn.iterators.create_multi_node_iterator')
    if communicator.rank == rank_master:
        return _MultiNodeIteratorMaster(actual_iterator, communicator,
                                        rank_master)
    return MultiNodeIteratorSlave(communicator, rank_master)


__all__ = ['MultiNodeIteratorSlave', 'create_multi_node_iterator',
           'create_synchronized_iterator']
