"""ChainerMN's dataset scattering over a
:class:`~dasktrain.chainermn.communicator.DaskCommunicator`:
``scatter_dataset`` (rank ``root``'s dataset, optionally shuffled with a
seed, split in equal contiguous parts of the order, one per rank),
``scatter_index`` and ``create_empty_dataset``. They are ChainerMN's own
functions, which call only the communicator's ``bcast_obj``,
``send_obj`` and ``recv_obj``: the same split as under MPI, sample for
sample. Owns nothing more."""
import chainermn.datasets
from chainermn.datasets import DataSizeError


def scatter_dataset(dataset, comm, root=0, shuffle=False, seed=None,
                    max_buf_len=256 * 1024 * 1024, *,
                    force_equal_length=True):
    """This rank's part of rank ``root``'s ``dataset`` (a SubDataset); see
    :func:`chainermn.scatter_dataset`. ``max_buf_len`` is ignored: objects
    of any size travel."""
    return chainermn.datasets.scatter_dataset(
        dataset, comm, root=root, shuffle=shuffle, seed=seed,
        max_buf_len=max_buf_len, force_equal_length=force_equal_length)


def scatter_index(n_total_samples, comm, root=0, *,
                  force_equal_length=True):
    """``(begin, end)`` of this rank's part of ``n_total_samples``."""
    return chainermn.datasets.scatter_index(
        n_total_samples, comm, root=root,
        force_equal_length=force_equal_length)


def create_empty_dataset(dataset):
    """A dataset of empty tuples as long as ``dataset``."""
    return chainermn.datasets.create_empty_dataset(dataset)


__all__ = ['DataSizeError', 'create_empty_dataset', 'scatter_dataset',
           'scatter_index']
