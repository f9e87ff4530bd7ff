"""ChainerMN's differentiable communication (``chainermn.functions``):
Chainer functions whose forward pass is a message or a collective among
the ranks and whose backward pass is its mirror, so that gradients cross
the ranks as they cross layers in one process.

============  ==========================================================
forward       backward
============  ==========================================================
``send``      ``recv`` of the gradient from the receiving rank
``recv``      ``send`` of the gradient back to the sending rank
``bcast``     ``gather`` of the gradients to the root, summed there
``gather``    ``scatter`` of the root's gradients
``scatter``   ``gather`` of the gradients to the root
``allgather`` ``alltoall`` of the gradients, each rank summing its own
``alltoall``  ``alltoall`` of the gradients
============  ==========================================================

As in ChainerMN, ``send`` returns a *delegate variable* (an empty array
whose backward receives the gradient), ``recv`` takes one
(``delegate_variable``) so that a rank's graph stays connected from its
output back through every message, and :func:`pseudo_connect` joins a
delegate variable to the variables a graph goes on with. The arithmetic
is ChainerMN's (the same functions, the same sums in the same order). A
gradient that never came (an output nobody used) travels as zeros, and
:func:`pseudo_connect` gives zeros to an actual variable without one,
where ChainerMN would fail or leave a peer waiting. Arrays of any dtype
travel as they are.
"""
import chainer
import chainer.utils
from chainer import backend


def _zeros_for(outputs, grads):
    """``grads`` with each missing one (None) made zeros shaped like its
    output (``outputs``: ``(shape, dtype, xp)`` of each)."""
    return tuple(
        xp.zeros(shape, dtype) if g is None else g
        for (shape, dtype, xp), g in zip(outputs, grads))


def _remember(arrays):
    return [(a.shape, a.dtype, backend.get_array_module(a)) for a in arrays]


def _empty(xp, dtype='float32'):
    return xp.array([], dtype=dtype)


class Send(chainer.Function):
    """Send the inputs (all but the last, a dummy that keeps the function
    in the graph) to ``peer_rank``; the output is the delegate variable."""

    def __init__(self, comm, peer_rank, peer_tag):
        chainer.utils.experimental('chainermn.functions.Send')
        self.comm, self.peer_rank, self.peer_tag = comm, peer_rank, peer_tag

    @property
    def label(self):
        return f'{type(self).__name__} (peer_rank: {self.peer_rank})'

    def forward(self, inputs):
        xs = inputs[:-1]
        self.comm.send(xs[0] if len(xs) == 1 else tuple(xs), self.peer_rank,
                       self.peer_tag)
        return _empty(backend.get_array_module(*inputs)),

    def backward(self, inputs, grad_outputs):
        xp = backend.get_array_module(*inputs)
        grad = self.comm.recv(self.peer_rank, self.peer_tag)
        grads = grad if isinstance(grad, tuple) else (grad,)
        return tuple(grads) + (_empty(xp),)


class Recv(chainer.Function):
    """Receive arrays from ``peer_rank``; the input is the delegate
    variable of this rank's previous part of the graph, or a dummy."""

    def __init__(self, comm, peer_rank, peer_tag):
        chainer.utils.experimental('chainermn.functions.Recv')
        self.comm, self.peer_rank, self.peer_tag = comm, peer_rank, peer_tag

    @property
    def label(self):
        return f'{type(self).__name__} (peer_rank: {self.peer_rank})'

    def __call__(self, *inputs):
        if not inputs:  # a dummy keeps the function in the graph
            xp = backend.get_array_module(*inputs)
            dummy = chainer.Variable(_empty(xp))
            dummy.name = 'dummy_var'
            inputs = (dummy,)
        return super().__call__(*inputs)

    def forward(self, inputs):
        data = self.comm.recv(self.peer_rank, self.peer_tag)
        data = data if isinstance(data, tuple) else (data,)
        self._outputs = _remember(data)
        return data

    def backward(self, inputs, grad_outputs):
        grads = _zeros_for(self._outputs, grad_outputs)
        self.comm.send(grads[0] if len(grads) == 1 else grads,
                       self.peer_rank, self.peer_tag)
        return tuple(backend.get_array_module(x).zeros_like(x)
                     for x in inputs)


def send(x, communicator, rank, tag=0):
    """Send ``x`` (a variable, or a tuple or list of them) to rank
    ``rank``; returns the delegate variable, an empty variable whose
    backward receives the gradient of ``x`` from ``rank`` (see
    :func:`pseudo_connect`)."""
    chainer.utils.experimental('chainermn.functions.send')
    if rank == communicator.rank:
        raise ValueError('rank must be different from communicator rank, '
                         'otherwise deadlock occurs')
    many = isinstance(x, (list, tuple))
    xp = backend.get_array_module(*x) if many else \
        backend.get_array_module(x)
    # A dummy input: the backward runs (and receives) even where no input
    # requires a gradient, else the peer's recv would wait forever.
    dummy = chainer.Variable(_empty(xp))
    inputs = tuple(x) + (dummy,) if many else (x, dummy)
    delegate = Send(communicator, peer_rank=rank, peer_tag=tag)(*inputs)
    delegate.name = 'delegate_variable'
    return delegate


def recv(communicator, rank, delegate_variable=None, tag=0,
         force_tuple=False):
    """The variable (or tuple of variables, as sent) that rank ``rank``
    sent with ``tag``; its backward sends the gradient back. Where this
    rank's graph has a part before (its last :func:`send`'s delegate
    variable), pass it as ``delegate_variable``: the backward pass then
    goes on into that part. ``force_tuple``: a tuple even of one."""
    chainer.utils.experimental('chainermn.functions.recv')
    if rank == communicator.rank:
        raise ValueError('rank must be different from communicator rank, '
                         'otherwise deadlock occurs')
    function = Recv(communicator, peer_rank=rank, peer_tag=tag)
    if delegate_variable is None:
        res = function()
    else:
        delegate_variable.name = 'delegate_variable'
        res = function(delegate_variable)
    if force_tuple and not isinstance(res, tuple):
        return (res,)
    return res


class AllGather(chainer.Function):
    """Every rank's input, on every rank."""

    def __init__(self, comm):
        chainer.utils.experimental('chainermn.functions.AllGather')
        self.comm = comm

    def forward(self, inputs):
        x, = inputs
        ys = self.comm.allgather(x)
        self._outputs = _remember(ys)
        return ys

    def backward(self, inputs, grad_outputs):
        xp = backend.get_array_module(*inputs)
        gxs = self.comm.alltoall(_zeros_for(self._outputs, grad_outputs))
        return xp.stack(gxs).sum(axis=0),


class AllToAll(chainer.Function):
    """Input r of every rank, on rank r."""

    def __init__(self, comm):
        chainer.utils.experimental('chainermn.functions.AllToAll')
        self.comm = comm

    def forward(self, inputs):
        if len(inputs) != self.comm.size:
            raise ValueError(
                'The length of inputs must be same as communicator size.')
        ys = self.comm.alltoall(tuple(inputs))
        self._outputs = _remember(ys)
        return ys

    def backward(self, inputs, grad_outputs):
        return self.comm.alltoall(_zeros_for(self._outputs, grad_outputs))


class Bcast(chainer.Function):
    """The root's input, on every rank (off the root the input is a
    dummy)."""

    def __init__(self, comm, root):
        chainer.utils.experimental('chainermn.functions.Bcast')
        self.comm, self.root = comm, root

    def __call__(self, *inputs):
        if not inputs:
            xp = backend.get_array_module(*inputs)
            dummy = chainer.Variable(_empty(xp, chainer.config.dtype))
            dummy.name = 'dummy_var'
            inputs = (dummy,)
        return super().__call__(*inputs)

    def forward(self, inputs):
        x = inputs[0] if self.comm.rank == self.root else None
        y = self.comm.bcast(x, self.root)
        self._outputs = _remember([y])
        return y,

    def backward(self, inputs, grad_outputs):
        gx, = _zeros_for(self._outputs, grad_outputs)
        gxs = self.comm.gather(gx, self.root)
        if self.comm.rank == self.root:
            xp = backend.get_array_module(*gxs)
            return xp.stack(gxs).sum(axis=0),
        return None,


class Gather(chainer.Function):
    """Every rank's input on the root; a delegate variable elsewhere."""

    def __init__(self, comm, root):
        chainer.utils.experimental('chainermn.functions.Gather')
        self.comm, self.root = comm, root

    def forward(self, inputs):
        x, = inputs
        ys = self.comm.gather(x, self.root)
        if self.comm.rank == self.root:
            self._outputs = _remember(ys)
            return ys
        return _empty(backend.get_array_module(x), x.dtype),

    def backward(self, inputs, grad_outputs):
        if self.comm.rank == self.root:
            grads = _zeros_for(self._outputs, grad_outputs)
        else:
            grads = None
        return self.comm.scatter(grads, self.root),


class Scatter(chainer.Function):
    """The root's input r on rank r (off the root the input is a
    dummy)."""

    def __init__(self, comm, root):
        chainer.utils.experimental('chainermn.functions.Scatter')
        self.comm, self.root = comm, root

    def __call__(self, *inputs):
        if not inputs:
            xp = backend.get_array_module(*inputs)
            dummy = chainer.Variable(_empty(xp, chainer.config.dtype))
            dummy.name = 'dummy_var'
            inputs = (dummy,)
        return super().__call__(*inputs)

    def forward(self, inputs):
        xs = tuple(inputs) if self.comm.rank == self.root else None
        y = self.comm.scatter(xs, self.root)
        self._outputs = _remember([y])
        return y,

    def backward(self, inputs, grad_outputs):
        gy, = _zeros_for(self._outputs, grad_outputs)
        gxs = self.comm.gather(gy, self.root)
        if self.comm.rank == self.root:
            return gxs
        return tuple(backend.get_array_module(x).zeros_like(x)
                     for x in inputs)


class PseudoConnect(chainer.FunctionNode):
    """The actual variables (all inputs but the first) as they are; the
    backward gives the delegate variable (the first) a zero gradient, so
    the backward pass goes on into its part of the graph."""

    def forward(self, inputs):
        self._actual = [(x.shape, x.dtype, backend.get_device_from_array(x))
                        for x in inputs[1:]]
        self._delegate = (inputs[0].shape, inputs[0].dtype,
                          backend.get_device_from_array(inputs[0]))
        return inputs[1:]

    def backward(self, target_input_indexes, grad_outputs):
        def zeros(shape, dtype, device):
            with chainer.using_device(device):
                return chainer.Variable(device.xp.zeros(shape, dtype))
        # An actual variable without a gradient (unused, or a delegate
        # variable itself) gets zeros: its part's backward must still run,
        # or a peer would wait for its messages for ever.
        return (zeros(*self._delegate),) + tuple(
            zeros(*spec) if g is None else g
            for spec, g in zip(self._actual, grad_outputs))


def pseudo_connect(delegate_variable, *actual_variables):
    """``actual_variables`` as they are (a tuple), joined to
    ``delegate_variable`` (a :func:`send`'s, or None): the backward pass
    from them goes on into the part of the graph behind the delegate
    variable (it receives that part's gradients from its peer), as
    ChainerMN's. The actual variables may be delegate variables too."""
    chainer.utils.experimental('chainermn.functions.pseudo_connect')
    if delegate_variable is None:
        xp = backend.get_array_module(*actual_variables)
        delegate_variable = xp.empty((0,), xp.float32)
    return PseudoConnect().apply((delegate_variable,) + actual_variables)


def allgather(comm, x):
    """Every rank's ``x``, in rank order, on every rank (a tuple of
    variables); the backward sends each gradient to its rank, which sums
    what it gets."""
    chainer.utils.experimental('chainermn.functions.all_gather')
    return AllGather(comm)(x)


def alltoall(comm, xs):
    """``xs[r]`` of every rank, in rank order, on rank r (``xs``: one
    variable per rank); the backward sends the gradients back the same
    way."""
    chainer.utils.experimental('chainermn.functions.all_to_all')
    if len(xs) != comm.size:
        raise ValueError('The length of xs must be same as communicator size.')
    return AllToAll(comm)(*xs)


def bcast(comm, x, root=0):
    """Rank ``root``'s ``x`` on every rank (``x`` is ignored elsewhere);
    the backward sums every rank's gradient on the root."""
    chainer.utils.experimental('chainermn.functions.bcast')
    if comm.rank == root:
        return Bcast(comm, root)(x)
    return Bcast(comm, root)()


def gather(comm, x, root=0):
    """Every rank's ``x``, in rank order, on rank ``root`` (a tuple of
    variables); elsewhere a delegate variable. The backward scatters the
    root's gradients back."""
    chainer.utils.experimental('chainermn.functions.gather')
    return Gather(comm, root)(x)


def scatter(comm, xs, root=0):
    """Rank ``root``'s ``xs[r]`` on each rank r (``xs`` is ignored
    elsewhere); the backward gathers the gradients to the root."""
    chainer.utils.experimental('chainermn.functions.scatter')
    if comm.rank == root:
        return Scatter(comm, root)(*xs)
    return Scatter(comm, root)()


__all__ = ['AllGather', 'AllToAll', 'Bcast', 'Gather', 'PseudoConnect',
           'Recv', 'Scatter', 'Send', 'allgather', 'alltoall', 'bcast',
           'gather', 'pseudo_connect', 'recv', 'scatter', 'send']
