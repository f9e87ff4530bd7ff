"""Communicators: how the ranks (processes) of one job sum arrays and hand
each other Python objects. Every one implements
:class:`~dasktrain.parallel.comm.base.Communicator` (``base``, with
``Solo``, the job of one process; ``batches``, how the arrays of one
collective travel); ``dask`` has ranks meet through Dask
and talk peer to peer, ``shm`` sums through shared memory on one machine,
``nccl`` sums GPU arrays with NCCL.

Each name below imports its module on first use (``nccl`` imports CuPy
only when a communicator is made).
"""
from dasktrain._lazy import exports

_EXPORTS = {
    **dict.fromkeys(('CollectiveError', 'Communicator', 'Pending', 'Solo',
                     'poll'), 'dasktrain.parallel.comm.base'),
    'signature': 'dasktrain.parallel.comm.batches',
    **dict.fromkeys(('DaskComm', 'PeerLost'), 'dasktrain.parallel.comm.dask'),
    'SharedMemoryReducer': 'dasktrain.parallel.comm.shm',
    'NcclComm': 'dasktrain.parallel.comm.nccl',
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
