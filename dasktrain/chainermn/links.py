"""``links.MultiNodeBatchNormalization``: batch normalisation whose batch
statistics (mean and mean of squares forward, the sums of the gradients
of beta and gamma backward) are averaged over the ranks, so N ranks of
batch B normalise as one process on the batch of N * B.

ChainerMN's own link and function; only its choice of transport, which
would import MPI, is made here: the communicator's mean
(``_multi_node_mean``), the ``mpi`` path of ChainerMN's function. Owns the
link; the mean is :mod:`~dasktrain.chainermn.communicator`'s.
"""
import chainer
import chainermn.links
import numpy
from chainer import initializers, variable

from dasktrain.chainermn.support import Unsupported


class MultiNodeBatchNormalization(chainermn.links.MultiNodeBatchNormalization):
    """Batch normalisation over the ranks of ``comm`` (ChainerMN's
    arguments; ``communication_backend`` may be ``'auto'`` or ``'mpi'``,
    both meaning the communicator's own transport)."""

    def __init__(self, size, comm, decay=0.9, eps=2e-5, dtype=None,
                 use_gamma=True, use_beta=True, initial_gamma=None,
                 initial_beta=None, communication_backend='auto'):
        if communication_backend not in ('auto', 'mpi'):
            raise Unsupported(f'MultiNodeBatchNormalization(communication_'
                              f'backend={communication_backend!r})',
                              "use 'auto'")
        # ChainerMN's __init__ without its backend probe, which imports
        # mpi4py: the same persistent values and parameters.
        chainer.Link.__init__(self)
        self._highprec_dtype = chainer.get_dtype(
            dtype, map_mixed16=numpy.float32)
        self.comm = comm
        self.avg_mean = numpy.zeros(size, dtype=self._highprec_dtype)
        self.register_persistent('avg_mean')
        self.avg_var = numpy.zeros(size, dtype=self._highprec_dtype)
        self.register_persistent('avg_var')
        self.N = 0
        self.register_persistent('N')
        self.decay, self.eps = decay, eps
        self._communication_backend = 'mpi'
        with self.init_scope():
            if use_gamma:
                init = initializers._get_initializer(
                    1 if initial_gamma is None else initial_gamma)
                init.dtype = self._highprec_dtype
                self.gamma = variable.Parameter(init, size)
            if use_beta:
                init = initializers._get_initializer(
                    0 if initial_beta is None else initial_beta)
                init.dtype = self._highprec_dtype
                self.beta = variable.Parameter(init, size)


def create_mnbn_model(link, comm, communication_backend='auto'):
    """A copy of ``link`` with every ``BatchNormalization`` made a
    :class:`MultiNodeBatchNormalization` (ChainerMN's helper)."""
    import copy
    if isinstance(link, chainer.links.BatchNormalization):
        mnbn = MultiNodeBatchNormalization(
            size=link.avg_mean.shape, comm=comm, decay=link.decay,
            eps=link.eps, dtype=link.avg_mean.dtype,
            use_gamma=hasattr(link, 'gamma'), use_beta=hasattr(link, 'beta'),
            communication_backend=communication_backend)
        mnbn.copyparams(link)
        for name in link._persistent:
            mnbn.__dict__[name] = copy.deepcopy(link.__dict__[name])
        return mnbn
    if isinstance(link, chainer.Chain):
        new = copy.deepcopy(link)
        for name in link._children:
            new.__dict__[name] = create_mnbn_model(
                link.__dict__[name], comm, communication_backend)
        return new
    if isinstance(link, chainer.Sequential):
        new = copy.deepcopy(link)
        for i, child in enumerate(link):
            new[i] = create_mnbn_model(child, comm, communication_backend)
        return new
    if isinstance(link, chainer.ChainList):
        new = copy.deepcopy(link)
        for i, child in enumerate(link):
            new._children[i] = create_mnbn_model(child, comm,
                                                 communication_backend)
        return new
    return copy.deepcopy(link)


def __getattr__(name):
    if name in ('MultiNodeChainList', 'create_multi_node_n_step_rnn'):
        raise Unsupported(f'chainermn.links.{name}',
                          'model parallelism is not offered')
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
