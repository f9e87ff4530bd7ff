"""Each of ChainerMN's communication functions among 3 ranks, forward and
backward: every rank computes ``loss_r = sum(y * g)`` over its outputs y
(fixed upstream weights g; an output left out gets no gradient, which
must travel as zeros), backpropagates, and

* checks the gradients numerically *across the ranks*: the whole job's
  loss ``sum_r loss_r`` moved along a random direction of every rank's
  inputs at once (central differences, every rank in step) against
  ``sum_r <grad_r, direction_r>``;
* saves its inputs, weights, outputs and gradients to OUT/rank{r}.pkl,
  which the test compares with one process computing the same graph.

    python collectives.py OUT
"""
import pickle
import sys
import zlib

import chainer
import chainer.functions as F
import chainermn
import chainermn.functions as mnf
import numpy as np

chainer.disable_experimental_feature_warning = True
out = sys.argv[1]
comm = chainermn.create_communicator('naive')
assert comm.size == 3
r = comm.rank
dtype = chainer.get_dtype()


def data(*key, shape):
    seed = zlib.crc32(repr(key).encode())
    return np.random.RandomState(seed).normal(size=shape).astype(dtype)


def chain(xs):
    """0 -> 1 -> 2 through send and recv (with a delegate variable), and a
    tuple 0 -> 2 with a tag of its own whose second array is unused."""
    if r == 0:
        a, = xs
        phi = mnf.send(a * 2, comm, rank=1)
        psi = mnf.send((a, a * a), comm, rank=2, tag=5)
        return [], mnf.pseudo_connect(phi, psi)[0]  # one delegate
    if r == 1:
        b, = xs
        h = mnf.recv(comm, rank=0)
        return [], mnf.send(h * b, comm, rank=2)
    c, = xs
    first, second = mnf.recv(comm, rank=0, tag=5, force_tuple=True)
    z = mnf.recv(comm, rank=1)
    return [z * c, first + 0], None  # `second` unused: no gradient


def gather(xs):
    ys = mnf.gather(comm, xs[0], root=2)
    if r != 2:
        return [], ys  # a delegate variable
    return list(ys[1:]), None  # the root leaves rank 0's out


# case: (this rank's input shapes, forward(xs) -> (outputs with values to
# weigh, the delegate variable to start the backward pass from, or None))
CASES = {
    'chain': ([(2, 3)], chain),
    'bcast': ([(4,)], lambda xs: ([mnf.bcast(comm, xs[0], root=1)], None)),
    'gather': ([(r + 1, 2)], gather),
    'scatter': ([(p + 2,) for p in range(3)] if r == 0 else [],
                lambda xs: ([mnf.scatter(comm, xs if r == 0 else None,
                                         root=0)], None)),
    'allgather': ([(r + 1, 3)],
                  lambda xs: (list(mnf.allgather(comm, xs[0])), None)),
    'alltoall': ([(r + 1, q + 1) for q in range(3)],
                 lambda xs: (list(mnf.alltoall(comm, xs)), None)),
}


def run(case, xs):
    """This rank's input variables, outputs, loss and weights."""
    variables = [chainer.Variable(x) for x in xs]
    outputs, delegate = CASES[case][1](variables)
    weights = [data(case, 'g', r, i, shape=y.shape)
               for i, y in enumerate(outputs)]
    loss = F.sum(F.stack([F.sum(y * g) for y, g in zip(outputs, weights)])) \
        if outputs else delegate
    return variables, outputs, loss, weights


saved = {}
for case, (shapes, _) in CASES.items():
    xs = [data(case, 'x', r, i, shape=s) for i, s in enumerate(shapes)]
    variables, outputs, loss, weights = run(case, xs)
    loss.backward()
    grads = [v.grad for v in variables]
    saved[case] = {'x': xs, 'g': weights, 'gx': grads,
                   'y': [np.array(y.array) for y in outputs]}
    # The gradients numerically, the whole job in step.
    direction = [data(case, 'd', r, i, shape=x.shape)
                 for i, x in enumerate(xs)]
    eps = 1e-6
    total = []
    for sign in (1, -1):
        moved = [x + sign * eps * d for x, d in zip(xs, direction)]
        with chainer.no_backprop_mode():
            _, _, moved_loss, _ = run(case, moved)
        local = float(moved_loss.array.sum())  # a delegate: 0
        total.append(comm.allreduce_obj(local))
    numeric = (total[0] - total[1]) / (2 * eps)
    analytic = comm.allreduce_obj(float(sum(
        (g * d).sum() for g, d in zip(grads, direction) if g is not None)))
    assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), \
        (case, numeric, analytic)
    saved[case]['check'] = (numeric, analytic)

with open(f'{out}/rank{r}.pkl', 'wb') as f:
    pickle.dump(saved, f)
print(f'rank {r}: every function checked', flush=True)
