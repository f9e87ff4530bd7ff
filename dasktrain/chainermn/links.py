"""ChainerMN's links (``chainermn.links``).

``MultiNodeBatchNormalization``: batch normalisation whose batch
statistics (mean and mean of squares forward, the sums of the gradients
of beta and gamma backward) are averaged over the ranks, so N ranks of
batch B normalise as one process on the batch of N * B; and
``create_mnbn_model``, a model's every BatchNormalization made one.
ChainerMN's own link and function; only its choice of transport, which
would import MPI, is made here: the communicator's mean
(``_multi_node_mean``), the ``mpi`` path of ChainerMN's function.

``MultiNodeChainList``: a model made of parts on several ranks, each
part receiving its inputs from ranks (or the model's inputs) and sending
its outputs to ranks (or returning them), joined by delegate variables
so that one ``backward`` on each rank runs the whole model's backward
pass; and ``create_multi_node_n_step_rnn``, a stacked RNN whose hidden
states come from and go to other ranks (an encoder on one rank, its
decoder on another). ChainerMN's classes, their forward passes on
:mod:`~dasktrain.chainermn.functions`.

Owns the links; the mean is the communicator's
(:mod:`~dasktrain.chainermn.models`).
"""
import queue

import chainer
import chainermn.links
import numpy
from chainer import initializers, variable
from chainermn.links.n_step_rnn import _MultiNodeNStepRNN

from dasktrain.chainermn import functions


class MultiNodeBatchNormalization(chainermn.links.MultiNodeBatchNormalization):
    """Batch normalisation over the ranks of ``comm`` (ChainerMN's
    arguments; every ``communication_backend``, ``'auto'``, ``'mpi'`` or
    ``'nccl'``, means the communicator's own transport: NCCL for GPU
    arrays where every rank has it; ``'nccl'`` is refused, as by
    ChainerMN, for a communicator not made as ``pure_nccl``)."""

    def __init__(self, size, comm, decay=0.9, eps=2e-5, dtype=None,
                 use_gamma=True, use_beta=True, initial_gamma=None,
                 initial_beta=None, communication_backend='auto'):
        if communication_backend not in ('auto', 'mpi', 'nccl'):
            raise ValueError('MultiNodeBatchNormalization does not support '
                             f'{communication_backend!r}')
        if communication_backend == 'nccl' and \
                getattr(comm, 'name', 'pure_nccl') != 'pure_nccl':
            raise ValueError(f"communication_backend 'nccl' is not supported"
                             f' in MultiNodeBatchNormalization when using '
                             f'a {comm.name!r} communicator (ChainerMN: '
                             "'pure_nccl' only)")
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


class MultiNodeChainList(chainermn.links.MultiNodeChainList):
    """Parts of a model on several ranks, as ChainerMN's
    (``add_link(link, rank_in=None, rank_out=None)``, each a rank, a list
    of ranks or None: the model's inputs, or its output).

    The parts run in the order they were added: a part with ``rank_in``
    receives its inputs from those ranks (this rank itself: from a part
    before), one with ``rank_out`` sends its outputs to them. Calling the
    model returns its output, or where it has none the delegate variable
    of its last send; ``backward`` from it runs every part's backward
    pass in reverse order, receiving and sending the gradients.

    Parameters
    ----------
    comm : DaskCommunicator
    """

    def __call__(self, *inputs):
        comm, rank = self._comm, self._comm.rank
        kept = queue.Queue()  # what a part sends to this rank itself
        y = delegate = None
        for i, (part, (rank_in, rank_out)) in enumerate(
                zip(self._children, self._rank_inouts)):
            if rank_in is None:  # the model's inputs
                if i == 0:
                    x = part(*inputs)
                else:  # backward must reach the parts before
                    x, = functions.pseudo_connect(delegate, *inputs)
                    x = part(x)
            else:
                xs = []
                for source in rank_in:
                    if source == rank:
                        got = kept.get()
                        if delegate is not None:
                            got, = functions.pseudo_connect(delegate, got)
                    else:
                        got = functions.recv(comm, rank=source,
                                             delegate_variable=delegate)
                    xs.append(got)
                    # the backward path to the parts before goes last
                    delegate = got
                delegate = None  # each edge's backward runs once
                x = part(*xs)
            if rank_out is None:  # the model's output
                y = delegate = x
                continue
            for j, dest in enumerate(rank_out):
                if dest == rank:
                    if delegate is not None:
                        x, = functions.pseudo_connect(delegate, x)
                    kept.put(x)
                    delegate = x
                    continue
                if j > 0 and delegate is not None:
                    # several sends: their backwards run in reverse order
                    x, = functions.pseudo_connect(delegate, x)
                delegate = functions.send(x, comm, rank=dest)
        if not kept.empty():
            raise ValueError(
                'Communication queue is not empty at the end of forward. '
                'Make sure if all rank_in and rank_out correspond each '
                'other.')
        if y is delegate or y is None:
            return delegate  # the output, or the last send's delegate
        y, = functions.pseudo_connect(delegate, y)  # an earlier output
        return y


class MultiNodeNStepRNN(_MultiNodeNStepRNN):
    """A stacked RNN link whose initial states come from ``rank_in`` and
    whose final ones go to ``rank_out``; it returns the link's outputs
    and the delegate variable of the states' sends (None without
    ``rank_out``). See :func:`create_multi_node_n_step_rnn`."""

    def __call__(self, *inputs):
        cells = [None] * self.n_cells
        if self.rank_in is not None:
            cells = [functions.recv(self.communicator, rank=self.rank_in)
                     for _ in range(self.n_cells)]
        outputs = self.actual_rnn(*(tuple(cells) + inputs))
        cells = outputs[:-1]
        delegate = None
        if self.rank_out is not None:
            cell = cells[0]
            for i in range(self.n_cells):
                delegate = functions.send(cell, self.communicator,
                                          rank=self.rank_out)
                if i < self.n_cells - 1:
                    cell, = functions.pseudo_connect(delegate, cells[i + 1])
        return outputs + (delegate,)


def create_multi_node_n_step_rnn(actual_link, communicator, rank_in=None,
                                 rank_out=None):
    """``actual_link`` (an ``NStepLSTM``, ``NStepGRU``, ``NStepRNNTanh``,
    ... or their Bi- forms) receiving its initial hidden states from rank
    ``rank_in`` and sending its final ones to rank ``rank_out`` (None:
    neither), as ChainerMN's: called, it returns the link's outputs and a
    delegate variable, from which the backward pass starts where
    ``rank_out`` is set."""
    chainer.utils.experimental('chainermn.links.create_multi_node_n_step_rnn')
    return MultiNodeNStepRNN(actual_link, communicator, rank_in, rank_out)
