import re
import time

import chainer
import numpy as np
import pytest

from dasktrain.parallel import DeviceError, GPUDistributedGradient
from dasktrain.parallel.comm import Communicator
from dasktrain.parallel.cuda_check import (
    check_gpus_usable,
    cuda_unavailable_reason,
    gpu_count,
    unusable_gpus_here,
)
from dasktrain.parallel.gpus import GpusUnusable
from dasktrain.training.models import get_model


def batch(n, seed=0):
    """Inputs in Chainer's dtype (float64 under the ``float64`` fixture)."""
    rng = np.random.RandomState(seed)
    return (rng.randn(n, 3, 32, 32).astype(chainer.get_dtype()),
            rng.randint(0, 10, n).astype(np.int32))


def params(link):
    return {name: p.array.copy() for name, p in sorted(link.namedparams())}


def persistents(link):
    return {f'{path}/{name}': np.array(getattr(sub, name), copy=True)
            for path, sub in sorted(link.namedlinks())
            for name in sorted(sub._persistent)}


def fresh(name='tiny', seed=0):
    np.random.seed(seed)  # chainer draws initial weights from numpy
    return get_model(name)


def make_optimizer(kind):
    return {'sgd': lambda: chainer.optimizers.SGD(lr=0.1),
            'momentum': lambda: chainer.optimizers.MomentumSGD(lr=0.05),
            'adam': lambda: chainer.optimizers.Adam(alpha=0.01)}[kind]()


def single_device_run(kind, batches):
    model = fresh()
    optimizer = make_optimizer(kind)
    optimizer.setup(model)
    for x, t in batches:
        optimizer.update(model, x, t)
    return params(model)


@pytest.mark.equivalence
@pytest.mark.parametrize('kind', ['sgd', 'momentum', 'adam'])
@pytest.mark.parametrize('n_replicas,batch_size', [(2, 12), (3, 12), (3, 10)])
def test_dg_equals_one_device_on_the_whole_batch(kind, n_replicas,
                                                 batch_size, float64):
    batches = [batch(batch_size, seed) for seed in range(4)]
    model = GPUDistributedGradient(fresh(), ['@numpy'] * n_replicas)
    model.setup(make_optimizer(kind))
    for x, t in batches:
        model.step(x, t)
    expected = single_device_run(kind, batches)
    # Only the order of the sums differs (float64: ~1e-16 relative per
    # step); Adam divides by sqrt(v) and so magnifies it for the rare
    # near-zero gradient, still far below 1e-10.
    for name, value in params(model.master).items():
        assert value.dtype == np.float64
        np.testing.assert_allclose(value, expected[name], rtol=1e-10,
                                   atol=1e-12, err_msg=name)
    # and the replicas follow the master exactly
    for replica in model.replicas[1:]:
        for name, value in params(replica).items():
            assert np.array_equal(value, params(model.master)[name])


def test_seed_protocol_equals_step():
    x, t = batch(8)
    a = GPUDistributedGradient(fresh(), ['@numpy', '@numpy'])
    optimizer = chainer.optimizers.Adam()
    a.setup(optimizer)
    xs, ts = a.split(x, t)
    with a as m:
        m(xs, ts)
    optimizer.update()
    a.syncparams()
    b = GPUDistributedGradient(fresh(), ['@numpy', '@numpy'])
    b.setup(chainer.optimizers.Adam())
    b.step(x, t)
    for name, value in params(a.master).items():
        assert np.array_equal(value, params(b.master)[name])


@pytest.mark.equivalence
def test_ipm_mixing_every_iteration_with_sgd_equals_dg(float64):
    batches = [batch(12, seed) for seed in range(4)]
    dg = GPUDistributedGradient(fresh(), ['@numpy'] * 3)
    dg.setup(chainer.optimizers.SGD(lr=0.1))
    ipm = GPUDistributedGradient(fresh(), ['@numpy'] * 3, mode='ipm',
                                 mix_every=1)
    ipm.setup(chainer.optimizers.SGD(lr=0.1))
    for x, t in batches:
        dg.step(x, t)
        ipm.step(x, t)
    for name, value in params(ipm.master).items():
        np.testing.assert_allclose(value, params(dg.master)[name],
                                   rtol=1e-10, atol=1e-12, err_msg=name)


def test_a_mix_is_exactly_the_arithmetic_mean():
    model = GPUDistributedGradient(fresh('resnet20'), ['@numpy'] * 3,
                                   mode='ipm')
    model.setup(chainer.optimizers.MomentumSGD(lr=0.05))
    for seed in range(2):
        model.step(*batch(6, seed))
    before = [dict(params(r), **persistents(r)) for r in model.replicas]
    assert not np.array_equal(before[0]['/predictor/fc/W'],
                              before[1]['/predictor/fc/W'])
    model.mix()
    squared = 0.0
    for name in before[0]:
        stack = np.stack([b[name] for b in before]).astype(np.float64)
        if stack.dtype.kind != 'f' or name.endswith('/N'):
            continue
        mean = stack.mean(axis=0).astype(before[0][name].dtype)
        for replica in model.replicas:
            got = dict(params(replica), **persistents(replica))[name]
            assert np.array_equal(got, mean), name
        if name in params(model.master):
            squared += ((stack - stack.mean(axis=0)) ** 2).sum()
    assert model.drift == pytest.approx((squared / 3) ** 0.5, rel=1e-6)


def test_after_syncparams_replicas_equal_the_master_bit_for_bit():
    model = GPUDistributedGradient(fresh('resnet20'), ['@numpy'] * 2)
    model.setup(chainer.optimizers.MomentumSGD(lr=0.05))
    model.step(*batch(6))
    master = dict(params(model.master), **persistents(model.master))
    replica = dict(params(model.replicas[1]),
                   **persistents(model.replicas[1]))
    assert master.keys() == replica.keys()
    assert any('avg_mean' in k for k in master)
    for name in master:
        assert np.array_equal(master[name], replica[name]), name


def test_one_shot_mixing_only_at_the_end():
    model = GPUDistributedGradient(fresh(), ['@numpy'] * 2, mode='ipm')
    model.setup(chainer.optimizers.SGD(lr=0.1))
    for seed in range(3):
        model.step(*batch(8, seed))
    model.end_epoch()
    a, b = params(model.replicas[0]), params(model.replicas[1])
    assert not np.array_equal(a['/predictor/fc/W'], b['/predictor/fc/W'])
    snapshot = model.averaged()
    # the snapshot is the mean; the replicas are untouched by it
    assert np.array_equal(params(model.replicas[0])['/predictor/fc/W'],
                          a['/predictor/fc/W'])
    model.finalize()
    for name, value in params(snapshot).items():
        assert np.array_equal(value, params(model.master)[name])
        assert np.array_equal(value, params(model.replicas[1])[name])


def test_mix_every_epoch_and_every_k():
    per_epoch = GPUDistributedGradient(fresh(), ['@numpy'] * 2, mode='ipm',
                                       mix_every='epoch')
    per_epoch.setup(chainer.optimizers.SGD(lr=0.1))
    every2 = GPUDistributedGradient(fresh(), ['@numpy'] * 2, mode='ipm',
                                    mix_every=2)
    every2.setup(chainer.optimizers.SGD(lr=0.1))
    for model in (per_epoch, every2):
        model.step(*batch(8, 0))
    assert every2.drift is None and per_epoch.drift is None
    every2.step(*batch(8, 1))
    assert every2.drift > 0
    per_epoch.end_epoch()
    assert per_epoch.drift > 0


def test_optimizer_state_stays_per_replica_unless_mixed():
    for mix_state in (False, True):
        model = GPUDistributedGradient(fresh(), ['@numpy'] * 2, mode='ipm',
                                       mix_every=1,
                                       mix_optimizer_state=mix_state)
        model.setup(chainer.optimizers.Adam(alpha=0.01))
        model.step(*batch(8))
        states = [dict(r.predictor.fc.W.update_rule.state)
                  for r in model.replicas]
        same = np.array_equal(states[0]['m'], states[1]['m'])
        assert same == mix_state


@pytest.mark.parametrize('kwargs,message', [
    (dict(mode='sync'), "mode must be 'dg' or 'ipm', got 'sync'"),
    (dict(mix_every=5), "mix_every applies to mode='ipm' only"),
    (dict(mode='ipm', mix_every=0), "mix_every must be an int >= 1"),
    (dict(devices=[]), 'devices must name at least one device'),
])
def test_bad_arguments(kwargs, message):
    kwargs.setdefault('devices', ['@numpy'])
    with pytest.raises(ValueError, match=message):
        GPUDistributedGradient(fresh(), **kwargs)


def test_missing_gpu_lists_what_is_available():
    missing = gpu_count()[0]  # the first id past this machine's GPUs
    with pytest.raises(DeviceError, match=rf"device {missing} is not "
                                          r"available \(.*\); available: "
                                          r"@numpy"):
        GPUDistributedGradient(fresh(), [missing])


@pytest.mark.skipif(gpu_count()[0] > 0, reason='CuPy works here')
def test_missing_gpu_says_why_in_chainers_words():
    # Chainer keeps the error of its `import cupy`: that is the reason.
    reason = cuda_unavailable_reason()
    assert reason and 'cupy' in reason.lower()
    with pytest.raises(DeviceError, match=re.escape(reason)):
        GPUDistributedGradient(fresh(), [0])


@pytest.mark.skipif(gpu_count()[0] > 0, reason='CuPy works here')
def test_gpus_cupy_cannot_use_stop_a_run_unless_it_asked_for_the_cpu(
        gpu_server, monkeypatch):
    reason = cuda_unavailable_reason()
    line = unusable_gpus_here()
    assert line.startswith('nvidia-smi sees 1 GPU, but CuPy cannot use it '
                           f'({reason}): install CuPy with its CUDA ')
    refusal = re.escape(line) + '; or pass devices cpu to train on the CPU'
    with pytest.raises(GpusUnusable, match=f'^{refusal}$'):
        check_gpus_usable(None)            # the default: every GPU
    with pytest.raises(GpusUnusable, match=f'^{refusal}$'):
        GPUDistributedGradient(fresh(), [0])   # a GPU named
    check_gpus_usable(('@numpy',))         # the CPU asked for
    GPUDistributedGradient(fresh(), ['@numpy', '@numpy'])
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '')  # hidden on purpose
    assert unusable_gpus_here() is None
    check_gpus_usable(None)
    monkeypatch.setenv('PATH', '/nonexistent')  # no driver: no GPU to use
    monkeypatch.delenv('CUDA_VISIBLE_DEVICES')
    assert unusable_gpus_here() is None
    check_gpus_usable(None)


def test_setup_refuses_an_optimizer_already_in_use():
    optimizer = chainer.optimizers.SGD()
    optimizer.setup(fresh())
    model = GPUDistributedGradient(fresh(), ['@numpy'])
    with pytest.raises(ValueError, match='already set up'):
        model.setup(optimizer)


def test_exceptions_in_the_with_block_propagate():
    model = GPUDistributedGradient(fresh(), ['@numpy'])
    with pytest.raises(ZeroDivisionError):
        with model:
            1 / 0  # noqa: B018  (the error under test)


def test_spread_measures_without_mixing():
    model = GPUDistributedGradient(fresh(), ['@numpy'] * 2, mode='ipm')
    model.setup(chainer.optimizers.SGD(lr=0.1))
    model.step(*batch(8))
    before = params(model.replicas[1])
    spread = model.spread()
    assert spread > 0
    assert np.array_equal(params(model.replicas[1])['/predictor/fc/W'],
                          before['/predictor/fc/W'])
    model.mix()
    assert model.drift == pytest.approx(spread, rel=1e-9)
    assert model.drifts == [model.drift] and model.spread() == 0


def test_metrics_summed_on_the_devices_equal_the_per_step_reads():
    model = GPUDistributedGradient(fresh(), ['@numpy'] * 3)
    model.setup(chainer.optimizers.SGD(lr=0.1))
    loss_sum = acc_sum = 0.0
    for seed in range(3):
        x, t = batch(10, seed)
        loss, accuracy = model.step(x, t)   # reads the host every step
        loss_sum += loss * 10
        acc_sum += accuracy * 10
    loss, accuracy, images = model.take_metrics()  # one read per replica
    assert images == 30
    assert loss == pytest.approx(loss_sum, rel=1e-6)
    assert accuracy == pytest.approx(acc_sum, rel=1e-6)
    assert model.take_metrics() == (0.0, 0.0, 0.0)  # reset by the read
    assert model.step(*batch(4), observe=False) is None


def test_evaluators_one_per_device_holding_the_mean_in_ipm():
    model = GPUDistributedGradient(fresh(), ['@numpy'] * 2, mode='ipm')
    model.setup(chainer.optimizers.SGD(lr=0.1))
    model.step(*batch(8))
    (link, device), = model.evaluators()   # two replicas, one device
    assert str(device) == '@numpy'
    mean = {k: (a + b) / 2 for (k, a), b in zip(
        params(model.replicas[0]).items(), params(model.replicas[1]).values())}
    for key, value in params(link).items():
        np.testing.assert_allclose(value, mean[key], rtol=1e-6)
    dg = GPUDistributedGradient(fresh(), ['@numpy'] * 2)
    assert dg.evaluators() == [(dg.master, dg.devices[0])]


def test_replicas_draw_dropout_from_their_own_streams():
    # Two replicas given the same part must draw different masks; the same
    # (seed, epoch, replica) must draw the same masks again.
    def masks():
        model = GPUDistributedGradient(fresh('cifar10'), ['@numpy'] * 2)
        model.seed(0, 3)
        x, t = batch(2)
        with chainer.using_config('train', True):
            model([x[:1], x[:1]], [t[:1], t[:1]])
        return [float(r.loss.array) for r in model.replicas]
    first, again = masks(), masks()
    assert first == again and first[0] != first[1]


class Mirror(Communicator):
    """A job of two ranks whose other rank sends what this one sends
    (after ``delay`` seconds: a slow peer)."""
    solo, sums_on_device = False, False

    def __init__(self, delay=0.0):
        super().__init__(0, 2, None)
        self.delay = delay

    def allreduce(self, arrays, check=False):
        time.sleep(self.delay)
        for a in arrays:
            a *= 2
        return arrays

    def allgather(self, obj):
        return [obj, obj]

    def gather(self, obj):
        return [obj, obj]

    def bcast(self, obj):
        return obj

    def close(self):
        pass


def stale_reference(batches, warmup, epoch=None, predict=False,
                    optimizer=None):
    """SGD on one model by hand, each gradient applied one step late once
    ``warmup`` steps are done (exact before), the one in flight applied
    at the end (and at step ``epoch``, an epoch's end). With ``predict``,
    a step that applies a late gradient computes its own at the weights
    plus the last update (none known since an epoch's end: no shift)."""
    ref = fresh()
    optimizer = optimizer or chainer.optimizers.SGD(lr=0.1)
    optimizer.setup(ref)

    def weights():
        return [p.array.copy() for _, p in sorted(ref.namedparams())]

    def apply(grads):
        nonlocal before
        before = weights()
        for (_, p), g in zip(sorted(ref.namedparams()), grads):
            p.grad[...] = g
        optimizer.update()
    late = before = None
    for step, (x, t) in enumerate(batches):
        if step == epoch:
            if late is not None:
                apply(late)
            late = before = None
        shift = predict and step >= warmup and late is not None and \
            before is not None
        if shift:
            now = weights()
            for (_, p), w, b in zip(sorted(ref.namedparams()), now, before):
                p.array[...] = w + (w - b)
        ref.cleargrads()
        ref(x, t).backward()
        grads = [p.grad.copy() for _, p in sorted(ref.namedparams())]
        if shift:
            for (_, p), w in zip(sorted(ref.namedparams()), now):
                p.array[...] = w
        if step < warmup:
            apply(grads)
            continue
        if late is not None:
            apply(late)
        late = grads
    if late is not None:
        apply(late)
    return ref


@pytest.mark.equivalence
@pytest.mark.parametrize('double_buffering,delay,warmup', [
    (False, 0.0, 0), (True, 0.0, 0),
    (True, 0.05, 0),  # the sums arrive after the step has gone on
    (True, 0.0, 2),   # two exact steps, then stale
])
@pytest.mark.parametrize('stale', ['plain', 'predicted', 'corrected'])
def test_double_buffering_applies_the_previous_step_s_gradient(
        double_buffering, delay, warmup, stale, float64):
    batches = [batch(6, seed) for seed in range(6)]
    model = GPUDistributedGradient(fresh(), ['@numpy'], comm=Mirror(delay),
                                   double_buffering=double_buffering,
                                   warmup=warmup, stale=stale)
    model.setup(chainer.optimizers.SGD(lr=0.1))
    for x, t in batches:  # each rank's half: weighted 1/2, summed x2
        model.step(x, t, total=2 * len(x))
    model.end_epoch()
    # Corrected steps with a peer that computes the same gradient: the
    # late mean replaces exactly the rank's own: exact dg.
    late = double_buffering and stale != 'corrected'
    ref = stale_reference(batches, warmup if late else 99,
                          predict=stale == 'predicted')
    for key, value in params(ref).items():
        np.testing.assert_allclose(params(model.master)[key], value,
                                   rtol=1e-10, atol=1e-12, err_msg=key)


@pytest.mark.equivalence
def test_double_buffering_warms_up_exact_for_the_first_epoch(float64,
                                                             tmp_path):
    batches = [batch(6, seed) for seed in range(7)]
    model = GPUDistributedGradient(fresh(), ['@numpy'], comm=Mirror(),
                                   double_buffering=True,  # 'epoch'
                                   stale='plain')
    model.setup(chainer.optimizers.SGD(lr=0.1))
    for step, (x, t) in enumerate(batches):
        if step in (3, 5):  # epochs of 3, 2 and 2 steps
            model.end_epoch()
        model.step(x, t, total=2 * len(x))
    model.end_epoch()
    assert model.exchange.stale_from == 3
    # the second epoch's end applies the gradient in flight
    ref = stale_reference(batches, 3, epoch=5)
    for key, value in params(ref).items():
        np.testing.assert_allclose(params(model.master)[key], value,
                                   rtol=1e-10, atol=1e-12, err_msg=key)
    # a checkpoint remembers where warm-up ended
    chainer.serializers.save_npz(tmp_path / 'c.npz', model)
    again = GPUDistributedGradient(fresh(), ['@numpy'], comm=Mirror(),
                                   double_buffering=True)
    again.setup(chainer.optimizers.SGD(lr=0.1))
    with np.load(tmp_path / 'c.npz') as npz:
        again.restore(npz)
    assert again.exchange.stale_from == 3 and again.exchange.stale(3)


@pytest.mark.equivalence
def test_weight_prediction_on_two_replicas_with_momentum_across_epochs(
        float64):
    # Two replicas in this process (the shifted master copied into the
    # other), heavy-ball momentum, an epoch's end forgetting the last
    # update: the hand-written reference, step for step.
    batches = [batch(6, seed) for seed in range(9)]
    model = GPUDistributedGradient(fresh(), ['@numpy'] * 2, comm=Mirror(),
                                   double_buffering=True, warmup=0,
                                   stale='predicted')
    model.setup(chainer.optimizers.MomentumSGD(lr=0.05, momentum=0.9))
    for step, (x, t) in enumerate(batches):
        if step == 5:
            model.end_epoch()
        model.step(x, t, total=2 * len(x))
    model.end_epoch()
    ref = stale_reference(batches, 0, epoch=5, predict=True,
                          optimizer=chainer.optimizers.MomentumSGD(
                              lr=0.05, momentum=0.9))
    plain = stale_reference(batches, 0, epoch=5, predict=False,
                            optimizer=chainer.optimizers.MomentumSGD(
                                lr=0.05, momentum=0.9))
    for key, value in params(ref).items():
        for replica in model.replicas:
            np.testing.assert_allclose(params(replica)[key], value,
                                       rtol=1e-10, atol=1e-12, err_msg=key)
    # and the prediction changed something (it is not a no-op here)
    assert any(not np.allclose(params(plain)[k], v)
               for k, v in params(ref).items())


@pytest.mark.parametrize('stale,devices', [('predicted', 1),
                                            ('corrected', 2)])
def test_stale_steps_resume_bit_identical(tmp_path, stale, devices):
    batches = [batch(6, seed) for seed in range(12)]

    def make():
        model = GPUDistributedGradient(fresh(), ['@numpy'] * devices,
                                       comm=Mirror(), double_buffering=True,
                                       warmup=0, stale=stale)
        model.setup(chainer.optimizers.MomentumSGD(lr=0.05, momentum=0.9))
        return model

    def epoch(model, part):
        for x, t in part:
            model.step(x, t, total=2 * len(x))
        model.end_epoch()
    whole = make()
    epoch(whole, batches[:6])
    epoch(whole, batches[6:])
    first = make()
    epoch(first, batches[:6])
    chainer.serializers.save_npz(tmp_path / 'c.npz', first)
    resumed = make()
    with np.load(tmp_path / 'c.npz') as npz:
        resumed.restore(npz)
    epoch(resumed, batches[6:])
    for key, value in params(whole.master).items():
        np.testing.assert_array_equal(params(resumed.master)[key], value,
                                      err_msg=key)


def corrected_reference(batches, n, warmup, epoch, optimizer, lr_at=None):
    """Delayed gradient averaging by hand on ``n`` models (one per
    replica): exact dg for ``warmup`` steps (every model updated by its own
    optimizer with the job's mean), then each model's own mean gradient l_r
    plus the last step's job mean G minus its own last l_r; at step
    ``epoch`` and at the end, weights and optimizer state averaged.
    ``lr_at``: (step, name, value): a learning rate changed."""
    models = [fresh() for _ in range(n)]
    optimizers = [optimizer() for _ in range(n)]
    for o, m in zip(optimizers, models):
        o.setup(m)

    def named(m):
        return [p for _, p in sorted(m.namedparams())]

    def average():
        for ps in zip(*map(named, models)):
            mean = sum(p.array for p in ps) / n
            for p in ps:
                p.array[...] = mean
            for key in ps[0].update_rule.state:
                mean = sum(p.update_rule.state[key] for p in ps) / n
                for p in ps:
                    p.update_rule.state[key][...] = mean
    kept = late = None
    for step, (x, t) in enumerate(batches):
        if lr_at and step == lr_at[0]:
            for o in optimizers:
                setattr(o, lr_at[1], lr_at[2])
        if step == epoch and kept is not None:
            average()
            kept = None
        xs, ts = np.array_split(x, n), np.array_split(t, n)
        local = []
        for m, xr, tr in zip(models, xs, ts):
            m.cleargrads()
            m(xr, tr).backward()
            local.append([p.grad.copy() for p in named(m)])
        mean = [sum(len(xr) / len(x) * g for xr, g in zip(xs, gs))
                for gs in zip(*local)]
        if step < warmup:  # every model the same update: exact dg
            for m, o in zip(models, optimizers):
                for p, g in zip(named(m), mean):
                    p.grad[...] = g
                o.update()
            continue
        # the correction fades in over as many steps as the warm-up took
        weight = min(1.0, (step - warmup) / warmup) if warmup else 1.0
        for r, (m, o) in enumerate(zip(models, optimizers)):
            for i, p in enumerate(named(m)):
                p.grad[...] = local[r][i] if kept is None else \
                    local[r][i] + weight * (late[i] - kept[r][i])
            o.update()
        kept, late = local, mean
    if kept is not None:
        average()
    return models


@pytest.mark.equivalence
@pytest.mark.parametrize('kind,warmup', [('sgd', 0), ('momentum', 0),
                                         ('adam', 0), ('momentum', 2),
                                         ('adam', 3)])
@pytest.mark.parametrize('batch_size', [6, 7])  # 7: unequal halves
def test_corrected_stale_steps_follow_the_hand_written_reference(
        kind, warmup, batch_size, float64):
    # Two replicas in one process are two ranks of one replica each: each
    # its own weights and optimizer between epoch ends, the job's mean a
    # step late in place of its own gradient; an epoch's end averages
    # weights and optimizer state. The learning rate changes mid-run on
    # the master's optimizer only (a schedule): every replica follows.
    batches = [batch(batch_size, seed) for seed in range(9)]
    rate = 'alpha' if kind == 'adam' else 'lr'
    model = GPUDistributedGradient(fresh(), ['@numpy'] * 2,
                                   double_buffering=True, warmup=warmup)
    model.setup(make_optimizer(kind))
    for step, (x, t) in enumerate(batches):
        if step == 5:
            model.end_epoch()
        if step == 7:
            setattr(model.optimizer, rate, 0.02)
        model.step(x, t)
    model.end_epoch()
    refs = corrected_reference(batches, 2, warmup, 5,
                               lambda: make_optimizer(kind), (7, rate, 0.02))
    for replica in model.replicas:
        for key, value in params(refs[0]).items():
            np.testing.assert_allclose(params(replica)[key], value,
                                       rtol=1e-10, atol=1e-12, err_msg=key)
    # the replicas did differ between epoch ends (it is not exact dg)
    exact = GPUDistributedGradient(fresh(), ['@numpy'] * 2)
    exact.setup(make_optimizer(kind))
    for x, t in batches:
        exact.step(x, t)
    assert any(not np.allclose(params(exact.master)[k], v)
               for k, v in params(refs[0]).items())
    assert model.drift > 0  # measured before the last average


class Normed(chainer.Chain):
    """BatchNorm between two layers: running statistics to keep."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = chainer.links.Linear(3 * 32 * 32, 8)
            self.bn = chainer.links.BatchNormalization(8)
            self.l2 = chainer.links.Linear(8, 10)

    def forward(self, x):
        return self.l2(chainer.functions.relu(self.bn(self.l1(x))))


@pytest.mark.equivalence
@pytest.mark.parametrize('devices', [1, 2])
@pytest.mark.parametrize('recipe', ['plain', 'corrected'])
def test_double_buffered_batchnorm_statistics_count_every_batch(
        devices, recipe, float64):
    # lr 0: parameters never move, so exact and stale training see the
    # same batches through the same weights; their running statistics
    # must agree (they used to hold every other batch).
    batches = [batch(8, seed) for seed in range(5)]
    stats = {}
    for stale in (False, True):
        np.random.seed(0)
        model = GPUDistributedGradient(
            chainer.links.Classifier(Normed()), ['@numpy'] * devices,
            comm=Mirror(), double_buffering=stale, warmup=0, stale=recipe)
        model.setup(chainer.optimizers.SGD(lr=0))
        for x, t in batches:
            model.step(x, t, total=2 * len(x))
        model.end_epoch()
        stats[stale] = [persistents(r) for r in model.replicas]
    assert stats[False][0]['/predictor/bn/avg_mean'].any()
    for exact, stale in zip(stats[False], stats[True]):
        for key, value in exact.items():
            np.testing.assert_allclose(stale[key], value, rtol=1e-10,
                                       atol=1e-12, err_msg=key)


def test_two_float32_statistics_sum_to_the_float64_mean_s_bits():
    # Why dg's statistics of a job of two replicas are summed in float32
    # (exchange._statistics): a + b rounded once and halved exactly is
    # float64's mean rounded once, over float32's whole normal range.
    rng = np.random.default_rng(0)
    a, b = ((rng.standard_normal(200_000) *
             10.0 ** rng.integers(-35, 35, 200_000)).astype(np.float32)
            for _ in range(2))
    summed = a + b
    summed /= 2  # as Replicas.reduce divides
    np.testing.assert_array_equal(
        summed, ((a.astype(np.float64) + b) / 2).astype(np.float32))


def test_float16_communication_keeps_small_gradients():
    # Shares weighted by 6 / 6e6: gradients far below float16's smallest
    # normal (6e-5), which would flush to zero unless scaled per array.
    x, t = batch(6)
    grads = {}
    for dtype in (None, 'float16'):
        model = GPUDistributedGradient(fresh(), ['@numpy'], comm=Mirror(),
                                       comm_dtype=dtype)
        model.setup(chainer.optimizers.SGD(lr=0.1))
        model.step(x, t, total=6_000_000)
        grads[dtype] = {k: p.grad.copy()
                        for k, p in sorted(model.master.namedparams())}
    for key, exact in grads[None].items():
        assert np.abs(exact).max() < 1e-4
        error = np.abs(grads['float16'][key] - exact).max()
        assert error <= 2 ** -10 * np.abs(exact).max(), key


class Recording(Mirror):
    """Mirror keeping every list of arrays it was asked to sum, in order
    (one collective at a time, so in the order of the calls)."""

    def __init__(self):
        super().__init__()
        self.handed = []

    def allreduce(self, arrays, check=False):
        self.handed.append(list(arrays))
        return super().allreduce(arrays, check)


def _flat(calls, dtype=np.float32):
    """The gradient buffers among the arrays of ``calls`` (the
    statistics travel in float64)."""
    return [a for call in calls for a in call if a.dtype == dtype]


@pytest.mark.parametrize('options', [
    {}, {'bucket_mb': 1e-3}, {'bucket_mb': 1e-3, 'comm_dtype': 'float16'},
    {'double_buffering': True, 'warmup': 0, 'stale': 'plain'}], ids=str)
def test_gradients_are_views_of_flat_buffers_made_once(options):
    # PyTorch DDP's layout: each bucket's gradients travel as one flat
    # buffer, allocated once, summed in place; after the step each master
    # gradient IS its view of the sum (no copy back), except in float16,
    # where the sum is decoded into the gradient.
    comm = Recording()
    model = GPUDistributedGradient(fresh(), ['@numpy'], comm=comm,
                                   **options)
    model.setup(chainer.optimizers.SGD(lr=0.1))
    grads, ends = [], []
    for seed in range(5):
        model.step(*batch(6, seed), total=12)
        grads.append([p.grad for _, p in sorted(
            model.master.namedparams())])
        ends.append(len(comm.handed))
    model.end_epoch()
    sizes = sum(p.size for p in model.master.params())
    stale = options.get('double_buffering', False)
    wire = np.float16 if options.get('comm_dtype') else np.float32
    steps = [comm.handed[a:b] for a, b in zip([0] + ends, ends)] \
        if not stale else [[call] for call in comm.handed]
    # float16: each array's probe travels behind its bucket
    # (parallel.exchange.wire)
    probes = len(list(model.master.params())) if wire == np.float16 else 0
    for s in range(2, 5):  # after the first step, which finds the order
        flat = _flat(steps[s], wire)
        # every gradient element travels once, in one flat array per bucket
        assert sum(a.size for a in flat) == sizes + probes and \
            all(a.ndim == 1 and a.flags.c_contiguous for a in flat)
        before = _flat(steps[s - 2 if stale else s - 1], wire)
        assert [id(a) for a in flat] == [id(a) for a in before]  # reused
        summed = _flat(steps[s - 1] if stale else steps[s], wire)
        for g in grads[s]:
            views = [np.shares_memory(g, a) for a in summed]
            assert views.count(True) == (0 if wire == np.float16 else 1)
    if stale:  # two sets: the one in flight, the one being filled
        assert not set(map(id, _flat(steps[3]))) & set(map(id, _flat(
            steps[4])))
    if options.get('bucket_mb'):
        assert len(_flat(steps[4], wire)) > 1  # buckets, each its buffer


class Lazy(chainer.Chain):
    """The Chainer idiom: input sizes taken from the first batch."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = chainer.links.Linear(None, 16)
            self.l2 = chainer.links.Linear(None, 10)

    def forward(self, x):
        return self.l2(chainer.functions.relu(self.l1(x)))


@pytest.mark.equivalence
@pytest.mark.parametrize('mode', ['dg', 'ipm'])
def test_a_lazily_initialised_model_starts_equal_everywhere(mode, float64):
    x, t = batch(12)
    model = GPUDistributedGradient(chainer.links.Classifier(Lazy()),
                                   ['@numpy'] * 3, mode=mode)
    model.setup(chainer.optimizers.SGD(lr=0.1))
    np.random.seed(5)  # the draw the master makes at its first forward
    with model as m:  # forward only: every replica as the master
        m(*model.split(x, t))
    first = params(model.master)
    assert first and all(v is not None for v in first.values())
    for replica in model.replicas[1:]:
        theirs = params(replica)
        for name in first:
            assert np.array_equal(theirs[name], first[name]), name
    if mode == 'ipm':
        return
    # and dg on 3 replicas equals one device on the whole batch
    one = chainer.links.Classifier(Lazy())
    optimizer = chainer.optimizers.SGD(lr=0.1)
    optimizer.setup(one)
    np.random.seed(5)
    one(x[:1], t[:1])  # the same first draw, then the same updates
    for name, p in sorted(one.namedparams()):
        np.testing.assert_array_equal(p.array, first[name])
    model.cleargrads()
    for seed in range(3):
        xs, ts = batch(12, seed)
        model.step(xs, ts)
        optimizer.update(one, xs, ts)
    for name, value in params(one).items():
        np.testing.assert_allclose(params(model.master)[name], value,
                                   rtol=1e-10, atol=1e-12, err_msg=name)


def test_the_parallel_examples_hold():
    import doctest

    from dasktrain.parallel.exchange import flat
    from dasktrain.parallel.stale import correction, prediction
    for module in (correction, flat, prediction):
        assert doctest.testmod(module).failed == 0, module.__name__
        assert doctest.testmod(module).attempted > 0, module.__name__
