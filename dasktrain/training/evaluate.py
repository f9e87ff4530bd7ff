"""Test-set evaluation: a rank's share of the test images, seen through
test-time views, and the mean loss and accuracy of a model on them.

Owns evaluation; may not touch training (the model is evaluated as it is,
in Chainer's test mode, without gradients).
"""
import chainer
import chainer.functions as F
import numpy as np

from dasktrain.data.loader import shard_bounds
from dasktrain.parallel.devices import input_dtype


def load_test_share(data, n_test, views, rank=0, size=1):
    """Rank ``rank``'s contiguous share of the first ``n_test`` test
    inputs of ``data`` (a :class:`~dasktrain.data.datasets.Dataset`), read
    into memory: (``views`` test-time views of them, their labels)."""
    lo, hi = shard_bounds(n_test, size)[rank]
    labels = data.test_labels[lo:hi].compute(scheduler='threads')
    return ([v.compute(scheduler='threads')
             for v in data.test_views(lo, hi, views)], labels)


def evaluate(evaluators, views, labels, batch_size):
    """Mean loss and accuracy on the test set; with several views, softmax
    probabilities are averaged over them first. ``evaluators``: (link,
    device) pairs (:meth:`GPUDistributedGradient.evaluators`); batches go
    to them in turn and are read back once all are queued, so every
    device computes at once.

    Examples
    --------
    >>> loss, accuracy = evaluate(model.evaluators(), views, labels,
    ...                           100)  # doctest: +SKIP
    """
    if not isinstance(evaluators[0][0], chainer.links.Classifier):
        if len(views) > 1:
            raise ValueError('test-time views (tta) need a classifier\'s '
                             'scores: a model computing its own loss '
                             'takes tta 1')
        return _own_loss(evaluators, views[0], labels, batch_size)
    logs = []  # each view's log-probabilities
    for view in views:
        parts = []
        for n, i in enumerate(range(0, len(labels), batch_size)):
            chain, device = evaluators[n % len(evaluators)]
            x = view[i:i + batch_size]
            if x.dtype.kind == 'f':
                x = x.astype(input_dtype(chain), copy=False)
            x = device.send(x)
            with chainer.using_config('train', False), \
                    chainer.no_backprop_mode(), chainer.using_device(device):
                parts.append(F.log_softmax(chain.predictor(x)).array)
        logs.append(np.concatenate(
            [chainer.backends.cuda.to_cpu(p) for p in parts]))
    # The mean probability over views, in log space: exact where a
    # probability underflows (the cross-entropy Chainer's loss gives).
    logs = np.stack(logs).astype(np.float64)
    top = logs.max(axis=0)
    mean = top + np.log(np.exp(logs - top).mean(axis=0))
    picked = mean[np.arange(len(labels)), labels]
    return float(-picked.mean()), float((mean.argmax(axis=1) ==
                                         labels).mean())


def _own_loss(evaluators, x, labels, batch_size):
    """Mean loss and accuracy of models computing their own loss: what
    each returns and reports (``accuracy``; NaN if it reports none) for
    every batch, weighted by the batch's images."""
    totals, count = np.zeros(2), 0
    for n, i in enumerate(range(0, len(labels), batch_size)):
        chain, device = evaluators[n % len(evaluators)]
        xb, tb = (device.send(a[i:i + batch_size]) for a in (
            x.astype(input_dtype(chain), copy=False)
            if x.dtype.kind == 'f' else x, labels))
        reporter, seen = chainer.Reporter(), {}
        reporter.add_observer('m', chain)
        reporter.add_observers('m', chain.namedlinks(True))
        with chainer.using_config('train', False), \
                chainer.no_backprop_mode(), chainer.using_device(device), \
                reporter.scope(seen):
            loss = chain(xb, tb)
        accuracy = seen.get('m/accuracy', np.nan)
        values = [chainer.backends.cuda.to_cpu(getattr(v, 'array', v))
                  for v in (loss, accuracy)]
        totals += np.array([float(v) for v in values]) * len(tb)
        count += len(tb)
    loss, accuracy = totals / max(count, 1)
    return float(loss), float(accuracy)
