"""An epoch's metrics summed over the ranks of a job: :class:`EpochSums`,
which every rank turns into the same log row.

Owns the sums and the row's metrics; writing the log is
:mod:`~dasktrain.training.loop`'s.
"""
import dataclasses

import numpy as np


@dataclasses.dataclass
class EpochSums:
    """A rank's share of an epoch's metrics, summed over the ranks by one
    all-reduce of the fields in this order; every rank then computes the
    same log row (:meth:`row`).

    Examples
    --------
    >>> sums = EpochSums(loss=3.0, accuracy=1.5, images=6, train_time=2.0,
    ...                  val_loss=1.0, val_accuracy=2.0, val_images=4)
    >>> row = sums.row(ranks=1)
    >>> row['main/loss'], row['images_per_sec'], row['validation/main/loss']
    (0.5, 3.0, 0.25)
    """
    loss: float = 0.0          # training loss, summed over images
    accuracy: float = 0.0      # training accuracy, summed over images
    images: float = 0.0        # training images seen
    train_time: float = 0.0    # s of training (each rank's)
    data_wait: float = 0.0     # s waiting for the epoch's data
    comm_time: float = 0.0     # s communicating
    val_loss: float = 0.0      # test loss, summed over test images
    val_accuracy: float = 0.0  # test accuracy, summed over test images
    val_images: float = 0.0    # test images evaluated
    elapsed: float = 0.0       # s since the run began: rank 0's, else 0

    def summed(self, comm):
        """The sums over every rank of ``comm``."""
        values = np.array([getattr(self, f.name)
                           for f in dataclasses.fields(self)])
        return EpochSums(*comm.allreduce([values])[0])

    def row(self, ranks):
        """The log row's metrics, from sums over ``ranks`` ranks; the
        times are the ranks' means (all train in lock step)."""
        return {
            'main/loss': float(self.loss / self.images),
            'main/accuracy': float(self.accuracy / self.images),
            'validation/main/loss': float(self.val_loss / self.val_images),
            'validation/main/accuracy':
                float(self.val_accuracy / self.val_images),
            'elapsed_time': float(self.elapsed),
            'images_per_sec': float(self.images / (self.train_time / ranks)),
            'data_wait_time': float(self.data_wait / ranks),
            'comm_time': float(self.comm_time / ranks),
        }
