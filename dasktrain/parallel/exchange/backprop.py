"""Chainer's backward pass, reporting each parameter's gradient as soon as
it is final.

Chainer 7 keeps every parameter's gradient in its table until the whole
graph is back-propagated; an all-reduce that should start while the earlier
layers are still being differentiated
(:mod:`dasktrain.parallel.exchange.gradients`) needs them earlier.
:func:`backward_reporting` is Chainer 7.8.1's own backward code for a scalar
loss with that one change, so the gradients are the same bits as
``loss.backward()``'s.
"""
import heapq

import chainer
from chainer import _backprop_utils


def backward_reporting(loss, ready, loss_scale=None):
    """``loss.backward(loss_scale=loss_scale)`` for a scalar ``loss`` that
    calls ``ready(param)`` as soon as each parameter's gradient is final,
    not all at the end.

    Chainer 7's ``Variable.backward`` keeps every leaf's gradient in its
    table until the whole graph is done. This is its code path for a scalar
    loss (no ``retain_grad``, no double backprop; Chainer 7.8.1's
    ``variable.py`` and ``_backprop.py``) with one change: a leaf whose
    last consuming function has run gets its gradient at once. The
    arithmetic is Chainer's own, in its order: the gradients are the same
    bits. Leaves whose consumers were never reached (no gradient flowed
    there) are finished at the end, as Chainer finishes them. With
    ``loss_scale``, as Chainer: the initial gradient is that many ones,
    and every leaf reached is marked with it (``_loss_scale``), which its
    update rule divides by.
    """
    if loss._has_chainerx_array or loss.array.size != 1:
        # not the path this mirrors: no early reports
        loss.backward(loss_scale=loss_scale)
        return
    if loss.grad_var is None:
        with chainer.using_device(loss.device):
            loss.grad = loss.device.xp.ones_like(loss.array)
        if loss_scale is not None:
            loss.grad *= loss_scale
    node, grad_var = loss.node, loss.grad_var
    loss.grad_var = None
    with chainer.using_config('enable_backprop', False):
        _backprop_reporting(node, grad_var, ready, loss_scale)


def _consumers(root):
    """Leaf node -> how many function nodes reachable from ``root`` take it
    as an input that requires a gradient."""
    counts, seen, stack = {}, set(), [root] if root is not None else []
    while stack:
        func = stack.pop()
        if func in seen:
            continue
        seen.add(func)
        for x in set(func.inputs):
            if not x.requires_grad:
                continue
            if x.creator_node is None:
                counts[x] = counts.get(x, 0) + 1
            else:
                stack.append(x.creator_node)
    return counts


def _backprop_reporting(y, gy, ready, loss_scale):
    # Chainer 7.8.1 _backprop._backprop_to_all(outputs=[(y, gy)],
    # retain_grad=False, loss_scale), plus the early leaves.
    cand_funcs, seen_set = [], set()

    def add_cand(cand):
        if cand not in seen_set:
            heapq.heappush(cand_funcs, (-cand.rank, len(seen_set), cand))
            seen_set.add(cand)

    grads = _backprop_utils.GradTable(accumulate_grad_inputs=True)
    # A dict, not Chainer's set: the reports come in an order that is the
    # same in every process (a set of nodes iterates by their addresses).
    leaf_nodes = {}
    grads.accumulate(y, gy)
    if y.creator_node is None:
        leaf_nodes[y] = None
    else:
        add_cand(y.creator_node)
    waiting = _consumers(y.creator_node)

    def finish(x):
        x_var = x.get_variable_or_none()
        gx = grads.pop(x)
        if x_var is not None:
            x_var._set_grad_var_without_check(gx)
            x_var._loss_scale = loss_scale
            ready(x_var)

    is_debug = chainer.is_debug()
    base_hooks = chainer.get_function_hooks().values()
    while cand_funcs:
        _, _, func = heapq.heappop(cand_funcs)
        inputs = func.inputs
        target_input_indexes = tuple(
            i for i, x in enumerate(inputs) if x.requires_grad)
        outputs = [o() for o in func.outputs]
        out_grad = tuple(grads.pop(o) if o is not None and
                         o.creator_node is not None else None
                         for o in outputs)
        if not target_input_indexes:
            continue
        in_data = [x.data for x in inputs]
        out_grad_array = [None if g is None else g.raw_array
                          for g in out_grad]
        if func._n_local_function_hooks != 0:
            local_hooks = dict(chainer.get_function_hooks())
            local_hooks.update(func.local_function_hooks)
            hooks = local_hooks.values()
        else:
            hooks = base_hooks
        with chainer.using_device(chainer.backend.get_device_from_array(
                *(in_data + out_grad_array))):
            for hook in hooks:
                hook.backward_preprocess(func, tuple(in_data),
                                         tuple(out_grad_array))
            in_grad = {}
            for i in target_input_indexes:
                x = inputs[i]
                if x not in in_grad:
                    in_grad[x] = grads.get_as_list(x)
            _backprop_utils.backprop_step(func, target_input_indexes,
                                          out_grad, in_grad, is_debug)
            for hook in hooks:
                hook.backward_postprocess(func, tuple(in_data),
                                          tuple(out_grad_array))
        del out_grad
        for x, gx in in_grad.items():
            if not gx:
                continue
            for gx_elem in gx:
                if gx_elem is not None:
                    chainer.variable._check_grad_type(func, x, True,
                                                      gx_elem.raw_array)
            if x.creator_node is None:
                leaf_nodes[x] = None
            else:
                add_cand(x.creator_node)
        del in_grad
        for x in dict.fromkeys(inputs):  # its leaves, in input order
            if x in waiting:
                waiting[x] -= 1
                if waiting[x] == 0 and x in leaf_nodes:
                    del leaf_nodes[x]
                    finish(x)
    for x in leaf_nodes:
        finish(x)
    grads.assert_no_grads()
