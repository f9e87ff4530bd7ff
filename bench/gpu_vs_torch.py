"""One GPU side by side with PyTorch: `python bench/gpu_vs_torch.py`
(a few minutes on a GPU; `--device cpu` runs every row briefly on the CPU,
to catch errors where there is no GPU).

The same network on both sides: the seed post's net (three 5x5
convolutions, max pooling with Chainer's ``cover_all``, which is PyTorch's
``ceil_mode``, a spatial pyramid pooling of 1 + 4 + 16 bins, fc 4096 with
dropout, fc 10) and ResNet-20 (option A shortcuts, BatchNorm eps 2e-5,
momentum 0.1 = Chainer's decay 0.9), built by dasktrain and copied weight
for weight into PyTorch; the same batch (random CIFAR-shaped images and
labels, already on the GPU), Adam (lr 1e-3, betas 0.9/0.999, eps 1e-8),
softmax cross entropy without accuracy. TF32 off on both sides, then on on
both (PyTorch's matmul and cuDNN flags; CuPy's compute type and the
cuDNN graphs' engines). cuDNN autotuning is off on both sides
(``torch.backends.cudnn.benchmark = False``; heuristics on dasktrain's
graphs), neither side deterministic.

Rows, per model and TF32 setting, interleaved round by round (the best
round of each; the GPU is synchronised before and after each timed
window and never read in between):

* ``PyTorch eager``: the training step as a user writes it;
* ``Chainer, plain``: Chainer 7.8.1's own GPU path (im2col convolutions,
  its batch normalization), type checks on (Chainer's default);
* ``Chainer + dasktrain kernels, cuDNN off``: the project's batch
  normalization reductions alone;
* ``Chainer + dasktrain kernels``: cuDNN graphs too;
* ``... type checks off``: the same, ``chainer.config.type_check`` off;
* ``GPUDistributedGradient, 1 replica``: the wrapper's step on the same
  batch, its rules (kernels on, type checks off once a shape is checked);
* ``dasktrain train`` (``--pipeline``): the command on a synthetic
  CIFAR-shaped npz dataset, fed by the Dask pipeline (augmentation on the
  CPU), its images/s from the log against the wrapper's data-on-GPU rate.

Then the step split of each side, from one instrumented step: the GPU is
held by a 50 ms spin first, so the host queues the whole step before the
GPU starts it and CUDA events time the GPU's own work (forward, backward,
update; convolutions and batch normalization: Chainer's function hooks,
PyTorch's profiler); host time is the Python time to queue one step.
Prints Markdown tables headed by the GPU and versions.
"""
import argparse
import contextlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: goals: (row, against, at most this many times as slow)
GOALS = {'cifar10': 1.3, 'resnet20': 1.5}
CUDNN_GOAL = 1.2  # ResNet-20 with cuDNN graphs vs PyTorch eager


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--device', default='cuda', choices=('cuda', 'cpu'),
                   help='cuda (default), or cpu to check the script runs')
    p.add_argument('--models', default='cifar10,resnet20')
    p.add_argument('--batch', type=int, default=128,
                   help='images per step (default: %(default)s)')
    p.add_argument('--steps', type=int, default=30,
                   help='steps per timed round (default: %(default)s)')
    p.add_argument('--rounds', type=int, default=3,
                   help='timed rounds per row (default: %(default)s)')
    p.add_argument('--tf32', default='off,on',
                   help='TF32 settings to run (default: %(default)s)')
    p.add_argument('--pipeline', action=argparse.BooleanOptionalAction,
                   default=True, help='the dasktrain train rows')
    p.add_argument('--pipeline-images', type=int, default=20000,
                   help='training images of the synthetic dataset')
    args = p.parse_args(argv)
    if args.device == 'cpu':
        args.batch, args.steps, args.rounds = min(args.batch, 8), 2, 1
        args.pipeline_images = min(args.pipeline_images, 256)
    for name in ('batch', 'steps', 'rounds'):
        if getattr(args, name) < 1:
            p.error(f'--{name} must be >= 1, got {getattr(args, name)}')
    return args


# --- the PyTorch side ---------------------------------------------------

def torch_models():
    import torch
    import torch.nn as nn
    import torch.nn.functional as TF

    class Cifar10(nn.Module):
        """The seed net, as dasktrain.training.models.Cifar10."""

        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 32, 5, padding=2)
            self.conv2 = nn.Conv2d(32, 32, 5, padding=2)
            self.conv3 = nn.Conv2d(32, 64, 5, padding=2)
            self.fc4 = nn.Linear(1344, 4096)
            self.fc5 = nn.Linear(4096, 10)

        def forward(self, x):
            h = TF.max_pool2d(TF.relu(self.conv1(x)), 3, 2, ceil_mode=True)
            h = TF.max_pool2d(TF.relu(self.conv2(h)), 3, 2, ceil_mode=True)
            h = TF.relu(self.conv3(h))
            # Chainer's pyramid: 1, 2x2, 4x4 bins of max pooling, each
            # flattened channel-major, in that order (8x8 maps: exact)
            h = torch.cat([TF.adaptive_max_pool2d(h, b).flatten(1)
                           for b in (1, 2, 4)], 1)
            h = TF.dropout(TF.relu(self.fc4(h)), 0.5, self.training)
            return self.fc5(h)

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.stride, self.extra = stride, cout - cin
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout, eps=2e-5, momentum=0.1)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout, eps=2e-5, momentum=0.1)

        def forward(self, x):
            h = TF.relu(self.bn1(self.conv1(x)))
            h = self.bn2(self.conv2(h))
            s = x[:, :, ::self.stride, ::self.stride] if self.stride > 1 \
                else x
            if self.extra:
                s = TF.pad(s, (0, 0, 0, 0, 0, self.extra))
            return TF.relu(h + s)

    class ResNet20(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
            self.bn = nn.BatchNorm2d(16, eps=2e-5, momentum=0.1)
            blocks, c = [], 16
            for stage, width in enumerate((16, 32, 64)):
                for i in range(3):
                    blocks.append(Block(c, width, 2 if stage and not i
                                        else 1))
                    c = width
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(64, 10)

        def forward(self, x):
            h = self.blocks(TF.relu(self.bn(self.conv(x))))
            return self.fc(h.mean((2, 3)))

    return {'cifar10': Cifar10, 'resnet20': ResNet20}


def copy_weights(predictor, module):
    """Chainer's parameters and BatchNorm statistics into ``module``, by
    name (``blocks/0/conv1/W`` -> ``blocks.0.conv1.weight``)."""
    import torch
    names = {'W': 'weight', 'b': 'bias', 'gamma': 'weight', 'beta': 'bias',
             'avg_mean': 'running_mean', 'avg_var': 'running_var'}
    state = module.state_dict()
    done = set()
    for path, value in _chainer_arrays(predictor):
        *link, leaf = path.strip('/').split('/')
        key = '.'.join(link + [names[leaf]])
        if key not in state:
            raise KeyError(f'{path} has no PyTorch counterpart {key}')
        if tuple(state[key].shape) != value.shape:
            raise ValueError(f'{path} {value.shape} vs {key} '
                             f'{tuple(state[key].shape)}')
        state[key] = torch.as_tensor(np.asarray(value))
        done.add(key)
    left = {k for k in state if not k.endswith('num_batches_tracked')} - done
    if left:
        raise KeyError(f'not copied: {sorted(left)}')
    module.load_state_dict(state)


def _chainer_arrays(link):
    for path, p in link.namedparams():
        yield path, _host(p.array)
    for path, sub in link.namedlinks():
        for name in ('avg_mean', 'avg_var'):
            if hasattr(sub, name) and name in sub._persistent:
                yield f'{path}/{name}', _host(getattr(sub, name))


def _host(a):
    return a.get() if hasattr(a, 'get') else np.asarray(a)


def torch_flags(tf32):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = False


# --- the Chainer side ---------------------------------------------------

def cupy_tf32(tf32):
    """CuPy's float32 matrix products in TF32 or full float32 (its compute
    type, read at each product: cupy/_core/_routines_linalg.pyx)."""
    import cupy
    from cupy._core import _routines_linalg as linalg
    cupy._core.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32 if tf32
                                else linalg.COMPUTE_TYPE_DEFAULT)


@contextlib.contextmanager
def chainer_setting(kernels_on, cudnn, type_check, tf32):
    import chainer

    import dasktrain.kernels as kernels
    from dasktrain.numerics import TF32_KEY
    (kernels.install if kernels_on else kernels.uninstall)()
    try:
        with chainer.using_config('use_cudnn', 'auto' if cudnn else 'never'), \
                chainer.using_config('type_check', type_check), \
                chainer.using_config(TF32_KEY, tf32):
            yield
    finally:
        kernels.install()


# --- timing ---------------------------------------------------------------

class Clock:
    """Wall time of a window of steps, the device drained before and after
    it; ``host`` is the time the Python loop took to queue them."""

    def __init__(self, device):
        self.device = device

    def sync(self):
        if self.device == 'cuda':
            import cupy
            cupy.cuda.Device().synchronize()
            import torch
            torch.cuda.synchronize()

    def window(self, step, steps):
        self.sync()
        began = time.perf_counter()
        for _ in range(steps):
            step()
        queued = time.perf_counter()
        self.sync()
        ended = time.perf_counter()
        return (ended - began) / steps, (queued - began) / steps


def interleaved(clock, runs, steps, rounds, warmup=3):
    """{label: (best step s, its host s)}, each label's best round, the
    labels taking turns within each round."""
    for _label, step in runs:
        for _ in range(warmup):
            step()
    best = {label: (float('inf'), 0.0) for label, _ in runs}
    for _ in range(rounds):
        for label, step in runs:
            best[label] = min(best[label], clock.window(step, steps))
    return best


def spin(device, seconds=0.05):
    """Hold the GPU for ``seconds`` (a clock64 spin), so that what the host
    queues next waits for it."""
    if device != 'cuda':
        return
    import cupy
    kernel = cupy.RawKernel(r'''
    extern "C" __global__ void dasktrain_spin(long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) { }
    }''', 'dasktrain_spin')
    rate = cupy.cuda.runtime.getDeviceProperties(
        cupy.cuda.Device().id)['clockRate'] * 1e3  # kHz -> Hz
    kernel((1,), (1,), (np.int64(rate * seconds),))


class Events:
    """Named CUDA events on the current stream (CuPy's, which PyTorch's
    legacy default stream is too), read after a synchronise."""

    def __init__(self, device):
        self.device, self.marks = device, []

    def mark(self, name):
        if self.device == 'cuda':
            import cupy
            e = cupy.cuda.Event()
            e.record()
            self.marks.append((name, e))
        else:
            self.marks.append((name, time.perf_counter()))

    def spans(self):
        """ms between consecutive marks, by the later mark's name."""
        out = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            if self.device == 'cuda':
                b.synchronize()
                ms = __import__('cupy').cuda.get_elapsed_time(a, b)
            else:
                ms = 1000 * (b - a)
            out[name] = out.get(name, 0.0) + ms
        return out


def chainer_split(clock, step_parts, link):
    """(forward, backward, update, convolutions, batch norm) GPU ms of one
    step, and its host ms."""
    import chainer

    class Kinds(chainer.FunctionHook):
        name = 'dasktrain_split'

        def __init__(self, events):
            self.events, self.open = events, []

        def _kind(self, fn):
            label = type(fn).__name__
            if 'Convolution' in label:
                return 'conv'
            if 'BatchNormalization' in label:
                return 'bn'
            return None

        def forward_preprocess(self, fn, in_data):
            self._pre(fn)

        def forward_postprocess(self, fn, in_data):
            self._post(fn)

        def backward_preprocess(self, fn, in_data, out_grad):
            self._pre(fn)

        def backward_postprocess(self, fn, in_data, out_grad):
            self._post(fn)

        def _pre(self, fn):
            kind = self._kind(fn)
            if kind and not self.open:
                self.events.mark('other')
            self.open.append(kind)

        def _post(self, fn):
            kind = self.open.pop()
            if kind and kind not in self.open:
                self.events.mark(kind)

    events = Events(clock.device)
    clock.sync()
    spin(clock.device)
    began = time.perf_counter()
    forward, backward, update = step_parts
    with Kinds(events):
        events.mark('start')
        loss = forward()
        events.mark('forward')
        backward(loss)
        events.mark('backward')
    update()
    events.mark('update')
    host = time.perf_counter() - began
    clock.sync()
    phases = _phases(events.marks)
    kinds = events.spans()
    return phases, kinds.get('conv', 0.0), kinds.get('bn', 0.0), 1000 * host


def _phases(marks):
    names = [n for n, _ in marks]
    idx = [names.index(n) for n in ('start', 'forward', 'backward',
                                    'update')]
    out = []
    for a, b in zip(idx, idx[1:]):
        ea, eb = marks[a][1], marks[b][1]
        if isinstance(ea, float):
            out.append(1000 * (eb - ea))
        else:
            eb.synchronize()
            out.append(__import__('cupy').cuda.get_elapsed_time(ea, eb))
    return out


def torch_split(clock, model, opt, x, t):
    import torch
    import torch.nn.functional as TF
    dev = x.device
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)] \
        if dev.type == 'cuda' else None
    clock.sync()
    if dev.type == 'cuda':
        torch.cuda._sleep(int(torch.cuda.get_device_properties(
            dev).multi_processor_count and 5e7))
    began = time.perf_counter()
    marks = []

    def mark(i):
        if events:
            events[i].record()
        else:
            marks.append(time.perf_counter())
    mark(0)
    opt.zero_grad(set_to_none=True)
    loss = TF.cross_entropy(model(x), t)
    mark(1)
    loss.backward()
    mark(2)
    opt.step()
    mark(3)
    host = time.perf_counter() - began
    clock.sync()
    if events:
        phases = [events[i].elapsed_time(events[i + 1]) for i in range(3)]
    else:
        phases = [1000 * (marks[i + 1] - marks[i]) for i in range(3)]
    conv = bn = 0.0
    if dev.type == 'cuda':
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            opt.zero_grad(set_to_none=True)
            TF.cross_entropy(model(x), t).backward()
            opt.step()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            ms = (getattr(e, 'self_device_time_total', None) or
                  getattr(e, 'self_cuda_time_total', 0)) / 1000
            name = e.key.lower()
            if 'conv' in name:
                conv += ms
            elif 'batch_norm' in name:
                bn += ms
    return phases, conv, bn, 1000 * host


# --- one model ------------------------------------------------------------

def bench_model(name, tf32, args, clock):
    """The rows of ``name`` at one TF32 setting."""
    import chainer
    import torch
    import torch.nn.functional as TF

    from dasktrain.parallel import GPUDistributedGradient
    from dasktrain.training.models import get_model
    where = '@cupy:0' if args.device == 'cuda' else '@numpy'
    device = chainer.get_device(where)
    rng = np.random.default_rng(0)
    x_host = rng.standard_normal((args.batch, 3, 32, 32), dtype=np.float32)
    t_host = rng.integers(0, 10, args.batch).astype(np.int32)
    np.random.seed(0)
    link = get_model(name)
    link.compute_accuracy = False
    with chainer.using_config('train', False):  # lazy links, no BN update
        link.predictor(x_host[:2])
    tmodel = torch_models()[name]()
    copy_weights(link.predictor, tmodel)
    tdev = torch.device(args.device)
    tmodel.to(tdev).train()
    topt = torch.optim.Adam(tmodel.parameters(), lr=1e-3, betas=(0.9, 0.999),
                            eps=1e-8)
    tx = torch.as_tensor(x_host, device=tdev)
    tt = torch.as_tensor(t_host.astype(np.int64), device=tdev)
    link.to_device(device)
    copt = chainer.optimizers.Adam(alpha=1e-3, beta1=0.9, beta2=0.999,
                                   eps=1e-8)
    copt.setup(link)
    cx, ct = device.send(x_host), device.send(t_host)
    np.random.seed(0)
    wrapped = GPUDistributedGradient(get_model(name), [where])
    wrapped.setup(chainer.optimizers.Adam(alpha=1e-3))
    torch_flags(tf32)
    if args.device == 'cuda':
        cupy_tf32(tf32)

    def torch_step():
        topt.zero_grad(set_to_none=True)
        TF.cross_entropy(tmodel(tx), tt).backward()
        topt.step()

    def chainer_step(kernels_on, cudnn, type_check):
        def step():
            with chainer_setting(kernels_on, cudnn, type_check, tf32), \
                    chainer.using_device(device):
                copt.update(link, cx, ct)
        return step

    def wrapped_step():
        with chainer_setting(True, True, True, tf32):
            wrapped.step(cx, ct, observe=False)

    runs = [('PyTorch eager', torch_step),
            ('Chainer, plain', chainer_step(False, False, True)),
            ('Chainer + dasktrain kernels, cuDNN off',
             chainer_step(True, False, True)),
            ('Chainer + dasktrain kernels', chainer_step(True, True, True)),
            ('Chainer + dasktrain kernels, type checks off',
             chainer_step(True, True, False)),
            ('GPUDistributedGradient, 1 replica', wrapped_step)]
    best = interleaved(clock, runs, args.steps, args.rounds)
    base = best['PyTorch eager'][0]
    rows = []
    for label, (step_s, host_s) in best.items():
        rows.append((name, 'on' if tf32 else 'off', label, 1000 * step_s,
                     1000 * host_s, args.batch / step_s, step_s / base))
    splits = [('PyTorch eager', torch_split(clock, tmodel, topt, tx, tt))]
    for label, on, cudnn in (('Chainer, plain', False, False),
                             ('Chainer + dasktrain kernels', True, True)):
        with chainer_setting(on, cudnn, False, tf32), \
                chainer.using_device(device):
            def parts(link=link):
                link.cleargrads()
                return link(cx, ct)
            splits.append((label, chainer_split(
                clock, (parts, lambda loss: loss.backward(),
                        lambda: copt.update()), link)))
    return rows, [(name, 'on' if tf32 else 'off', label, *s)
                  for label, s in splits], best


def pipeline_rows(name, args, wrapped_rate, workdir):
    """``dasktrain train`` on a synthetic npz dataset: images/s of its
    last epochs, against the wrapper's data-on-GPU rate."""
    import json
    rng = np.random.default_rng(1)
    n = args.pipeline_images
    data = Path(workdir) / 'synthetic.npz'
    if not data.exists():
        np.savez(data, x_train=rng.integers(0, 256, (n, 32, 32, 3),
                                            dtype=np.uint8),
                 y_train=rng.integers(0, 10, n).astype(np.int64),
                 x_test=rng.integers(0, 256, (1000, 32, 32, 3),
                                     dtype=np.uint8),
                 y_test=rng.integers(0, 10, 1000).astype(np.int64))
    out = Path(workdir) / f'run-{name}'
    command = [sys.executable, '-c', 'import sys; from dasktrain.entry '
               'import main; sys.exit(main())', 'train',
               '--model', name, '--dataset', f'npz:{data}',
               '--batch-size', str(args.batch), '--epochs',
               '3' if args.device == 'cuda' else '1', '--out', str(out),
               '--devices', '0' if args.device == 'cuda' else 'cpu',
               '--test-size', '1000' if args.device == 'cuda' else '64']
    began = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    wall = time.perf_counter() - began
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return [(name, 'dasktrain train (Dask pipeline)', 'failed: ' +
                 ' / '.join(tail), '', '')]
    log = json.loads((out / 'log').read_text())
    rate = max(row['images_per_sec'] for row in log[1:] or log)
    wait = log[-1].get('data_wait_time', 0.0)
    return [(name, 'dasktrain train (Dask pipeline), images/s',
             f'{rate:,.0f}', f'{rate / wrapped_rate:.2f}x',
             f'data wait {wait:.2f} s in its last epoch; {wall:.0f} s in '
             f'all')]


def header(args):
    lines = []
    try:
        import cupy
        import torch

        import dasktrain.kernels as kernels
        props = cupy.cuda.runtime.getDeviceProperties(0) \
            if args.device == 'cuda' else None
        gpu = props['name'].decode() if props else 'none (--device cpu)'
        status = kernels.status() if args.device == 'cuda' else {}
        lines += [f'GPU: {gpu}; PyTorch {torch.__version__} (cuDNN '
                  f'{torch.backends.cudnn.version()}), CuPy '
                  f'{cupy.__version__}, Chainer '
                  f'{__import__("chainer").__version__}; dasktrain cuDNN '
                  f'graphs: {status.get("cudnn", "not loaded (CPU)")}']
    except Exception as e:  # the versions line says what is missing
        lines.append(f'versions: {type(e).__name__}: {e}')
    lines.append(f'Machine: {platform.processor() or platform.machine()}, '
                 f'{os.cpu_count()} cores, Python '
                 f'{platform.python_version()}, NumPy {np.__version__}')
    lines.append(f'Batch {args.batch}, {args.steps} steps per round, best '
                 f'of {args.rounds} interleaved rounds; Adam; autotuning '
                 'off; not deterministic; data on the device unless said.')
    return lines


def main(argv=None):
    args = parse(argv)
    try:
        import chainer  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        print(f'gpu_vs_torch: {e.name} is not installed here', file=sys.stderr)
        return 2
    if args.device == 'cuda':
        from dasktrain.parallel.devices import gpu_count
        count, why = gpu_count()
        if not count:
            print(f'gpu_vs_torch: no GPU here ({why}); --device cpu runs '
                  'the rows on the CPU', file=sys.stderr)
            return 1
    clock = Clock(args.device)
    print('\n'.join(header(args)) + '\n')
    rows, splits, wrapped = [], [], {}
    for name in args.models.split(','):
        for setting in args.tf32.split(','):
            r, s, best = bench_model(name, setting == 'on', args, clock)
            rows += r
            splits += s
            if setting == 'off':
                step = best['GPUDistributedGradient, 1 replica'][0]
                wrapped[name] = args.batch / step
    print('| model | TF32 | row | step ms | host ms | images/s | vs '
          'PyTorch |\n|---|---|---|---:|---:|---:|---:|')
    for name, tf32, label, ms, host, ips, ratio in rows:
        print(f'| {name} | {tf32} | {label} | {ms:.2f} | {host:.2f} | '
              f'{ips:,.0f} | {ratio:.2f}x |')
    print('\nStep split (one step, GPU ms from CUDA events after a 50 ms '
          'spin; host ms: Python time to queue the step)\n')
    print('| model | TF32 | side | forward | backward | update | '
          'convolutions | batch norm | host |\n'
          '|---|---|---|---:|---:|---:|---:|---:|---:|')
    for name, tf32, label, phases, conv, bn, host in splits:
        f, b, u = phases
        print(f'| {name} | {tf32} | {label} | {f:.2f} | {b:.2f} | {u:.2f} '
              f'| {conv:.2f} | {bn:.2f} | {host:.2f} |')
    print('\nGoals (TF32 off)\n\n| measure | goal | measured | met |\n'
          '|---|---|---:|---|')
    for name, goal in GOALS.items():
        mine = [r for r in rows if r[0] == name and r[1] == 'off']
        if not mine:
            continue
        by = {r[2]: r for r in mine}
        ratio = by['Chainer + dasktrain kernels, type checks off'][6]
        print(f'| {name} step vs PyTorch | <= {goal}x | {ratio:.2f}x | '
              f'{"yes" if ratio <= goal else "no"} |')
        if name == 'resnet20':
            print(f'| ResNet-20 with cuDNN graphs vs PyTorch eager | <= '
                  f'{CUDNN_GOAL}x | {ratio:.2f}x | '
                  f'{"yes" if ratio <= CUDNN_GOAL else "no"} |')
        over = by['GPUDistributedGradient, 1 replica'][3] / \
            by['Chainer + dasktrain kernels, type checks off'][3] - 1
        print(f'| {name} wrapper over its plain loop | <= 3 % | '
              f'{100 * over:.1f} % | {"yes" if over <= 0.03 else "no"} |')
    if args.device == 'cuda':
        import dasktrain.kernels as kernels
        status = kernels.status()
        refused = {}
        for key, why in status['unbuildable'].items():
            refused.setdefault((key[0], why), []).append(key[2:4])
        print(f"\ncuDNN graphs: {status['cudnn']}; {status['graphs']} kept"
              + ''.join(f'\n- refused {kind} ({len(shapes)} shapes, e.g. '
                        f'{shapes[0]}): {why}'
                        for (kind, why), shapes in refused.items()))
    if args.pipeline:
        print('\n| model | row | value | vs data on the device | note |\n'
              '|---|---|---:|---:|---|')
        with tempfile.TemporaryDirectory(prefix='gpu-vs-torch-') as work:
            for name in args.models.split(','):
                for row in pipeline_rows(name, args, wrapped[name], work):
                    print('| ' + ' | '.join(map(str, row)) + ' |')
        print('\nGoal: `dasktrain train` images/s >= 0.95x the wrapper\'s '
              'data-on-device rate.')
    return 0


if __name__ == '__main__':
    sys.exit(main())
