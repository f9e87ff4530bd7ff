"""How dg's gradients travel between the processes of one job: gradient
buckets in, sums out.

In dg mode across processes each step sums the masters' gradients (each
already weighted by its share of the job's batch, so the sum is the mean
gradient) and, in the same messages, the BatchNorm statistics, over the
job's communicator; then every process applies the same update.
:class:`GradientExchange` sums, in one of three ways, and hands back what
the update needs; the update (the optimizer, and copying its result into
every replica) is
:class:`~dasktrain.parallel.gradient.GPUDistributedGradient`'s:

- **exact, overlapped** (the default with one replica per process):
  gradient *buckets* of about ``bucket_mb`` are all-reduced on a
  communication thread while back-propagation goes on, as PyTorch DDP does.
  :func:`~dasktrain.parallel.exchange.backprop.backward_reporting` runs
  Chainer's backward pass and reports each parameter the moment its gradient is
  final; a bucket leaves when all its parameters are, in a fixed order that
  every rank agrees on (the order the first step found, compared across
  ranks once). A bucket is copied once into its persistent flat buffer
  (:mod:`~dasktrain.parallel.exchange.flat`) and summed there in place; once
  the backward pass is over each gradient becomes its view of the sum (a
  parameter's gradient may be the very array still flowing to earlier
  layers, so nothing is written into it before). The optimizer waits only
  for what is still in flight when the backward pass ends. Over Dask's
  comms and shared memory every element is summed in rank order, so the
  result is bit for bit that of one all-reduce after the backward pass
  (and of one process holding all the replicas); NCCL chooses its own
  summation order by message size, the same bits only for two ranks (one
  addition per element).
- **exact, after the backward pass** (``bucket_mb=0``, several replicas in
  one process, or the first step): one all-reduce of everything.
- **double-buffered** (ChainerMN's): the step hands back the previous
  step's sum, to apply while this step's travels on a communication thread
  (:meth:`~dasktrain.parallel.comm.base.Communicator.iallreduce`); one step
  stale, with two sets of flat buffers (the one in flight, the one being
  filled). The wrapper asks for exact steps first (its ``warmup``): a stale
  update early in training, when the gradients change fastest, can throw
  Adam off for good (measured: ``bench/double_buffering.py``). BatchNorm's
  running statistics are not overwritten by a stale mean each step: every
  replica updates its own from every batch, and ``flush`` writes their
  mean at the epoch's end, when nothing is stale; a running average is
  linear in the batches' statistics, so that mean is what exact dg's
  averaging every step gives.

``comm_dtype='float16'`` works with all three: each array travels scaled
by its own power of two (the same on every rank), so the sum cannot
overflow and small gradients keep their bits; the ranks agree on the
powers in the all-reduce that sums the bucket (one collective per bucket,
a second only after a sudden jump or drop:
:mod:`~dasktrain.parallel.exchange.wire`).

On GPUs a bucket's all-reduce, and a double-buffered step's, runs on one
non-blocking side stream that first waits for an event marking the
kernels that wrote what it sends (:func:`dasktrain.parallel.devices.mark`),
and the communication thread waits for the side stream before it takes the
next bucket or ends: nothing reads a gradient before it is written, the
training thread reads no sum before it is complete, and the backward
kernels never wait for NCCL (nor NCCL's deadline for them).

Guarantees: the communication thread lives for one step (one per step,
joined before the update; after an error in the backward pass it is told
to stop and ends within the collective timeout); its errors are raised in
the training thread.
"""
from typing import NamedTuple

import numpy as np

from dasktrain.errors import argument
from dasktrain.parallel.comm.base import CollectiveError
from dasktrain.parallel.devices import SideStream, mark
from dasktrain.parallel.exchange.backprop import backward_reporting
from dasktrain.parallel.exchange.buckets import (
    Courier,
    gradients,
    parameters,
    plan_buckets,
)
from dasktrain.parallel.exchange.flat import FlatBuckets, largest
from dasktrain.parallel.exchange.wire import WireScales


def check_exchange(comm_dtype, bucket_mb, warmup):
    """Validate GPUDistributedGradient's exchange options; returns the
    dtype the gradients travel in (None: as they are) and ``bucket_mb``."""
    if comm_dtype not in (None, 'float16', 'float32'):
        raise ValueError(f"comm_dtype must be None, 'float16' or "
                         f"'float32', got {comm_dtype!r}")
    if isinstance(bucket_mb, bool) or not isinstance(
            bucket_mb, (int, float)) or not bucket_mb >= 0:
        raise ValueError(f'bucket_mb must be a number >= 0, got '
                         f'{bucket_mb!r}')
    if not (warmup == 'epoch' or (
            isinstance(warmup, (int, np.integer)) and
            not isinstance(warmup, bool) and warmup >= 0)):
        raise ValueError(f"warmup must be an int >= 0 or 'epoch', got "
                         f'{warmup!r}')
    return (None if comm_dtype in (None, 'float32') else
            np.dtype(comm_dtype)), float(bucket_mb)


class Summed(NamedTuple):
    """What a step's exchange hands back beside the summed gradients
    (written into the master's): the persistent values (BatchNorm's
    statistics) as groups across this process's replicas, and their means
    over the job's replicas, to write into every replica."""
    groups: list
    means: list


class GradientExchange:
    """Sums the master gradients and the BatchNorm statistics of
    ``replicas`` (:class:`~dasktrain.parallel.replicas.Replicas`) over their
    communicator each dg step; ``clock`` counts the time the training
    thread waits. ``comm_dtype`` (a NumPy dtype or None),
    ``double_buffering`` and ``bucket_mb`` are GPUDistributedGradient's
    options. See the module docstring for the ways and their guarantees.
    """

    def __init__(self, replicas, clock, comm_dtype=None,
                 double_buffering=False, bucket_mb=0.0, warmup='epoch'):
        self.replicas, self.clock = replicas, clock
        self.comm_dtype = comm_dtype
        self.double_buffering = double_buffering
        # The iteration of the first stale step: known at once for an int
        # warm-up, at the first epoch's end (flush) for 'epoch' (-1 until).
        self.stale_from = -1 if warmup == 'epoch' else int(warmup)
        self.bucket_bytes = bucket_mb * 2 ** 20
        self.plan = None        # buckets of parameter indices, once agreed
        self._order = None      # the first step's ready order
        self._step = None       # this step's bucket state while overlapping
        self._inflight = None   # double buffering: last step's sums
        self.early = 0          # buckets that left during a backward pass
        # One side stream for good: CuPy caches freed memory per stream, and
        # a stream made per step would strand each step's cache.
        self._side = None
        self._param_list = None
        self._flat = [None] * 3  # buffers: exact's, double buffering's 2
        # float16's scales, agreed in the sums themselves
        self.wire = None if comm_dtype is None else \
            WireScales(replicas.comm, self.device, largest)

    @property
    def comm(self):
        return self.replicas.comm

    @property
    def device(self):  # the master's, where gradients are summed
        return self.replicas.devices[0]

    # ------------------------------------------------------ the pieces

    def _params(self):
        # Found once: sorting namedparams() at every bucket costs per step.
        if self._param_list is None:
            self._param_list = parameters(self.replicas.master)
        return self._param_list

    def grads(self, indices=None):
        """The master's gradients (those of the parameters ``indices``)."""
        return gradients(self.replicas.master, self.device, indices,
                         self._params())

    def _fill(self, flat, k, grads, timed=None):
        """Bucket ``k`` of ``flat`` filled with ``grads`` for its sum (in
        float16 at scales :attr:`wire` agrees on; ``timed``: the clock
        of a wait on the training thread, if any); the buffers and what
        :meth:`_settle` needs."""
        if self.wire is None:
            return flat.fill(k, grads), None
        return self.wire.send(flat, k, grads, timed)

    def _settle(self, flat, k, grads, sent, timed=None):
        """After the sum of bucket ``k``: the scales it stands at (1
        without float16), sent again first where the probes say so."""
        if self.wire is None:
            return 1.0
        return self.wire.settle(flat, k, grads, sent, self.comm.allreduce,
                                timed)

    def _buffers(self, which, plan=None):
        """The flat buffers ``which`` (0: exact, 1 and 2: double
        buffering's) of ``plan`` (None: one bucket), made once per plan."""
        params = self._params()
        plan = plan or [list(range(len(params)))]
        flat = self._flat[which]
        if flat is None or flat.plan != plan:
            flat = self._flat[which] = FlatBuckets(
                params, plan, self.device, self.comm_dtype,
                probes=self.wire is not None)
        return flat

    def _statistics(self):
        replicas = self.replicas
        groups = replicas.groups(replicas.links, params=False)
        # In float64 a mean is rounded once, the same bits however the
        # replicas are spread (NCCL's order too); of two replicas a float32
        # sum is too (a + b rounded once, halved exactly, but below 1e-38).
        return groups, replicas.local_sums(groups,
                                           wide=replicas.total > 2)[0]

    # ------------------------------------------------------ one step

    def overlapping(self):
        """Whether this step's buckets leave during the backward pass."""
        return (self.bucket_bytes > 0 and not self.double_buffering and
                self.comm.size > 1 and
                # one replica in every process (known alike on all ranks)
                self.replicas.total == self.comm.size)

    def backward(self, loss, loss_scale=None):
        """Back-propagate the master's ``loss`` (None: this rank has no
        images this step, yet takes part in every bucket's all-reduce),
        scaled by ``loss_scale`` as ``loss.backward(loss_scale=...)``
        scales it; while overlapping, each bucket leaves once its
        gradients are final."""
        if not self.overlapping():
            if loss is not None:
                loss.backward(loss_scale=loss_scale)
            return
        params = self._params()
        index = {id(p): i for i, p in enumerate(params)}
        if self.plan is None:  # a first step: learn the order
            self._order = []
            if loss is not None:
                backward_reporting(loss, lambda p: self._order.append(
                    index[id(p)]) if id(p) in index else None, loss_scale)
            return
        left = [len(b) for b in self.plan]
        where = {i: k for k, b in enumerate(self.plan) for i in b}
        self._side_stream(), self._buffers(0, self.plan)  # not on a thread
        results = []  # (bucket, scales) as each is summed, in order
        courier = Courier(lambda *bucket: self._send(results, *bucket))
        self._step = state = {'courier': courier, 'next': 0,
                              'results': results}

        def ready(param):
            if id(param) not in index:  # a leaf Variable, no parameter
                return
            left[where[index[id(param)]]] -= 1
            # The last bucket waits for the statistics (one message).
            while state['next'] < len(self.plan) - 1 and \
                    left[state['next']] == 0:
                self._launch(state['next'])
                state['next'] += 1
                self.early += 1
        try:
            if loss is not None:
                backward_reporting(loss, ready, loss_scale)
        except BaseException:
            self._step = None
            courier.close(self.comm.timeout, quiet=True)
            raise

    def _side_stream(self):
        if self._side is None:
            self._side = SideStream(self.device)
        return self._side

    def _launch(self, k, statistics=None):
        # Only this bucket's parameters: the others may still be computed.
        grads = self.grads(self.plan[k])
        # The sums go to the bucket's flat buffer, bound to the gradients
        # once the backward pass is over: a parameter's gradient may be the
        # very array still flowing to earlier layers (Chainer's Add passes
        # its output's gradient on as is, e.g. to a bias of the output's
        # shape).
        self._step['courier'].put(k, grads, mark(self.device), statistics)

    def _send(self, results, k, grads, event, statistics):
        """On the communication thread: copy bucket ``k`` into its flat
        buffers (on the side stream, after the kernels that wrote it) and
        sum them over the ranks in place (and, with the last, the
        statistics); its scales go to ``results``, for :meth:`step` to
        bind.

        In float32 a bucket other than the last is only queued (NCCL runs
        the sums in order on the side stream; the host waits for none of
        them): the next bucket leaves as soon as its gradients are final,
        and the last bucket's sum, which follows them all on the stream,
        is waited for. float16 waits for each bucket's sum: its probes
        say whether it stands before the next scales are chosen."""
        last = statistics is not None
        queue = not last and self.wire is None
        with self._side.after(event, wait=not queue):
            flat = self._buffers(0, self.plan)
            sent, wire = self._fill(flat, k, grads)
            if queue:
                self.comm.allreduce_queued(sent)
                results.append((k, 1.0))
                return
            if last:
                self.replicas.reduce(statistics, also=sent)
                self.comm.finish_queued()  # done: they ran before it
            else:
                self.comm.allreduce(sent)
            results.append((k, self._settle(flat, k, grads, wire)))

    @property
    def pending(self):
        """Double buffering: whether a step's sums are in flight (the next
        step applies them)."""
        return self._inflight is not None

    def stale(self, iteration):
        """Whether the step of ``iteration`` (from 0) is double-buffered:
        with ``double_buffering``, once the warm-up is over."""
        return self.double_buffering and 0 <= self.stale_from <= iteration

    def step(self, iteration=0):
        """Sum this step's gradients (into the master's) and statistics;
        ``iteration`` (from 0) says whether the warm-up is over.

        Returns
        -------
        Summed or None
            The statistics' means to apply with the update now: this
            step's, or with double buffering the previous step's gradients
            and no statistics (None on the first step, which has none to
            apply).
        """
        if self.stale(iteration):
            return self._double_buffered()
        state = self._step
        groups, sums = self._statistics()
        if state is None:  # everything after the backward pass
            grads, flat = self.grads(), self._buffers(0)
            sent, wire = self._fill(flat, 0, grads, self.clock.timed)
            # The all-reduce returns once its sums are done (NCCL's stream
            # polled, host copies synchronous).
            self.clock.timed(lambda: self.replicas.reduce(sums, also=sent))
            flat.bind(0, self._params(), self._settle(
                flat, 0, grads, wire, self.clock.timed))
            if self._order is not None:
                self._agree()
        else:
            for k in range(state['next'], len(self.plan) - 1):
                self._launch(k)  # parameters no gradient reached: zeros
            self._launch(len(self.plan) - 1, sums)
            self._step = None
            self.clock.timed(state['courier'].close)
            flat = self._buffers(0, self.plan)
            for k, scale in state['results']:
                flat.bind(k, self._params(), scale)
        return Summed(groups, sums)

    def _agree(self):
        """Fix the buckets from the first step's order, the same on every
        rank (compared once: a mismatch would mix up arrays); a rank that
        had no images that step takes the others' plan."""
        mine = None
        if self._order:
            sizes = [p.array.nbytes for p in self._params()]
            mine = plan_buckets(self._order, sizes, self.bucket_bytes)
        self._order = None
        plans = self.comm.allgather(mine)
        agreed = next((p for p in plans if p is not None), None)
        for rank, theirs in enumerate(plans):
            if theirs is not None and theirs != agreed:
                raise CollectiveError(
                    f'rank {rank} back-propagates its parameters in another '
                    f'order than rank {plans.index(agreed)}: different '
                    f'models? ({argument("bucket_mb")} 0 sends after the '
                    'backward pass)')
        self.plan = agreed

    def _double_buffered(self):
        """Start this step's sums; hand back the previous step's."""
        previous = self._inflight
        # The exact steps' buffers are done with once the stale ones begin
        # (a gradient's worth of memory, on the GPU).
        self._flat[0] = None
        if previous is not None:  # one collective at a time, same order
            previous = self._waited(previous)
        grads = self.grads()
        # Never the set in flight: its sums are bound below, after this.
        flat = self._buffers(2 if previous is not None and
                             previous.flat is self._flat[1] else 1)
        sent, wire = self._fill(flat, 0, grads, self.clock.timed)
        groups, sums = self._statistics()
        # The copies and statistics are written on the master's stream (by
        # this thread's kernels, and by copies from other GPUs that
        # devices.transfer orders by events): the side stream starts after
        # them and sums there, beside the next step's kernels.
        event, side = mark(self.device), self._side_stream()
        self._inflight = _Inflight(self.replicas.ireduce(
            sums, also=sent, around=lambda: side.after(event)), groups,
            flat, grads if self.wire is not None else None, wire)
        if previous is None:
            return None
        return self._arrived(previous, statistics=False)

    def _waited(self, inflight):
        """``inflight`` once its sums are done and (float16) settled: sent
        again first where the probes say so, on this thread, before any
        other collective."""
        self.clock.timed(inflight.reduction.wait)
        return inflight._replace(wire=self._settle(
            inflight.flat, 0, inflight.grads, inflight.wire,
            self.clock.timed), grads=None)

    def _arrived(self, inflight, statistics=True):
        """Bind a finished, settled double-buffered step's sums to the
        master's gradients; the statistics' means only when asked
        (:meth:`flush`): mid-epoch they are a step old, and every replica's
        own running statistics already hold this step's batch."""
        means = inflight.reduction.wait()
        inflight.flat.bind(0, self._params(), inflight.wire)
        return Summed(inflight.groups, means) if statistics else \
            Summed([], [])

    def flush(self, iteration=0):
        """Double buffering: the sums still travelling, written into the
        master's gradients, and their :class:`Summed` to apply (at every
        epoch end, so that checkpoints hold no step in flight); None when
        none travel. The first flush ends an 'epoch' warm-up."""
        if self.stale_from < 0:
            self.stale_from = iteration
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight = self._arrived(self._waited(inflight))
        if self.wire is not None:  # what a resumed run knows here
            self.wire.forget()
        return inflight


class _Inflight(NamedTuple):
    """A double-buffered step's sums in flight: the reduction's handle,
    the statistics' groups, the flat buffers summed, and in float16 the
    gradients sent (kept to send them again) and the wire's send record
    (its scales once settled)."""
    reduction: object
    groups: list
    flat: FlatBuckets
    grads: list | None
    wire: object
