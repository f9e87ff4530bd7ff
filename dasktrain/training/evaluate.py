"""Test-set evaluation: a rank's share of the test images, seen through
test-time views, and the mean loss and accuracy of a model on them.

Owns evaluation; may not touch training (the model is evaluated as it is,
in Chainer's test mode, without gradients).
"""
import chainer
import chainer.functions as F
import numpy as np

from dasktrain.data.augment import tta_views
from dasktrain.data.loader import shard_bounds
from dasktrain.parallel.devices import input_dtype


def load_test_share(cifar, n_test, views, rank=0, size=1):
    """Rank ``rank``'s contiguous share of the first ``n_test`` test
    images of ``cifar`` (a :class:`~dasktrain.data.cifar.CIFAR10`), read
    into memory: (``views`` test-time views of them, their labels)."""
    lo, hi = shard_bounds(n_test, size)[rank]
    labels = cifar.test_labels[lo:hi].compute(scheduler='threads')
    return ([v.compute(scheduler='threads')
             for v in tta_views(cifar.test_images[lo:hi], views)], labels)


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
    probs = 0
    for view in views:
        parts = []
        for n, i in enumerate(range(0, len(labels), batch_size)):
            chain, device = evaluators[n % len(evaluators)]
            x = device.send(view[i:i + batch_size].astype(
                input_dtype(chain), copy=False))
            with chainer.using_config('train', False), \
                    chainer.no_backprop_mode(), chainer.using_device(device):
                parts.append(F.softmax(chain.predictor(x)).array)
        probs = probs + np.concatenate(
            [chainer.backends.cuda.to_cpu(p) for p in parts])
    probs = probs / len(views)
    picked = probs[np.arange(len(labels)), labels]
    loss = float(-np.log(np.maximum(picked, 1e-12)).mean())
    return loss, float((probs.argmax(axis=1) == labels).mean())
