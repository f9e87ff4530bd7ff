"""What every part of :mod:`dasktrain.chainermn` shares: :class:`Unsupported`
(a ChainerMN call not offered, said as one line naming it), :func:`say`
(one line on stderr, in a script that configured no logging too),
:func:`fatal` (a communicator call whose peer is lost ends the process,
as MPI does) and :func:`last_words` (that line, where the rank's output
really goes, also under a test runner that captures it)."""
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
    (the communicator's ``_settle``): the ranks' collectives run one
    at a time, in the order every rank makes them (a
    MultiNodeBatchNormalization's sums in the next forward pass come after
    the gradients' on every rank)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            self._settle()
            return method(self, *args, **kwargs)
        except CollectiveError as e:
            last_words(f'dasktrain.chainermn: rank {self.rank} stops '
                       f'({type(e).__name__}: {e}), as MPI ends a job '
                       'whose peer is lost')
            os._exit(1)
    return call


def last_words(line):
    """Write ``line`` on stderr before this process ends at once
    (``os._exit``), where the rank's output goes: also where a test runner
    or anything else has captured stderr into a file of its own, which an
    ``os._exit`` never prints, the line goes to the stderr this process
    was started with (its parent's, ``dasktrain launch``'s log or pipe)."""
    text = line.rstrip('\n') + '\n'
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or odd stream: the line still goes
            pass
    try:
        os.write(2, text.encode(errors='replace'))
    except OSError:
        pass
    started = started_stderr()
    if started is not None:
        try:
            fd = os.open(started, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, text.encode(errors='replace'))
            finally:
                os.close(fd)
        except OSError:
            pass


def started_stderr(pid=None):
    """The path (``/proc/PARENT/fd/2``) of the stderr this process was
    started with where its own fd 2 now goes elsewhere (a test runner's
    capture), else None: the parent's fd 2 is what this process inherited
    (``dasktrain launch``'s keeper, a shell that started it)."""
    parent = f'/proc/{os.getppid() if pid is None else pid}/fd/2'
    try:
        theirs, ours = os.stat(parent), os.fstat(2)
    except OSError:
        return None
    return None if os.path.samestat(theirs, ours) else parent
