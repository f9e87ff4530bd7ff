"""``DistributedUpdater``: Chainer's ``StandardUpdater`` on several
devices, so that an existing ``Trainer`` script trains on N GPUs (or CPU
replicas) by changing its updater line only.

Owns the updater; the replicas, the exchange and the update are
:class:`~dasktrain.parallel.GPUDistributedGradient`'s. May not touch the
Trainer's extensions: they see the model and the observations as a
``StandardUpdater`` leaves them.
"""
import chainer
import numpy as np
from chainer.dataset import convert
from chainer.training.updaters import StandardUpdater

from dasktrain.config import parse_devices
from dasktrain.parallel import GPUDistributedGradient, precision


class DistributedUpdater(StandardUpdater):
    """A ``StandardUpdater`` whose model trains as replicas on ``devices``.

    Algorithm: each iteration takes one batch from the iterator and
    converts it on the host; the batch is split into near-equal parts,
    the larger first, one per device. Each replica computes its loss on
    its part. In ``'dg'`` mode the replicas' gradients, weighted by their
    parts' sizes, are summed into the master (the model the optimizer was
    set up on), the optimizer updates it and the replicas copy it: the
    same update as one device on the whole batch. In ``'ipm'`` mode every
    replica has its own copy of the optimizer and the replicas' parameters
    are averaged every ``mix_every`` iterations (or at each epoch's end).

    What each replica reports (``L.Classifier``'s ``loss`` and
    ``accuracy``, or anything a model reports) reaches the Trainer as the
    batch-weighted mean under the master's name (``main/loss``, ...), as
    if one device had seen the whole batch. ``Evaluator`` and ``snapshot``
    see the master; a snapshot also holds the other replicas and their
    optimizers in ``ipm`` mode, and resuming from it continues the run.
    What an extension sets on the Trainer's optimizer's hyperparameters
    (``ExponentialShift``, ChainerUI's ``adjust_hyperparams``) holds for
    every replica's optimizer from the next update on.

    Chainer's type checks run for the first batch of each shape only
    (``type_check='always'``: every batch). Mixed precision is Chainer's:
    a script under ``chainer.config.dtype = chainer.mixed16`` whose
    optimizer has ``loss_scaling()`` (and ``use_fp32_update()``) gets its
    dynamic loss scaling on every replica, and its snapshots keep the
    scale and the float32 masters. ``dasktrain.computing(tf32=True,
    cudnn='off', gpus=[0, 1])`` around ``trainer.run()`` computes as
    ``dasktrain train --tf32 --cudnn off`` does.

    Parameters
    ----------
    iterator : chainer.dataset.Iterator
        The training batches (whole batches: they are split here).
    optimizer : chainer.Optimizer
        Set up on the model, as for ``StandardUpdater``.
    devices : str or sequence, default 'cpu:2'
        ``'cpu:N'``, GPU ids ``'0,1'``, or Chainer device specifiers.
    mode : {'dg', 'ipm'}, default 'dg'
    mix_every : int or 'epoch', optional
        ipm: iterations between mixes (default: only at the end).
    converter : callable, default ``concat_examples``
        Turns a batch into ``(x, t)`` on the host.
    **kwargs
        More :class:`~dasktrain.parallel.GPUDistributedGradient` options
        (``comm_dtype``, ``bucket_mb``, ...).

    Examples
    --------
    >>> model = L.Classifier(MLP())  # doctest: +SKIP
    >>> optimizer = chainer.optimizers.Adam()  # doctest: +SKIP
    >>> optimizer.setup(model)  # doctest: +SKIP
    >>> updater = DistributedUpdater(train_iter, optimizer,
    ...                              devices='0,1')  # doctest: +SKIP
    >>> trainer = training.Trainer(updater, (20, 'epoch'))  # doctest: +SKIP
    """

    def __init__(self, iterator, optimizer, devices='cpu:2', mode='dg',
                 mix_every=None, converter=convert.concat_examples,
                 **kwargs):
        model = getattr(optimizer, 'target', None)
        if model is None:
            raise ValueError('optimizer must be set up on the model first '
                             '(optimizer.setup(model)), as for '
                             'StandardUpdater')
        if isinstance(devices, str):
            devices = parse_devices(devices)
        self.model = GPUDistributedGradient(model, list(devices), mode=mode,
                                            mix_every=mix_every, **kwargs)
        self.model.setup(optimizer)
        super().__init__(iterator, optimizer, converter=converter)
        for other in self.model.optimizers[1:]:  # ipm's, as the master's
            other.use_auto_new_epoch = optimizer.use_auto_new_epoch

    def update_core(self):
        iterator = self._iterators['main']
        batch = iterator.next()
        arrays = convert._call_converter(self.converter, batch, None)
        if not (isinstance(arrays, tuple) and len(arrays) == 2):
            got = len(arrays) if isinstance(arrays, tuple) else 1
            raise ValueError('DistributedUpdater needs batches the '
                             'converter turns into (x, t); got '
                             f'{got} array(s)')
        x, t = arrays
        self._share_hyperparameters()
        self.model.step(x, t, observe=False)
        # what each replica reported, as 'r{i}/key'
        chainer.reporter.report(self._means(self.model.group.reported,
                                            len(x)), self.model.master)
        if iterator.is_new_epoch:
            self.model.end_epoch()  # ipm mixes at 'epoch'
            if self.auto_new_epoch:
                for optimizer in self.model.optimizers:
                    optimizer.new_epoch(auto=True)

    def _share_hyperparameters(self):
        """The master optimizer's hyperparameters, on every replica's own
        optimizer (ipm): what an extension changed on the Trainer's
        optimizer (ChainerUI's adjust_hyperparams, a learning-rate
        schedule) holds for every replica from this update on."""
        master = self.model.optimizers[0].hyperparam.get_dict()
        for other in self.model.optimizers[1:]:
            for name, value in master.items():
                if getattr(other.hyperparam, name) != value:
                    setattr(other.hyperparam, name, value)

    def _means(self, values, n):
        """Each key the replicas reported, weighted by their parts. Where
        a key's values all lie on one GPU, the mean is computed there and
        reported as a GPU scalar: Chainer's summaries add it up on the GPU
        and read it when the log is written, so a step never waits for
        the GPU to report (a read per key and replica would). Host values,
        and values spread over several GPUs, are summed as floats."""
        sizes = [len(p) for p in np.array_split(np.empty(n),
                                                len(self.model))]
        terms, weights = {}, {}
        for name, value in values.items():
            replica, _, key = name.partition('/')
            size = sizes[int(replica[1:])]
            if isinstance(value, chainer.Variable):
                value = value.array
            terms.setdefault(key, []).append((size, value))
            weights[key] = weights.get(key, 0) + size
        means = {}
        for key, pairs in terms.items():
            where = {_gpu_of(value) for _, value in pairs}
            if len(where) == 1 and None not in where:
                # on that GPU, whichever is current (a kernel on another
                # would read across devices)
                with chainer.backends.cuda.Device(where.pop()):
                    total = sum(size * value for size, value in pairs)
                    means[key] = total / weights[key]
            else:
                total = sum(size * float(chainer.backends.cuda.to_cpu(v))
                            for size, v in pairs)
                means[key] = total / weights[key]
        return means

    def serialize(self, serializer):
        """The master and its optimizer as ``StandardUpdater`` saves them;
        in ipm mode every other replica and its optimizer too; with loss
        scaling or float32 updates (mixed16), each optimizer's scale and
        masters. Loaded, the replicas start from what was saved (dg: the
        master's copy)."""
        super().serialize(serializer)
        # ipm mixes every mix_every of the wrapper's own iterations
        self.model.iteration = serializer('replica_iteration',
                                          self.model.iteration)
        # mixed precision: the loss scale and float32 masters, which
        # Chainer's own Optimizer.serialize leaves out
        for i, optimizer in enumerate(self.model.optimizers):
            if precision.scaled(optimizer):
                precision.serialize(optimizer,
                                    serializer[f'precision:replica:{i}'])
        if self.model.mode == 'ipm':
            for i in range(1, len(self.model)):
                self.model.replicas[i].serialize(serializer[f'replica:{i}'])
                self.model.optimizers[i].serialize(
                    serializer[f'optimizer:replica:{i}'])
        elif isinstance(serializer, chainer.serializer.Deserializer):
            self.model.syncparams()


def _gpu_of(value):
    """The GPU id a reported value lies on, None on the host."""
    device = getattr(value, 'device', None)
    return getattr(device, 'id', None) if not isinstance(
        value, (np.ndarray, np.generic, float, int)) else None
