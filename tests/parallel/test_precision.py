"""Chainer's mixed16 through the wrapper: dynamic loss scaling with dg's
merge and exchange (float16 on the wire too) and with ipm's mixes, the
float32 masters, against Chainer's own optimizer on one device."""
import sys

import chainer
import cloudpickle
import numpy as np
import pytest
from test_parallel import Mirror

from dasktrain.parallel import GPUDistributedGradient, precision
from dasktrain.parallel.comm import DaskComm
from dasktrain.training.models import get_model

cloudpickle.register_pickle_by_value(sys.modules[__name__])

mixed16 = chainer.using_config('dtype', chainer.mixed16)


def batch(n, seed=0, scale=1.0):
    rng = np.random.RandomState(seed)
    return ((rng.randn(n, 3, 32, 32) * scale).astype(np.float16),
            rng.randint(0, 10, n).astype(np.int32))


def optimizer(kind='adam'):
    o = chainer.optimizers.Adam(alpha=1e-3) if kind == 'adam' else \
        chainer.optimizers.MomentumSGD(lr=0.05)
    o.loss_scaling()
    o.use_fp32_update()
    return o


def model(name='tiny'):
    with mixed16:
        np.random.seed(0)
        return get_model(name)


def chainer_s_own(batches, name='tiny', kind='adam'):
    """Chainer's mixed16 on one device: ``optimizer.update(lossfun)``
    back-propagates at the optimizer's loss scale."""
    link = model(name)
    o = optimizer(kind)
    o.setup(link)
    with mixed16:
        for x, t in batches:
            o.update(link, x, t)
    return link, o


def arrays(link):
    return {n: p.array.copy() for n, p in sorted(link.namedparams())}


def test_two_ranks_sum_float16_gradients_as_chainer_s_own_update():
    # Two ranks sending the same gradients (Mirror), each half of the
    # job's batch: float16 gradients at a loss scale doubling each step,
    # halved by their share, summed. The float16 wire (its own powers of
    # two, a gradient already float16; in buckets during the backward
    # pass too) sums them to the very bits the plain sums give; both are
    # Chainer's own update on one device but for float16's subnormals,
    # which halving a share rounds (a loss scale divided wrongly would
    # be off by its factor).
    batches = [batch(4, seed) for seed in range(4)]
    link, own = chainer_s_own(batches, kind='momentum')
    start = arrays(model())
    runs = []
    for options in ({}, {'comm_dtype': 'float16'},
                    {'comm_dtype': 'float16', 'bucket_mb': 1e-3}):
        wrapped = GPUDistributedGradient(model(), ['@numpy'], comm=Mirror(),
                                         **options)
        wrapped.setup(optimizer('momentum'))
        with mixed16, np.errstate(over='ignore'):  # Mirror's first sums
            for x, t in batches:
                wrapped.step(x, t, total=8)
        assert wrapped.optimizer._loss_scale == own._loss_scale == 16.0
        assert wrapped.exchange.early == (6 if 'bucket_mb' in options
                                          else 0)
        runs.append({n: precision.value(p).copy()
                     for n, p in sorted(wrapped.master.namedparams())})
    for run in runs[1:]:
        for name, value in run.items():
            np.testing.assert_array_equal(value, runs[0][name], name)
    theirs = {n: precision.value(p)
              for n, p in sorted(link.namedparams())}
    for name, value in runs[0].items():
        assert value.dtype == np.float32  # the masters
        moved = np.abs(theirs[name] - start[name]).max()
        assert moved > 0.05, name
        np.testing.assert_allclose(value, theirs[name], rtol=0,
                                   atol=0.01 * moved, err_msg=name)


@pytest.mark.equivalence
def test_two_replicas_train_as_one_device_on_the_whole_batch(name='tiny'):
    # Each replica on half the batch, their float16 gradients (scaled by
    # the master's loss scale) summed into the master's, which its update
    # divides back: one device's update but for float16's rounding of the
    # other order of the sums.
    batches = [batch(8, seed) for seed in range(4)]
    wrapped = GPUDistributedGradient(model(name), ['@numpy'] * 2)
    wrapped.setup(optimizer('momentum'))
    with mixed16:
        for x, t in batches:
            wrapped.step(x, t)
    link, own = chainer_s_own(batches, name, 'momentum')
    assert wrapped.optimizer._loss_scale == own._loss_scale
    mine, theirs = arrays(wrapped.master), arrays(link)
    moved = 0.0
    for key in theirs:
        start = arrays(model(name))[key]
        moved = max(moved, float(np.abs(theirs[key] - start).max()))
        # float16: 2**-11 relative per rounding, a few steps of them
        np.testing.assert_allclose(mine[key].astype(np.float32),
                                   theirs[key].astype(np.float32),
                                   rtol=1e-2, atol=2e-3, err_msg=key)
    assert moved > 2e-3  # the updates are larger than the tolerance
    for replica in wrapped.replicas[1:]:  # they follow the master
        for key, value in arrays(replica).items():
            np.testing.assert_array_equal(value, mine[key], key)


def test_an_overflowed_step_is_skipped_and_the_scale_halved():
    # Inputs so large that the scaled float16 gradients overflow: Chainer
    # skips the update and halves the scale; so does every replica here,
    # summed gradient and all, also when it travels in float16.
    big = [batch(4, 0, scale=3e4)]
    for options in ({}, {'comm_dtype': 'float16'}):
        wrapped = GPUDistributedGradient(model(), ['@numpy'] * 2,
                                         comm=Mirror(), **options)
        o = optimizer('momentum')
        wrapped.setup(o)
        o._loss_scale = 2.0 ** 14
        before = arrays(wrapped.master)
        with mixed16:
            wrapped.step(*big[0], total=8)
        assert o._loss_scale == 2.0 ** 13, options
        for key, value in arrays(wrapped.master).items():
            np.testing.assert_array_equal(value, before[key], key)


def test_ipm_mixes_the_float32_masters_not_their_roundings():
    # Each replica updates a float32 master and keeps its float16
    # rounding; a mix must average the masters (else the next update
    # starts from the unmixed master and undoes it) and round them.
    wrapped = GPUDistributedGradient(model(), ['@numpy'] * 3, mode='ipm',
                                     mix_every=2)
    wrapped.setup(optimizer())
    with mixed16:
        for seed in range(2):
            wrapped.step(*batch(9, seed))
    masters = [{n: precision.master(p).array for n, p in
                sorted(r.namedparams())} for r in wrapped.replicas]
    assert masters[0] and all(m.dtype == np.float32
                              for m in masters[0].values())
    for replica, own in zip(wrapped.replicas, masters):
        for name, p in sorted(replica.namedparams()):
            np.testing.assert_array_equal(own[name], masters[0][name])
            np.testing.assert_array_equal(
                p.array, own[name].astype(np.float16), name)
    assert wrapped.drift > 0  # they had moved apart before the mix


def test_a_checkpoint_holds_the_loss_scale_and_the_masters(tmp_path):
    # Chainer's Optimizer.serialize keeps neither: a resumed run would
    # start its masters from their float16 roundings and its loss scale
    # from 1.
    from dasktrain.training.checkpoint import (
        load_checkpoint,
        save_checkpoint,
    )
    wrapped = GPUDistributedGradient(model(), ['@numpy'])
    wrapped.setup(optimizer())
    with mixed16:
        for seed in range(3):
            wrapped.step(*batch(4, seed))
    save_checkpoint(tmp_path / 'c.npz', wrapped, {'epoch': 1})
    with np.load(tmp_path / 'c.npz', allow_pickle=False) as saved:
        assert float(saved['model/precision0/loss_scale']) == 8.0
        fp32 = [k for k in saved.files if k.endswith('/fp32')]
        assert len(fp32) == 6 and {saved[k].dtype for k in fp32} == \
            {np.dtype(np.float32)}
    again = GPUDistributedGradient(model(), ['@numpy'])
    again.setup(optimizer())
    assert load_checkpoint(tmp_path / 'c.npz', again) == {'epoch': 1}
    assert again.optimizer._loss_scale == 8.0
    theirs = dict(again.master.namedparams())
    for name, p in sorted(wrapped.master.namedparams()):
        np.testing.assert_array_equal(precision.master(theirs[name]).array,
                                      precision.master(p).array, name)
        np.testing.assert_array_equal(theirs[name].array, p.array, name)


def _lopsided(name, rank, size):
    """Rank 1 has no image in the second step, when the loss scale has
    doubled since its first: it must still divide the job's summed
    gradient by the second step's scale."""
    with DaskComm.rendezvous(name, rank, size, timeout=30) as comm:
        with mixed16:
            np.random.seed(0)
            wrapped = GPUDistributedGradient(get_model('tiny'), ['@numpy'],
                                             comm=comm)
            wrapped.setup(optimizer('momentum'))
            for seed, n in enumerate([2, 1, 2]):
                x, t = batch(2, seed)
                mine = slice(0, 1) if rank == 0 or n == 2 else slice(0, 0)
                if rank == 1 and n == 2:
                    mine = slice(1, 2)
                wrapped.step(x[mine], t[mine], total=n)
        return arrays(wrapped.master), wrapped.optimizer._loss_scale


@pytest.mark.processes
def test_a_rank_without_images_divides_by_the_step_s_scale(dask_client):
    workers = sorted(dask_client.scheduler_info()['workers'])
    (a, scale_a), (b, scale_b) = dask_client.gather([
        dask_client.submit(_lopsided, 'lopsided', r, 2, workers=[w],
                           pure=False) for r, w in enumerate(workers)])
    assert scale_a == scale_b == 8.0
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], key)
    # and the job is one device on the same batches
    link, _ = chainer_s_own([batch(2, 0), tuple(v[:1] for v in batch(2, 1)),
                             batch(2, 2)], kind='momentum')
    for key, value in arrays(link).items():
        np.testing.assert_allclose(a[key].astype(np.float32),
                                   value.astype(np.float32), rtol=1e-2,
                                   atol=1e-3, err_msg=key)
