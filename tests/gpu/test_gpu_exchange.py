"""The exchange's GPU paths in one process: double buffering's three stale
recipes on one GPU and on two against the same on the CPU (float64),
float16's scales through a 1000x jump on a GPU, and no device-wide
synchronisation in a step. The all-reduce is a two-rank mirror that first
spins a kernel on the stream it runs on, as NCCL would take a while there:
whatever read a sum before that stream finished would read the unsummed
array and differ from the CPU. Skipped without a GPU."""
import contextlib
import warnings

import chainer
import numpy as np
import pytest
from gpu_marks import needs
from test_gpu_replicas import batch, fresh, host
from test_wire import Scaled

import dasktrain.parallel.devices as devices_module
import dasktrain.parallel.replicas as replicas_module
from dasktrain.parallel import GPUDistributedGradient
from dasktrain.parallel.comm.base import Communicator

pytestmark = needs(1)

SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
'''


class SlowTwin(Communicator):
    """Two ranks, the other sending what this one sends: every array
    doubled, on a GPU after a kernel that spins ``cycles`` on the stream
    the all-reduce runs on (this thread's current stream of the array's
    device: the side stream inside ``SideStream.after``)."""
    solo, sums_on_device = False, True

    def __init__(self, cycles=1 << 24):
        super().__init__(0, 2, 60.0)
        self.cycles, self.kernel = cycles, None

    def allreduce(self, arrays, check=False):
        gpu = [a for a in arrays if not isinstance(a, np.ndarray)]
        if gpu:
            import cupy
            if self.kernel is None:
                self.kernel = cupy.RawKernel(SPIN, 'spin')
            with gpu[0].device:  # the current stream of that device
                self.kernel((1,), (1,), (np.int64(self.cycles),))
        for a in arrays:
            a *= 2  # a kernel on the same stream, after the spin
        return arrays

    def allgather(self, obj):
        return [obj, obj]

    def gather(self, obj):
        return [obj, obj]

    def bcast(self, obj):
        return obj

    def close(self):
        pass


@pytest.fixture
def device_syncs(monkeypatch):
    """A list counting calls of devices.synchronize (cudaDeviceSynchronize
    per GPU), wherever a module imported it."""
    calls = [0]
    real = devices_module.synchronize

    def counted(devices):
        calls[0] += 1
        return real(devices)
    for module in (devices_module, replicas_module):
        monkeypatch.setattr(module, 'synchronize', counted)
    return calls


def strict():
    """No kernel may read another GPU's array (CuPy's PerformanceWarning,
    an error without peer access): every op runs on its array's device."""
    context = warnings.catch_warnings()
    context.__enter__()
    warnings.simplefilter('error', chainer.backends.cuda._PerformanceWarning)
    return context


def current_gpu(i):
    """GPU ``i`` current inside (nothing for None)."""
    if i is None:
        return contextlib.nullcontext()
    import cupy
    return cupy.cuda.Device(i)


LAYOUTS = [pytest.param(('@cupy:0', '@cupy:0'), id='one-gpu'),
           pytest.param(('@cupy:0', '@cupy:1'), id='two-gpus',
                        marks=needs(2)),
           # the master on GPU 1 while GPU 0 is current (a user's
           # --devices 1,0 in one process): every op on its own GPU
           pytest.param(('@cupy:1', '@cupy:0'), id='master-on-gpu-1',
                        marks=needs(2))]


@pytest.mark.parametrize('devices', LAYOUTS)
@pytest.mark.parametrize('recipe', ['corrected', 'predicted', 'plain'])
def test_double_buffering_on_gpus_equals_the_cpu(recipe, devices, float64,
                                                 device_syncs):
    # Two exact steps, then stale ones across an epoch's end; momentum,
    # which a wrong stale step would throw far off.
    results = {}
    for where in (('@numpy', '@numpy'), devices):
        model = GPUDistributedGradient(fresh('tiny'), list(where),
                                       comm=SlowTwin(), double_buffering=True,
                                       warmup=2, stale=recipe)
        model.setup(chainer.optimizers.MomentumSGD(lr=0.02))
        context = strict()
        try:
            with chainer.using_config('cudnn_deterministic', True), \
                    current_gpu(0 if where[0] != '@numpy' else None):
                for epoch in range(2):
                    for s in range(4):
                        before = device_syncs[0]
                        model.step(*batch(8, 4 * epoch + s), total=16)
                        assert device_syncs[0] == before, 'a device sync'
                    model.end_epoch()
        finally:
            context.__exit__(None, None, None)
        results[where] = [host(r) for r in model.replicas]
    cpu, gpu = results[('@numpy', '@numpy')], results[devices]
    for mine, theirs in zip(gpu, cpu):
        assert set(mine) == set(theirs)
        for key in theirs:
            assert mine[key].dtype == np.float64
            np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-10,
                                       atol=1e-12, err_msg=key)


@pytest.mark.parametrize('options', [
    {'bucket_mb': 1e-3}, {'bucket_mb': 0},
    {'double_buffering': True, 'warmup': 0, 'stale': 'plain'}], ids=str)
def test_float16_on_a_gpu_sums_a_1000x_jump_without_inf(options):
    # lr 0: the weights stay; float16's sums differ from float32's by
    # float16's rounding alone, through a 1000x and a 1e6x jump.
    factors = [1, 1, 1, 1000, 1000, 1e6, 1, 1e-4, 1]
    runs = {}
    for dtype in (None, 'float16'):
        np.random.seed(0)
        model = GPUDistributedGradient(Scaled(), ['@cupy:0'],
                                       comm=SlowTwin(), comm_dtype=dtype,
                                       **options)
        model.setup(chainer.optimizers.SGD(lr=0))
        grads = []
        with chainer.using_config('cudnn_deterministic', True):
            for step, factor in enumerate(factors):
                model.master.factor = factor
                model.step(*batch(6, step), total=12)
                grads.append({k: chainer.backends.cuda.to_cpu(p.grad).copy()
                              for k, p in sorted(
                                  model.master.namedparams())})
        model.end_epoch()
        runs[dtype] = grads, model
    stale = options.get('double_buffering', False)
    for step in range(1 if stale else 0, len(factors)):
        for key, want in runs[None][0][step].items():
            got = runs['float16'][0][step][key]
            assert np.isfinite(got).all(), (step, key)
            assert np.abs(got - want).max() <= \
                2.0 ** -9 * np.abs(want).max() + 1e-30, (step, key)
    wire = runs['float16'][1].exchange.wire
    assert wire.resent >= 2 and wire.asked >= 1


def test_a_one_gpu_rank_overlapping_buckets_syncs_no_device(device_syncs):
    # The default layout: one replica, buckets during the backward pass on
    # the side stream; the clock waits for this thread's stream only.
    weights = {}
    for mb in (0.05, 0):  # buckets during the backward pass; one after it
        np.random.seed(0)
        model = GPUDistributedGradient(fresh('resnet20'), ['@cupy:0'],
                                       comm=SlowTwin(), bucket_mb=mb)
        model.setup(chainer.optimizers.MomentumSGD(lr=0.01))
        with chainer.using_config('cudnn_deterministic', True):
            for s in range(4):
                before = device_syncs[0]
                model.step(*batch(8, s), total=16, observe=False)
                assert device_syncs[0] == before
        weights[mb] = host(model.master)
        if mb:
            assert model.exchange.early > 0 and model.comm_time > 0
            assert len(model.exchange.plan) > 2  # queued buckets, one wait
    # a sum bound before the side stream ran would differ (SlowTwin spins
    # there first): the same steps as one all-reduce after the pass
    for key, want in weights[0].items():
        np.testing.assert_allclose(weights[0.05][key], want, rtol=1e-5,
                                   atol=1e-7, err_msg=key)


def test_a_fused_float16_fill_gives_the_array_by_array_bits(monkeypatch):
    # flat.fill on a GPU fills a float16 bucket with two kernels
    # (dasktrain.parallel.exchange.fused): the same bits as the array-by-array
    # path, which the CPU shares, through NaN, inf, overflow, all-zero
    # arrays and chunks that end mid-array.
    import cupy

    import dasktrain.parallel.exchange.flat as flat_module
    from dasktrain.parallel.exchange.flat import FlatBuckets
    rng = np.random.default_rng(0)
    shapes = [(3, 5), (5000,), (7,), (64, 3, 3, 3), (4097,), (8193,)]
    arrays = [(rng.standard_normal(s) * 10.0 ** rng.integers(-6, 6))
              .astype(np.float32) for s in shapes]
    arrays[0][0, 0] = np.nan
    arrays[1][5], arrays[1][6] = np.inf, -3e38
    arrays[2][:] = 0.0
    arrays[2][3] = -0.0
    arrays[4][4096] = 7e4  # beyond float16 at a scale of 1
    params = [chainer.Parameter(a.copy()) for a in arrays]
    plan = [[0, 1, 2], [5, 3, 4]]
    scales = [[2.0 ** -3, 2.0 ** 10, 1.0], [2.0 ** -20, 1.0, 2.0 ** 3]]
    factors = [[2.0 ** -12, 2.0 ** 5, 1.0], [2.0 ** 14, 2.0 ** -1, 1.0]]
    device = chainer.get_device('@cupy:0')
    grads = [cupy.asarray(a) for a in arrays]
    got = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(flat_module, 'fusable', lambda grads: False)
        flat = FlatBuckets(params, plan, device, np.dtype('float16'),
                           probes=True)
        out = []
        for k in range(2):
            bucket = [grads[i] for i in plan[k]]
            flat.fill(k, bucket, scales[k], probes=factors[k])
            out.append(cupy.asnumpy(flat.buffers[k][0]).copy())
        flat.fill(1, [grads[i] for i in plan[1]], 2.0)  # sent again
        out.append(cupy.asnumpy(flat.buffers[1][0]).copy())
        got[fused] = out, flat
    assert got[True][1]._fused and not got[False][1]._fused
    for a, b in zip(got[True][0], got[False][0]):
        # bit for bit: -0.0 apart from 0.0, and NaN's bits (both round
        # with the same conversion instruction)
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    assert np.signbit(got[True][0][0][15 + 5000 + 3])  # -0.0 stays -0.0
    probes = got[True][0][0][-3:]
    assert np.isnan(probes[0]) and probes[1] == np.inf and probes[2] == 0
