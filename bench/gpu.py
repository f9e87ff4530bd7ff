"""What dasktrain does on this machine's GPUs, in one short run:
`python bench/gpu.py` (a few minutes; `make test-gpu` not needed).

* the seed network's step on one GPU: a plain Chainer loop (sending each
  batch) against ``GPUDistributedGradient.step``, interleaved round by
  round, the best round of each;
* NCCL's all-reduce of the seed network's gradients (22.5 MB of float32,
  and the same count in float16) between two GPUs, each rank a process of
  its own, as training runs it (skipped on one GPU, saying so);
* dg steps between two ranks, one GPU each: one all-reduce after the
  backward pass, 4 MiB buckets overlapped with it (the default), the same
  in float16 (one collective per bucket), and double buffering (corrected
  stale steps from the first step): step time and the communication each
  step still waits for. On one GPU the two ranks share it and sum over
  Dask's shared memory (what GPU ranks without NCCL do), and the rows say
  so;
* a float16 bucket of all the gradients filled with its probes: two
  fused kernels against array by array;
* a host all-gather of a few numbers: what float16 on the wire cost per
  bucket before its scales rode in the all-reduce itself;
* dg steps on one GPU with gradient buckets through a one-rank NCCL
  communicator posing as two ranks (timing only): buckets queued one
  after another against waiting for each;
* one NCCL call's cost on a one-rank communicator: after 0, 50 and
  500 us and 5 ms of GPU work, the host polling the stream sleeping 100 us
  between queries, yielding, as ``NcclComm`` does (comm.base.pause), or
  blocked in a synchronise; and 4 KiB to 22.5 MB through ``NcclComm.allreduce``
  against calls queued in stream order with one synchronise at the end
  (the floor NCCL and the GPU set).

Prints a Markdown table headed by the GPUs (CuPy's names and versions)
and the host. Without a GPU it says so in one line and exits with 1.
"""
import argparse
import statistics
import sys
import time

import numpy as np

CONFIGS = (
    ('one all-reduce after the backward pass', dict(bucket_mb=0)),
    ('4 MiB buckets overlapped (default)', dict(bucket_mb=4)),
    ('4 MiB buckets, float16 on the wire',
     dict(bucket_mb=4, comm_dtype='float16')),
    ('double buffering (corrected)',
     dict(double_buffering=True, warmup=0)),
)


def rank_layout(entries, nccl):
    """(each rank's CUDA_VISIBLE_DEVICES entry, how they sum) for two
    ranks given this machine's GPU ``entries`` and whether NCCL can be
    used.

    >>> rank_layout(['0', '1', '2'], True)
    (['0', '1'], 'NCCL')
    >>> rank_layout(['GPU-a'], True)
    (['GPU-a', 'GPU-a'], 'Dask shared memory, both ranks on one GPU')
    """
    if len(entries) >= 2:
        return list(entries[:2]), 'NCCL' if nccl else \
            'Dask shared memory (no NCCL)'
    return [entries[0]] * 2, 'Dask shared memory, both ranks on one GPU'


def version(code):
    """'12.4' for CUDA's 12040.

    >>> version(12040), version(11080)
    ('12.4', '11.8')
    """
    return f'{code // 1000}.{code % 1000 // 10}'


def gpu_line(names, runtime, driver, cupy_version, nccl):
    """One line naming the GPUs and the software under them.

    >>> gpu_line(['NVIDIA H100 80GB HBM3'] * 2, 12040, 12080, '13.3.0',
    ...          '2.21.5')
    '2 x NVIDIA H100 80GB HBM3 (CUDA runtime 12.4, driver 12.8, CuPy 13.3.0, NCCL 2.21.5)'
    """  # noqa: E501
    kinds = {n: names.count(n) for n in names}
    gpus = ', '.join(f'{k} x {n}' for n, k in kinds.items())
    return (f'{gpus} (CUDA runtime {version(runtime)}, driver '
            f'{version(driver)}, CuPy {cupy_version}, NCCL {nccl})')


def rank_rows(results, how, mbytes):
    """Rows from each rank's measurements (the slower rank's figures)."""
    rows = []
    if 'allreduce' in results[0]:
        for dtype, factor in (('float32', 1), ('float16', 0.5)):
            seconds = max(r['allreduce'][dtype] for r in results)
            rows.append((f'NCCL all-reduce, {mbytes * factor:g} MB of '
                         f'{dtype}, 2 GPUs', 1000 * seconds, 'ms'))
            rows.append(('  bus bandwidth', mbytes * factor / 1000 /
                         seconds, 'GB/s'))
    else:
        why = 'this machine has one GPU' if 'one GPU' in how else \
            'NCCL cannot be used here'
        rows.append((f'NCCL all-reduce, {mbytes:g} MB, 2 GPUs',
                     f'skipped: {why}', ''))
    rows.append(('host all-gather of a few floats (float16: per bucket, '
                 'before)', 1000 * max(r['allgather'] for r in results),
                 'ms'))
    base = None
    for label, _ in CONFIGS:
        step = max(r[label][0] for r in results)
        exposed = max(r[label][1] for r in results)
        rows.append((f'dg step, 2 ranks, {label}', 1000 * step, 'ms'))
        rows.append(('  communication waited for', 1000 * exposed, 'ms'))
        if base is None:
            base = step
        else:
            rows.append(('  speed-up vs after the backward pass',
                         f'{base / step:.2f}x', ''))
    rows.append(('ranks sum over', how, ''))
    return rows


def _data(batch, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, 3, 32, 32), dtype=np.float32),
            rng.integers(0, 10, batch).astype(np.int32))


def _sync(device):
    """Wait for the GPU's queued work (nothing on the CPU, where this
    script's functions run in its tests)."""
    if device != '@numpy':
        import cupy
        cupy.cuda.Device(0).synchronize()


def _best(runs, rounds):
    """Each callable's shortest round, run in turns (noise hits all)."""
    best = [float('inf')] * len(runs)
    for _ in range(rounds):
        for i, run in enumerate(runs):
            best[i] = min(best[i], run())
    return best


def one_gpu(model, batch, steps, rounds, where='@cupy:0'):
    """Rows: ms per step on GPU 0, plain Chainer loop and the wrapper."""
    import chainer

    from dasktrain.parallel import GPUDistributedGradient
    from dasktrain.training.models import get_model
    device = chainer.get_device(where)
    x, t = _data(batch)
    np.random.seed(0)
    link = get_model(model)
    link.to_device(device)
    plain = chainer.optimizers.Adam()
    plain.setup(link)
    wrapped = GPUDistributedGradient(get_model(model), [where])
    wrapped.setup(chainer.optimizers.Adam())

    def timed(step):
        def run():
            _sync(where)
            began = time.perf_counter()
            for _ in range(steps):
                step()
            _sync(where)
            return (time.perf_counter() - began) / steps
        return run

    def plain_step():
        with chainer.using_device(device):
            plain.update(link, device.send(x), device.send(t))
    runs = [timed(plain_step), timed(lambda: wrapped.step(
        x, t, observe=False))]
    for run in runs:
        run()  # warm-up: cuDNN's algorithms, the memory pool
    plain_s, wrapped_s = _best(runs, rounds)
    cuda = chainer.backends.cuda
    return [('cuDNN', 'on' if cuda.cudnn_enabled and device.xp is not np
             else 'off', ''),
            (f'step, plain Chainer loop, 1 GPU, batch {batch}',
             1000 * plain_s, 'ms'),
            ('  images/s', batch / plain_s, 'images/s'),
            ('step, GPUDistributedGradient, 1 GPU', 1000 * wrapped_s, 'ms'),
            ('  wrapper overhead vs plain loop',
             f'{100 * (wrapped_s / plain_s - 1):.1f} %', '')]


def _rank(name, rank, size, nccl, model, batch, steps, rounds, mbytes,
          iterations, where='@cupy:0'):
    """One rank on its worker: the all-reduce, the all-gather and the dg
    configurations, each its best round (seconds)."""
    import chainer

    from dasktrain.parallel import GPUDistributedGradient
    from dasktrain.parallel.comm import DaskComm, NcclComm
    from dasktrain.training.models import get_model
    out = {}

    def laps(work, n, barrier):
        times = []
        for _ in range(n):
            barrier()  # start together
            _sync(where)
            began = time.perf_counter()
            work()
            _sync(where)
            times.append(time.perf_counter() - began)
        return times

    with DaskComm.rendezvous(name, rank, size, timeout=300) as host:
        comm = NcclComm(host, 0) if nccl else host
        barrier = lambda: host.allgather(None)  # noqa: E731
        try:
            with chainer.using_device(chainer.get_device(where)):
                out['allgather'] = statistics.median(laps(
                    lambda: host.allgather([1.0] * 8), iterations, barrier))
                if nccl:
                    out['allreduce'] = {}
                    import cupy
                    for dtype in ('float32', 'float16'):
                        buf = cupy.zeros(int(mbytes * 1e6 / 4), dtype)
                        comm.allreduce([buf])
                        out['allreduce'][dtype] = statistics.median(laps(
                            lambda buf=buf: comm.allreduce([buf]), iterations,
                            barrier))
                x, t = _data(batch, rank)
                for label, options in CONFIGS:
                    np.random.seed(0)
                    m = GPUDistributedGradient(get_model(model), [where],
                                               comm=comm, **options)
                    m.setup(chainer.optimizers.Adam())
                    for _ in range(3):  # buckets' order, then scales
                        m.step(x, t, total=batch * size, observe=False)
                    m.end_epoch()  # nothing in flight: a barrier may run
                    barrier()
                    best = (float('inf'), 0.0)

                    def run(m=m):  # no wait between steps: what overlaps
                        for _ in range(steps):  # goes on overlapping
                            m.step(x, t, total=batch * size, observe=False)
                    for _ in range(rounds):  # in step: the sums pace them
                        spent = m.comm_time
                        (lap,) = laps(run, 1, lambda: None)
                        best = min(best, (lap / steps,
                                          (m.comm_time - spent) / steps))
                    m.end_epoch()
                    out[label] = best
        finally:
            if comm is not host:
                comm.close()
    return out


def two_ranks(entries, nccl, args, where='@cupy:0'):
    """Each rank's measurements, on two throwaway workers (one GPU each,
    by ``entries``: CUDA_VISIBLE_DEVICES)."""
    from distributed import Client, Nanny, Scheduler, SpecCluster
    from distributed.security import Security
    # _rank travels by value from __main__ (Dask cloudpickles what names
    # __main__), by reference when imported: then the workers, which
    # multiprocessing starts with this sys.path, import this file too.
    security = Security.temporary()  # 127.0.0.1, TLS: no one else's code
    common = {'host': '127.0.0.1', 'protocol': 'tls', 'security': security}
    workers = {f'rank{i}': {'cls': Nanny, 'options': dict(
        common, nthreads=1, resources={'GPU': 1}, dashboard_address=None,
        env={'CUDA_VISIBLE_DEVICES': entry, 'OMP_NUM_THREADS': '1'})}
        for i, entry in enumerate(entries)}
    scheduler = {'cls': Scheduler, 'options': dict(
        common, dashboard_address=None)}
    with SpecCluster(workers=workers, scheduler=scheduler,
                     security=security) as cluster, \
            Client(cluster, security=security) as client:
        client.wait_for_workers(2)
        addresses = sorted(client.scheduler_info()['workers'])
        return client.gather([client.submit(
            _rank, 'bench-gpu', r, 2, nccl, args.model, args.batch_size,
            args.steps, args.rounds, args.mbytes, args.iterations, where,
            workers=[w], resources={'GPU': 1}, pure=False)
            for r, w in enumerate(addresses)])


def nccl_bucket_rows(model, batch, steps, rounds, sizes_mb=(1, 4)):
    """Rows: dg steps on one GPU whose gradient buckets go through a
    one-rank NCCL communicator posing as one of two ranks (the sums are
    one rank's: timing only): buckets queued one after another (NCCL
    orders them on the side stream) against waiting for each before the
    next, the host polling as dasktrain does."""
    import chainer

    from dasktrain.parallel import GPUDistributedGradient
    from dasktrain.parallel.comm import NcclComm
    from dasktrain.parallel.comm.base import Communicator
    from dasktrain.training.models import get_model

    class AsTwo(Communicator):
        solo, sums_on_device = False, True

        def __init__(self, nccl, queued):
            super().__init__(0, 2, nccl.timeout)
            self.nccl, self.queued = nccl, queued

        def allreduce(self, arrays, check=False):
            return self.nccl.allreduce(arrays)

        def allreduce_queued(self, arrays):
            if self.queued:
                return self.nccl.allreduce_queued(arrays)
            return self.nccl.allreduce(arrays)

        def finish_queued(self):
            self.nccl.finish_queued()

        def allgather(self, obj):
            return [obj, obj]

        def gather(self, obj):
            return [obj, obj]

        def bcast(self, obj):
            return obj

        def close(self):
            pass

    x, t = _data(batch)
    nccl = NcclComm(_Alone(), 0)
    rows = []
    try:
        with chainer.using_device(chainer.get_device('@cupy:0')):
            for mb in sizes_mb:
                runs, models = [], []
                for queued in (True, False):
                    np.random.seed(0)
                    m = GPUDistributedGradient(
                        get_model(model), ['@cupy:0'],
                        comm=AsTwo(nccl, queued), bucket_mb=mb)
                    m.setup(chainer.optimizers.Adam())
                    for _ in range(3):  # the buckets' order, then warm
                        m.step(x, t, total=2 * batch, observe=False)
                    models.append(m)

                    def run(m=m):
                        _sync('@cupy:0')
                        spent, began = m.comm_time, time.perf_counter()
                        for _ in range(steps):
                            m.step(x, t, total=2 * batch, observe=False)
                        _sync('@cupy:0')
                        return ((time.perf_counter() - began) / steps,
                                (m.comm_time - spent) / steps)
                    runs.append(run)
                best = [(float('inf'), 0.0)] * 2
                for _ in range(rounds):  # interleaved
                    for i, run in enumerate(runs):
                        best[i] = min(best[i], run())
                buckets = len(models[0].exchange.plan)
                for (step, exposed), how in zip(best, (
                        'queued, one wait', 'waiting for each')):
                    rows.append((f'dg step, 1 GPU, NCCL posing as 2 ranks, '
                                 f'{mb:g} MiB buckets ({buckets}), {how}',
                                 1000 * step, 'ms'))
                    rows.append(('  communication waited for',
                                 1000 * exposed, 'ms'))
    finally:
        nccl.close()
    return rows


def fill_rows(model, iterations, device='@cupy:0'):
    """Rows: ms to fill one float16 bucket of all of ``model``'s
    gradients with their probes, by the two fused kernels and array by
    array (what each step's communication thread launches)."""
    import chainer
    import cupy

    import dasktrain.parallel.exchange.flat as flat_module
    from dasktrain.parallel.exchange.buckets import parameters
    from dasktrain.training.models import get_model
    link = get_model(model)
    where = chainer.get_device(device)
    link.to_device(where)
    params = parameters(link)
    grads = [cupy.ones_like(p.array) for p in params]
    plan = [list(range(len(params)))]
    scales, factors = [2.0 ** -3] * len(grads), [2.0 ** -12] * len(grads)
    rows, fusable = [], flat_module.fusable
    with chainer.using_device(where):
        for label, fused in (('two fused kernels', True),
                             ('array by array', False)):
            flat_module.fusable = fusable if fused else \
                (lambda grads: False)
            try:
                flat = flat_module.FlatBuckets(params, plan, where,
                                               np.dtype('float16'),
                                               probes=True)
                flat.fill(0, grads, scales, probes=factors)  # compiled
                cupy.cuda.get_current_stream().synchronize()
                began = time.perf_counter()
                for _ in range(iterations):
                    flat.fill(0, grads, scales, probes=factors)
                cupy.cuda.get_current_stream().synchronize()
                seconds = (time.perf_counter() - began) / iterations
            finally:
                flat_module.fusable = fusable
            rows.append((f'float16 fill of {len(grads)} gradients with '
                         f'probes, {label}', 1000 * seconds, 'ms'))
    return rows


class _Alone:
    """The host communicator of a one-rank NCCL communicator: rank 0 of
    1, a deadline, and the unique id handed to itself."""
    rank, size, timeout = 0, 1, 60.0

    def bcast(self, obj):
        return obj


SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
'''

#: How the host can wait for a queued NCCL call: (label, seconds to sleep
#: between queries given the seconds waited so far; None: a blocking
#: synchronise, which has no deadline).
WAITS = (
    ('polls, sleeping 100 us', lambda waited: 1e-4),
    ('polls, yielding (sleep 0)', lambda waited: 0.0),
    ('polls as dasktrain does (comm.base.pause)', None),
    ('blocking synchronise (no deadline)', None),
)


def call_floor(sizes_mb, iterations, device=0,
               spins_us=(0, 50, 500, 5000)):
    """Rows: ms per NCCL all-reduce on a one-rank communicator, the host
    waiting each of the ways in :data:`WAITS`, after a kernel that keeps
    the stream busy for ``spins_us`` microseconds (what a peer's lateness
    or the sum's own time would), and the calls of each size in ``sizes_mb``
    queued in stream order with one synchronise at the end (the floor
    NCCL and the GPU set)."""
    import cupy
    from cupy.cuda import nccl

    from dasktrain.parallel.comm import NcclComm
    from dasktrain.parallel.comm.base import pause
    comm = NcclComm(_Alone(), device)
    rows = []
    try:
        with cupy.cuda.Device(device):
            stream = cupy.cuda.get_current_stream()
            kernel = cupy.RawKernel(SPIN, 'spin')

            def queue(buf):
                # NcclComm._call: a non-blocking communicator may answer
                # 'in progress' to a call it has queued
                comm._call(comm._comm.allReduce, buf.data.ptr, buf.data.ptr,
                           buf.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                           stream.ptr)
                while not comm._settled():  # until it is on the stream
                    pass

            def timed(run, n):
                stream.synchronize()
                began = time.perf_counter()
                for _ in range(n):
                    run()
                stream.synchronize()
                return (time.perf_counter() - began) / n

            # the GPU's clock64 rate, from one long spin
            kernel((1,), (1,), (1 << 26,))
            rate = (1 << 26) / timed(
                lambda: kernel((1,), (1,), (1 << 26,)), 3)
            small = cupy.zeros(1024, 'float32')
            comm.allreduce([small])  # warm-up: NCCL's first launch
            for us in spins_us:
                cycles = int(rate * us * 1e-6)
                spin = timed(lambda c=cycles: kernel((1,), (1,), (c,)),
                             iterations) if cycles else 0.0
                for label, sleep in WAITS:
                    if label.startswith('polls as dasktrain'):
                        sleep = pause

                    def once(c=cycles, sleep=sleep):
                        if c:
                            kernel((1,), (1,), (c,))
                        queue(small)
                        if sleep is None:
                            stream.synchronize()
                            return
                        began = time.monotonic()
                        while not comm._done(stream):
                            waited = time.monotonic() - began
                            if waited > 60:
                                raise RuntimeError('NCCL call hung')
                            time.sleep(sleep(waited))
                    seconds = timed(once, iterations)
                    rows.append((f'NCCL call, 1 rank, 4 kB, after '
                                 f'{1e6 * spin:.0f} us of GPU work: host '
                                 f'{label}', 1000 * seconds, 'ms'))
            for mb in sizes_mb:
                buf = cupy.zeros(max(1, int(mb * 1e6 / 4)), 'float32')
                comm.allreduce([buf])
                size = f'{mb * 1000:g} kB' if mb < 1 else f'{mb:g} MB'
                rows += [
                    (f'NCCL call, 1 rank, {size}: NcclComm.allreduce',
                     1000 * timed(lambda b=buf: comm.allreduce([b]),
                                  iterations), 'ms'),
                    ('  calls in stream order, one synchronise',
                     1000 * timed(lambda b=buf: queue(b), iterations),
                     'ms')]
    finally:
        comm.close()
    return rows


def machine_gpus(count):
    import cupy

    from dasktrain.parallel.gpus import nccl_version
    names = [cupy.cuda.runtime.getDeviceProperties(i)['name'].decode()
             for i in range(count)]
    try:
        from cupy.cuda import nccl
        found = nccl_version(int(nccl.get_version())) \
            if nccl.available else None
    except Exception:  # no NCCL library at all
        found = None
    return gpu_line(names, cupy.cuda.runtime.runtimeGetVersion(),
                    cupy.cuda.runtime.driverGetVersion(), cupy.__version__,
                    '.'.join(map(str, found)) if found else 'none')


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', default='cifar10',
                        help='network (default: %(default)s, the seed '
                             "post's)")
    parser.add_argument('--batch-size', type=int, default=100,
                        help='per GPU (default: %(default)s)')
    parser.add_argument('--steps', type=int, default=10,
                        help='timed steps per round (default: %(default)s)')
    parser.add_argument('--rounds', type=int, default=3,
                        help='rounds, the best kept (default: %(default)s)')
    parser.add_argument('--mbytes', type=float, default=22.5,
                        help='all-reduce size in MB of float32 (default: '
                             "%(default)s, the seed network's gradients)")
    parser.add_argument('--iterations', type=int, default=10,
                        help='timed all-reduces (default: %(default)s)')
    parser.add_argument('--floor-sizes', default='0.004,1,4,22.5',
                        help='MB per one-rank NCCL call, comma-separated '
                             '(default: %(default)s)')
    args = parser.parse_args(argv)
    from dasktrain.parallel.devices import free_gpu_memory, gpu_count
    count, reason = gpu_count()
    if count == 0:
        print(f'bench/gpu.py: no GPU here ({reason}); nothing to measure',
              file=sys.stderr)
        return 1
    from dasktrain.bench.benchmarks import table
    from dasktrain.parallel.gpus import nccl_problem, visible_gpus
    try:
        from cupy.cuda import nccl
    except Exception:  # CuPy without its NCCL module: Dask's sums
        nccl = None
    rows = one_gpu(args.model, args.batch_size, args.steps, args.rounds)
    rows += fill_rows(args.model, max(args.iterations, 20))
    free_gpu_memory([0])
    entries, how = rank_layout(visible_gpus(count=count),
                               nccl_problem(nccl) is None)
    rows += rank_rows(two_ranks(entries, how == 'NCCL', args), how,
                      args.mbytes)
    if nccl_problem(nccl) is None:
        rows += nccl_bucket_rows(args.model, args.batch_size, args.steps,
                                 args.rounds)
        rows += call_floor([float(s) for s in args.floor_sizes.split(',')],
                           max(args.iterations, 20))
    else:
        rows.append(('NCCL call, 1 rank', 'skipped: '
                     f'{nccl_problem(nccl)}', ''))
    print(table(rows, f'bench/gpu.py (model={args.model}, batch '
                      f'{args.batch_size} per GPU)\n\nGPUs: '
                      f'{machine_gpus(count)}'))
    return 0


if __name__ == '__main__':
    sys.exit(main())
