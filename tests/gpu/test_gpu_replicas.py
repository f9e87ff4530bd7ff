"""GPUDistributedGradient on real GPUs: equal to the CPU and to one device,
on the right device, deterministic when asked. Skipped without a GPU."""
import contextlib
import os
import subprocess
import sys
import textwrap
import warnings

import chainer
import numpy as np
import pytest
from gpu_marks import COUNT, needs

from dasktrain.parallel import GPUDistributedGradient
from dasktrain.parallel.comm.base import Communicator
from dasktrain.parallel.devices import Clock, SideStream
from dasktrain.training.models import get_model

pytestmark = needs(1)


def batch(n, seed=0):
    rng = np.random.RandomState(seed)
    return (rng.randn(n, 3, 32, 32).astype(np.float32),
            rng.randint(0, 10, n).astype(np.int32))


def fresh(name='tiny', seed=0):
    np.random.seed(seed)
    return get_model(name)


def host(link):
    """Parameters and persistent arrays, on the host, by name."""
    found = {n: chainer.backends.cuda.to_cpu(p.array)
             for n, p in link.namedparams()}
    for path, sub in link.namedlinks():
        for name in sub._persistent:
            value = getattr(sub, name)
            if hasattr(value, 'dtype'):
                found[f'{path}/{name}'] = chainer.backends.cuda.to_cpu(value)
    return found


def close(a, b, rtol=1e-3, atol=1e-4):
    assert set(a) == set(b)
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=atol,
                                   err_msg=key)


def run(name, devices, steps=2, mode='dg', n=16, **kw):
    model = GPUDistributedGradient(fresh(name), devices, mode=mode, **kw)
    model.setup(chainer.optimizers.MomentumSGD(lr=0.05))
    for s in range(steps):
        model.step(*batch(n, s))
    return model


def test_discovery_matches_cuda_and_an_empty_list_hides_all():
    import cupy

    from dasktrain.parallel.devices import available_devices
    count = cupy.cuda.runtime.getDeviceCount()
    assert available_devices() == ['@numpy'] + [f'@cupy:{i}'
                                                for i in range(count)]
    out = subprocess.run(
        [sys.executable, '-c', 'import dasktrain.parallel.devices as d; '
         'print(d.available_devices())'],
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=''), capture_output=True,
        text=True, check=True)
    assert out.stdout.strip() == "['@numpy']"


@pytest.mark.parametrize('name', ['tiny', 'resnet20'])
def test_a_dg_step_on_gpu_equals_numpy(name):
    # float64: in float32 the GPU's and the CPU's BLAS sum in other orders,
    # and BatchNorm's near-zero gradients differ relatively by more than
    # any tolerance that would still catch a wrong step
    def run64(devices):
        with chainer.using_config('dtype', np.float64):
            model = GPUDistributedGradient(fresh(name), devices)
            model.setup(chainer.optimizers.MomentumSGD(lr=0.05))
            for s in range(2):
                x, t = batch(16, s)
                model.step(x.astype(np.float64), t)
        assert next(model.master.params()).array.dtype == np.float64
        return host(model.master)
    close(run64(['@cupy:0']), run64(['@numpy']), rtol=1e-9, atol=1e-12)


def assert_replicas_equal(model):
    # BatchNorm statistics averaged, parameters copied: equal replicas
    a, b = host(model.replicas[0]), host(model.replicas[1])
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# With BatchNorm, each replica normalises by its own part's statistics, so
# only a network without it equals one replica on the whole batch.

def test_two_replicas_on_one_gpu_equal_one_replica_on_the_batch():
    close(host(run('tiny', ['@cupy:0', '@cupy:0']).master),
          host(run('tiny', ['@cupy:0']).master), rtol=1e-4, atol=1e-5)
    assert_replicas_equal(run('resnet20', ['@cupy:0', '@cupy:0']))


@needs(2)
def test_dg_on_two_gpus_equals_one_gpu_on_the_batch():
    close(host(run('tiny', [0, 1]).master), host(run('tiny', [0]).master),
          rtol=1e-4, atol=1e-5)
    assert_replicas_equal(run('resnet20', [0, 1]))


@needs(2)
@pytest.mark.parametrize('mode', ['dg', 'ipm'])
@pytest.mark.parametrize('devices,current', [([1, 0], 0), ([0, 1], 1)])
def test_no_kernel_reads_another_gpu(mode, devices, current):
    """CuPy warns (PerformanceWarning) when a kernel on the current device
    reads another device's array and raises without peer access: every
    cross-replica operation must run on the device it writes."""
    import cupy
    extra = {'mix_every': 1} if mode == 'ipm' else {}
    with warnings.catch_warnings():
        warnings.simplefilter(
            'error', chainer.backends.cuda._PerformanceWarning)
        with cupy.cuda.Device(current):
            model = run('resnet20', devices, mode=mode, **extra)
            model.syncparams() if mode == 'dg' else model.mix()
            model.spread()
            model.averaged()
            model.evaluators()
            model.take_metrics()
    assert model.total_replicas == 2


@needs(2)
def test_nothing_is_allocated_on_a_gpu_outside_the_list():
    # A fresh process: this one has used GPU 0 already.
    script = textwrap.dedent('''
        import dasktrain  # first: it restores numpy.sctypes for chainer
        import cupy, chainer, numpy as np
        from dasktrain.training.models import get_model
        from dasktrain.parallel import GPUDistributedGradient
        for mode in ('dg', 'ipm'):
            model = GPUDistributedGradient(get_model('resnet20'), [1, 1],
                                           mode=mode)
            model.setup(chainer.optimizers.Adam())
            x = np.zeros((8, 3, 32, 32), np.float32)
            t = np.zeros(8, np.int32)
            model.step(x, t)
            model.finalize()
            model.evaluators()
        with cupy.cuda.Device(0):
            print(cupy.get_default_memory_pool().total_bytes())
    ''')
    out = subprocess.run([sys.executable, '-c', script], check=True,
                         capture_output=True, text=True)
    assert out.stdout.split()[-1] == '0'


def test_evaluation_on_gpu_equals_cpu():
    from dasktrain.training.evaluate import evaluate
    x, t = batch(64, 5)
    results = []
    for device in ('@numpy', '@cupy:0'):
        model = GPUDistributedGradient(fresh('resnet20'), [device])
        results.append(evaluate(model.evaluators(), [x], t, 16))
    np.testing.assert_allclose(results[0], results[1], rtol=1e-4)


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(40, 40, 3)


def train_gpu(data_dir, out, **kw):
    from dasktrain.config import TrainConfig
    from dasktrain.run.train import train
    base = dict(model='cifar10', devices=('@cupy:0', '@cupy:0'), epochs=2,
                batch_size=20, data_dir=str(data_dir), out=str(out),
                progress=False, deterministic=True)
    base.update(kw)
    return train(TrainConfig(**base))


def weights(path):
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files if k != 'state'}


def test_deterministic_runs_and_resumes_are_bit_identical(data_dir,
                                                          tmp_path):
    train_gpu(data_dir, tmp_path / 'a')
    train_gpu(data_dir, tmp_path / 'b')
    train_gpu(data_dir, tmp_path / 'c', epochs=1)
    train_gpu(data_dir, tmp_path / 'c', epochs=2, resume=True)
    a = weights(tmp_path / 'a' / 'checkpoint.npz')
    for other in ('b', 'c'):
        b = weights(tmp_path / other / 'checkpoint.npz')
        assert set(a) == set(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_a_gpu_checkpoint_resumes_on_another_device_and_on_the_cpu(
        data_dir, tmp_path):
    train_gpu(data_dir, tmp_path / 'r', epochs=1, devices=('@cupy:0',))
    ckpt = (tmp_path / 'r' / 'checkpoint.npz').read_bytes()
    targets = [('@numpy',)] + ([('@cupy:1',)] if COUNT > 1 else [])
    for devices in targets:
        out = tmp_path / devices[0].replace(':', '')
        out.mkdir()
        (out / 'checkpoint.npz').write_bytes(ckpt)
        summary = train_gpu(data_dir, out, epochs=2, resume=True,
                            devices=devices)
        assert [r['epoch'] for r in summary['log']] == [1, 2]
        assert np.isfinite(summary['final']['main/loss'])
    cpu = get_model('cifar10')
    chainer.serializers.load_npz(tmp_path / 'r' / 'model_final.npz', cpu)
    assert np.isfinite(cpu.predictor.fc5.W.array).all()


def test_bench_train_on_gpu_gives_finite_rows_and_says_if_cudnn_is_on():
    from dasktrain.bench import bench_train
    rows = bench_train(model='tiny', devices=('@cupy:0', '@cupy:0'),
                       iterations=2, repeats=1, epoch_images=200)
    names = [r[0] for r in rows]
    assert names[0] == 'cuDNN' and rows[0][1] in ('on', 'off')
    for name, value, _ in rows:
        if isinstance(value, float):
            assert np.isfinite(value), name


@pytest.mark.parametrize('name', ['cifar10', 'resnet20'])
def test_reporting_backward_on_gpu_gives_chainer_s_gradients(name):
    # The early reports of the overlapped all-reduce change no bit on CuPy
    # either (deterministic cuDNN; dropout from the seeded CuPy stream).
    import cupy

    from dasktrain.parallel.exchange.backprop import backward_reporting
    model = fresh(name)
    model.to_device('@cupy:0')
    x, t = (cupy.asarray(a) for a in batch(8))
    grads, reported = [], []
    with chainer.using_config('cudnn_deterministic', True):
        for reporting in (False, True):
            model.cleargrads()
            cupy.random.seed(3)
            loss = model(x, t)
            if reporting:
                backward_reporting(loss, lambda p: reported.append(p.name))
            else:
                loss.backward()
            grads.append({n: chainer.backends.cuda.to_cpu(p.grad)
                          for n, p in model.namedparams()})
    assert len(reported) == len(list(model.params()))
    for key in grads[0]:
        np.testing.assert_array_equal(grads[1][key], grads[0][key], key)


@needs(2)
def test_a_lazily_initialised_model_starts_equal_on_two_gpus():
    # The parts are on their GPUs when the replicas first see them: each
    # replica initialises from its own device's part, then takes the
    # master's weights (Replicas.initialize).
    class Lazy(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.l1 = chainer.links.Linear(None, 16)
                self.l2 = chainer.links.Linear(None, 10)

        def forward(self, x):
            return self.l2(chainer.functions.relu(self.l1(x)))

    model = GPUDistributedGradient(chainer.links.Classifier(Lazy()),
                                   ['@cupy:0', '@cupy:1'])
    model.setup(chainer.optimizers.SGD(lr=0.1))
    x, t = batch(8)
    with model as m:
        m(*model.split(x, t))
    first, second = (host(r) for r in model.replicas)
    assert set(first) == set(second)
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])


class StreamMirror(Communicator):
    """A two-rank communicator whose peer sends what this rank sends,
    recording the CUDA stream each all-reduce runs on."""
    solo, sums_on_device = False, True

    def __init__(self):
        super().__init__(0, 2, 60.0)
        self.streams, self.threads = [], []

    def allreduce(self, arrays, check=False):
        import threading

        import cupy
        self.streams.append(cupy.cuda.get_current_stream())
        self.threads.append(threading.current_thread().name)
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


def double_buffered(device):
    """Three double-buffered steps and the epoch's end on ``device``
    through a StreamMirror: (the mirror, the master's arrays)."""
    comm = StreamMirror()
    model = GPUDistributedGradient(fresh(), [device], comm=comm,
                                   double_buffering=True, warmup=0)
    model.setup(chainer.optimizers.SGD(lr=0.1))
    for s in range(3):
        model.step(*batch(8, s), total=16)
    model.end_epoch()
    return comm, host(model.master)


def side_stream_problems(comm):
    """What is wrong with where the steps' sums ran: the communication
    thread's three all-reduces, each on the one non-blocking side stream
    (the epoch's end then mixes the replicas on the training thread,
    waiting, on its own stream)."""
    side = [s for s, thread in zip(comm.streams, comm.threads)
            if thread == 'dasktrain-allreduce']
    problems = []
    if len(side) != 3:
        problems.append(f'{len(side)} sums on the communication thread')
    if any(s.ptr in (0, 1, 2) for s in side):  # null, legacy, per-thread
        problems.append('a sum on a default stream')
    if len({s.ptr for s in side}) > 1:
        problems.append('sums on several streams')
    return problems


def test_double_buffering_sums_on_a_side_stream_and_equals_numpy():
    # A thread's CuPy stream is the legacy default one unless set: NCCL
    # there would queue behind the next step's kernels and block them.
    comm, on_gpu = double_buffered('@cupy:0')
    assert side_stream_problems(comm) == []
    close(on_gpu, double_buffered('@numpy')[1])


@contextlib.contextmanager
def _no_side_stream(self, event, wait=True):
    with self.device.device:  # the thread's own (default) stream
        yield


def test_the_side_stream_check_fails_without_a_side_stream(monkeypatch):
    # The subject broken on purpose: the sums run on the communication
    # thread's default stream. The check above must say so.
    monkeypatch.setattr(SideStream, 'after', _no_side_stream)
    comm, _ = double_buffered('@cupy:0')
    assert 'a sum on a default stream' in side_stream_problems(comm)


SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
'''


class SlowMirror(StreamMirror):
    """Its all-reduce queues a kernel that spins on the GPU for a while,
    on the stream it runs on (as NCCL's would)."""

    def __init__(self, cycles):
        super().__init__()
        import cupy
        self.kernel = cupy.RawKernel(SPIN, 'spin')
        self.cycles = cycles

    def allreduce(self, arrays, check=False):
        self.kernel((1,), (1,), (self.cycles,))
        return super().allreduce(arrays, check)


def exposed_and_spin():
    """(communication time a double-buffered step counted while waiting
    for a sum whose kernel spins on the side stream, the spin's time)."""
    import time

    import cupy
    probe = SlowMirror(1 << 31)
    began = time.perf_counter()
    probe.kernel((1,), (1,), (probe.cycles,))
    cupy.cuda.Device(0).synchronize()
    spin = time.perf_counter() - began
    assert spin > 0.05  # a kernel long enough to see
    comm = SlowMirror(probe.cycles)
    model = GPUDistributedGradient(fresh(), ['@cupy:0'], comm=comm,
                                   double_buffering=True, warmup=0)
    model.setup(chainer.optimizers.SGD(lr=0.1))
    model.step(*batch(8), total=16)  # starts the first sum, applies none
    before = model.comm_time
    # The second step applies the first sum: it waits for the spinning
    # kernel on the side stream, exposed (a tiny model hides none of it),
    # and starts its own sum without waiting for that one.
    model.step(*batch(8, 1), total=16)
    exposed = model.comm_time - before
    model.end_epoch()
    return exposed, spin


def test_comm_time_counts_the_side_streams_exposed_time():
    exposed, spin = exposed_and_spin()
    assert 0.5 * spin <= exposed < 1.5 * spin  # not its own sum too


def test_comm_time_check_fails_if_the_clock_waits_for_the_device(
        monkeypatch):
    # The subject broken on purpose: a device-wide wait before the clock
    # starts also waits for the side stream's sum, and counts none of it.
    import cupy
    real = Clock.timed

    def device_wide_first(self, work):
        cupy.cuda.Device(0).synchronize()
        return real(self, work)
    monkeypatch.setattr(Clock, 'timed', device_wide_first)
    exposed, spin = exposed_and_spin()
    assert exposed < 0.5 * spin


def test_the_updater_reports_gpu_means_the_log_reads_later(tmp_path,
                                                            monkeypatch):
    # DistributedUpdater reports each key's mean as a GPU scalar where the
    # replicas share a GPU (no read per key and step); the log reads it
    # once per line, the same as a CPU run's.
    import json

    from test_updater import trainer

    from dasktrain import DistributedUpdater
    seen = []
    real = DistributedUpdater._means

    def means(self, values, n):
        out = real(self, values, n)
        seen.append({type(v).__module__.split('.')[0] for v in out.values()})
        return out
    monkeypatch.setattr(DistributedUpdater, '_means', means)
    logs = {}
    for devices in (['@cupy:0', '@cupy:0'], 'cpu:2'):
        out = tmp_path / str(len(logs))
        t, _ = trainer(lambda it, opt, devices=devices: DistributedUpdater(
            it, opt, devices=devices), out)
        t.run()
        logs[str(devices)] = json.loads((out / 'log').read_text())
    assert seen[0] == {'cupy'} and 'cupy' not in seen[-1]
    gpu, cpu = logs["['@cupy:0', '@cupy:0']"], logs['cpu:2']
    assert len(gpu) == len(cpu) == 2
    for a, b in zip(gpu, cpu):
        for key in ('main/loss', 'main/accuracy'):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
