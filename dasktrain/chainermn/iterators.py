"""ChainerMN's multi-node iterators (``chainermn.iterators``), over a
:class:`~dasktrain.chainermn.communicator.DaskCommunicator`.

``create_multi_node_iterator(actual_iterator, communicator,
rank_master=0)``: the master rank's batches on every rank, broadcast
batch by batch (an encoder on one rank and its decoder on another see the
same samples); ``create_synchronized_iterator(actual_iterator,
communicator)``: every rank's iterator shuffles with the same seed, rank
0's, so the ranks draw the same batches without sending them.

They are ChainerMN's own code, which only calls the communicator's
``bcast`` and ``bcast_obj``: the same batches as under MPI (the multi-node
iterator sends ChainerMN's way: a pair dataset's arrays as float32).
"""
from chainermn.iterators import (
    create_multi_node_iterator,
    create_synchronized_iterator,
)

__all__ = ['create_multi_node_iterator', 'create_synchronized_iterator']
