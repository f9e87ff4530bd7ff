"""What every part of :mod:`dasktrain.chainermn` shares: :class:`Unsupported`
(a ChainerMN call not offered, said as one line naming it), :func:`say`
(one line on stderr, in a script that configured no logging too) and
:func:`fatal` (a communicator call whose peer is lost ends the process,
as MPI does)."""
import functools
import logging
import os
import sys

from dasktrain.errors import UserError
from dasktrain.parallel.comm.base import CollectiveError

logger = logging.getLogger('dasktrain.chainermn')


class Unsupported(UserError, NotImplementedError):
    """A ChainerMN call that ``dasktrain.chainermn`` does not offer.

    Examples
    --------
    >>> str(Unsupported('create_communicator(mpi_comm=...)'))
    'dasktrain.chainermn does not support create_communicator(mpi_comm=...)'
    """

    def __init__(self, call, why=None):
        super().__init__(f'dasktrain.chainermn does not support {call}'
                         + (f': {why}' if why else ''))


def say(line, level=logging.INFO):
    """One line on stderr through the ``dasktrain.chainermn`` logger,
    also in a script that configured no logging."""
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter('%(message)s'))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    logger.log(level, line)


def fatal(method):
    """As under MPI, whose errors are fatal: a communicator call that
    fails because a peer died or hangs (:class:`CollectiveError`) ends
    this process at once with one line, without unwinding the user's code.
    Unwinding would run Chainer's extensions' ``finalize``, and the
    multi-node checkpointer's deletes the very checkpoints a relaunch
    resumes from.

    Every such call first finishes a double-buffered mean still in flight
    (the communicator's ``_finish_mean``): the ranks' collectives run one
    at a time, in the order every rank makes them (a
    MultiNodeBatchNormalization's sums in the next forward pass come after
    the gradients' on every rank)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            self._finish_mean()
            return method(self, *args, **kwargs)
        except CollectiveError as e:
            say(f'dasktrain.chainermn: rank {self.rank} stops '
                f'({type(e).__name__}: {e}), as MPI ends a job whose '
                'peer is lost', logging.ERROR)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(1)
    return call
