"""Mixed precision beside Chainer's optimizer: the loss scale a step
back-propagates with, and the float32 master weights of float16
parameters, as the replicas and the checkpoints must see them.

Chainer 7.8.1's mixed16 recipe is the optimizer's
(``chainer/optimizer.py``): with ``optimizer.loss_scaling()`` the loss is
back-propagated times the optimizer's ``_loss_scale``
(``loss.backward(loss_scale=...)`` marks every parameter it reaches with
that factor, ``Variable._loss_scale``), every update rule divides its
parameter's gradient by that mark before updating, and
``optimizer.update()`` first checks every gradient for inf and NaN:
where it finds one the step is skipped and the scale halved, else the
scale grows (doubling until the first overflow, then by
``2 ** (1 / interval)`` a step). With ``use_fp32_update()`` each float16
parameter's update rule keeps a float32 master copy
(``UpdateRule._fp32_param``), updates it and writes its rounding back to
the parameter. ChainerMN's multi-node optimizer reads ``_loss_scale`` the
same way (it has no public name in Chainer 7.8.1).

What the wrapper adds, each a function here:

* every replica's parameters are marked with the scale of the step
  (:func:`stamp`), also those no gradient reached this step (a replica
  without images: its gradient comes from the other ranks, summed at the
  same scale), so every rank divides the same summed gradient by the same
  factor;
* a parameter's *value* is its float32 master where it has one
  (:func:`value`): ipm's mixes and the job's means average the masters,
  not their float16 roundings, and write them back with the roundings
  (:func:`masters`), or the next update would undo the mix;
* a checkpoint holds the loss scale and the masters (:func:`serialize`),
  which Chainer's own ``Optimizer.serialize`` leaves out, so that a
  resumed run goes on bit for bit.

Owns these; may not touch the update itself (Chainer's) or decide when a
replica updates (:mod:`~dasktrain.parallel.gradient`).
"""
import chainer


def loss_scale(optimizer):
    """The factor the next backward pass scales the loss by: the
    optimizer's current loss scale (``optimizer.loss_scaling()``), None
    without loss scaling or without an optimizer.

    >>> opt = chainer.optimizers.SGD()
    >>> loss_scale(opt) is None
    True
    >>> opt.loss_scaling(); loss_scale(opt)
    1.0
    """
    return getattr(optimizer, '_loss_scale', None)


def scaled(optimizer):
    """Whether ``optimizer`` scales its loss or keeps float32 masters:
    whether a checkpoint must hold :func:`serialize`'s entries."""
    return loss_scale(optimizer) is not None or \
        getattr(optimizer, '_use_fp32_update', False)


def stamp(link, scale):
    """Mark every parameter of ``link`` as holding a gradient scaled by
    ``scale`` (what ``loss.backward(loss_scale=scale)`` marks the
    parameters it reaches with), so its update rule divides by it."""
    for param in link.params():
        param._loss_scale = scale


def master(param):
    """``param``'s float32 master (a ``chainer.Parameter``) where its
    update rule keeps one (``use_fp32_update()``, a float16 parameter,
    after its first update), else None."""
    rule = param.update_rule
    kept = getattr(rule, '_fp32_param', None) if rule is not None else None
    return kept if kept is not None and kept.array is not None else None


def value(param):
    """The array holding ``param``'s value: its float32 master where it
    has one (:func:`master`), else its own array."""
    kept = master(param)
    return param.array if kept is None else kept.array


def masters(link):
    """(parameter, its float32 master) for each parameter of ``link``
    that has one."""
    found = []
    for param in link.params():
        kept = master(param)
        if kept is not None:
            found.append((param, kept))
    return found


def forget(link):
    """Drop the float32 masters of ``link``'s parameters: its arrays are
    its values again (before they are loaded from a checkpoint); each
    update rule makes its master again from its parameter."""
    for param in link.params():
        if param.update_rule is not None:
            param.update_rule._fp32_param = None


def serialize(optimizer, serializer):
    """Save or load (Chainer's serializer protocol; a key not saved is
    not loaded, e.g. a parameter's master before its first update) what
    Chainer's ``Optimizer.serialize`` leaves out of mixed precision: the
    dynamic loss scale (its factor and whether it ever overflowed) and the
    float32 master of every parameter of the optimizer's target that has
    one, under the parameter's name. Loaded, each master is the
    checkpoint's, made on its parameter's device as Chainer makes it, or
    none (Chainer makes it again from the parameter at its next
    update)."""
    loading = isinstance(serializer, chainer.serializer.Deserializer)

    def entry(serializer, key, value):
        try:
            return serializer(key, value)
        except KeyError:  # a strict deserializer, and none saved
            return None if loading else value

    if loss_scale(optimizer) is not None:
        factor = entry(serializer, 'loss_scale', optimizer._loss_scale)
        if factor is not None:
            optimizer._loss_scale = float(factor)
        if optimizer._loss_scaling_is_dynamic:
            overflowed = entry(serializer, 'overflowed',
                               optimizer._loss_scaling_isnan_ever)
            if overflowed is not None:
                optimizer._loss_scaling_isnan_ever = bool(overflowed)
    for name, param in sorted(optimizer.target.namedparams()):
        kept = master(param)
        if not loading:
            if kept is not None:
                serializer[name]('fp32', kept.array)
            continue
        rule = param.update_rule
        if rule is None or param.array is None:
            continue
        loaded = entry(serializer[name], 'fp32', None)
        if loaded is None or not getattr(rule, '_use_fp32_update', False):
            rule._fp32_param = None
            continue
        with chainer.using_device(param.device):
            rule._fp32_param = chainer.Parameter(
                param.device.send(loaded).astype('float32', copy=False),
                name=param.name)
