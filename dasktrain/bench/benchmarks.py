"""Benchmarks behind ``dasktrain bench``: augmentation and training
throughput (:func:`bench_augment`, :func:`bench_train`), and what every
benchmark shares: the machine, the table, synthetic CIFAR-format data.
The run across Dask workers is :mod:`~dasktrain.bench.scaleout`'s, the
all-reduce's :mod:`~dasktrain.bench.allreduce`'s.

Each benchmark returns rows of (measure, value, unit) and the CLI prints
them as a Markdown table headed by the machine they ran on, ready for the
README.
"""
import math
import os
import platform
import time

import numpy as np


def machine():
    """One line naming this machine: CPU, cores, memory, Python, NumPy."""
    cpu = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    cpu = line.split(':', 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        memory = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
        memory = f', {memory / 2**30:.0f} GiB'
    except (ValueError, OSError, AttributeError):
        memory = ''
    return (f'{cpu}, {os.cpu_count()} cores{memory}, Python '
            f'{platform.python_version()}, NumPy {np.__version__}')


def table(rows, title):
    """Markdown table of (measure, value, unit) rows under a title line."""
    lines = [f'{title}', '', f'Machine: {machine()}', '',
             '| measure | value | unit |', '|---|---:|---|']
    for measure, value, unit in rows:
        text = f'{value:,.3f}' if isinstance(value, float) and value < 10 \
            else f'{value:,.0f}' if isinstance(value, (int, float)) else value
        lines.append(f'| {measure} | {text} | {unit} |')
    return '\n'.join(lines)


def best_of(fn, repeats):
    """The shortest of ``repeats`` timed calls of ``fn``, in seconds,
    after one untimed call (page faults, imports, thread pools)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


def bench_augment(n_images=50000, chunk=2500, repeats=3, cores=None,
                  padding='zero', trainer_rate=3846.0, epochs=3):
    """Throughput of crop+flip+normalise: one core, Dask on all cores.

    Parameters
    ----------
    n_images : int, default 50000
        Images per epoch (CIFAR-10's training set).
    chunk : int, default 2500
        Images per chunk (dasktrain.data.augment.DEFAULT_CHUNK).
    repeats : int, default 3
        Timed repetitions; the best is reported.
    cores : int, optional
        Workers for the parallel runs; default all cores.
    padding : {'zero', 'reflect'}, default 'zero'
    trainer_rate : float, default 3846.0
        Images/s of the simulated trainer consuming the prefetched epochs
        (default: the seed post's 4-GPU run, 50,000 images in 13 s).
    epochs : int, default 3
        Epochs the simulated trainer consumes.
    """
    import dask.array as da
    from distributed import Client, LocalCluster, wait

    from dasktrain.data.augment import augment, augment_block
    from dasktrain.data.loader import EpochLoader
    cores = cores or os.cpu_count()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n_images, 3, 32, 32), dtype=np.uint8)
    rows = []

    one = best_of(lambda: augment_block(x[:10000], 0, 0, 0, padding=padding),
                repeats)
    rate_one = 10000 / one
    rows.append(('one chunk of 10,000, one core', rate_one, 'images/s'))

    # As EpochLoader does: chunks stored into a reused buffer.
    arr = augment(da.from_array(x, chunks=chunk), 0, 0, padding=padding)
    out = np.empty(arr.shape, np.float32)

    def store(workers):
        return lambda: da.store(arr, out, lock=False, scheduler='threads',
                                num_workers=workers)
    serial = best_of(store(1), repeats)
    threads = best_of(store(cores), repeats)
    rows += [('Dask threads, 1 worker', n_images / serial, 'images/s'),
             (f'Dask threads, {cores} workers', n_images / threads,
              'images/s'),
             ('parallel efficiency vs one chunk on one core',
              f'{100 * n_images / threads / (cores * rate_one):.0f} %', ''),
             ('parallel efficiency vs Dask with 1 worker',
              f'{100 * serial / threads / cores:.0f} %', ''),
             (f'full epoch of {n_images} images ({cores} threads)', threads,
              's')]

    with LocalCluster(n_workers=cores, threads_per_worker=1, processes=True,
                      host='127.0.0.1', dashboard_address=None) as cluster, \
            Client(cluster) as client:
        source = client.scatter(x, broadcast=True)
        inputs = da.from_delayed(source, x.shape, dtype=x.dtype) \
            .rechunk((chunk, -1, -1, -1)).persist()
        wait(inputs)

        runs = iter(range(repeats + 1))

        def on_workers():
            # A new epoch each run: the same keys would be found in memory.
            out = client.persist(augment(inputs, 0, next(runs),
                                         padding=padding))
            wait(out)
            client.cancel(out)
        processes = best_of(on_workers, repeats)
    rows += [(f'Dask processes, {cores} workers (result kept on workers)',
              n_images / processes, 'images/s'),
             ('parallel efficiency (processes)',
              f'{100 * n_images / processes / (cores * rate_one):.0f} %', '')]

    batch = 400
    labels = np.zeros(n_images, np.int32)
    with EpochLoader(da.from_array(x, chunks=chunk), labels, batch,
                     augment_options={'padding': padding},
                     epochs=epochs) as loader:
        epoch_times = []
        for epoch in range(epochs):
            began = time.perf_counter()
            for _ in loader.epoch(epoch):
                time.sleep(batch / trainer_rate)
            epoch_times.append(time.perf_counter() - began)
        waits = [loader.wait_times[e] for e in range(1, epochs)]
    share = 100 * max(w / t for w, t in zip(waits, epoch_times[1:]))
    rows += [('data wait, first epoch (nothing to prefetch yet)',
              loader.wait_times[0], 's'),
             (f'data wait, later epochs (worst of {epochs - 1})', max(waits),
              's'),
             (f'data wait share of an epoch at {trainer_rate:.0f} images/s',
              f'{share:.2f} %', '')]
    return rows


def bench_train(model='cifar10', devices=None, batch_size=100, iterations=10,
                repeats=3, epoch_images=2000):
    """Images/s of a plain Chainer loop vs GPUDistributedGradient.

    Parameters
    ----------
    model : str, default 'cifar10'
        A name from dasktrain.training.models.
    devices : sequence of str, optional
        Devices for the N-replica runs; default: every GPU, else 2 CPU
        replicas.
    batch_size : int, default 100
        Images per replica per step (the seed post's).
    iterations : int, default 10
        Timed steps per measurement (after one warm-up step).
    repeats : int, default 3
        Measurements; the best is reported.
    epoch_images : int, default 2000
        Images per epoch of the data-wait measurement (real trainer, real
        loader, random pixels).
    """
    import chainer

    from dasktrain.data.loader import EpochLoader
    from dasktrain.parallel.devices import synchronize
    from dasktrain.parallel.gradient import GPUDistributedGradient
    from dasktrain.parallel.placement import default_devices
    from dasktrain.training.models import get_model

    found = default_devices()
    devices = tuple(devices or (('@numpy',) * 2 if found == ('@numpy',)
                                else found))
    first = chainer.get_device(devices[0])
    rng = np.random.default_rng(0)

    def data(n):
        return (rng.standard_normal((n, 3, 32, 32), dtype=np.float32),
                rng.integers(0, 10, n).astype(np.int32))

    def sync():
        synchronize([chainer.get_device(d) for d in devices])

    def timed(step):
        began = time.perf_counter()
        for _ in range(iterations):
            step()
        sync()
        return time.perf_counter() - began

    def models(n):
        np.random.seed(0)
        if n == 0:  # the plain Chainer loop, doing what step() does:
            link = get_model(model)  # send the host batch, read the loss
            link.to_device(first)
            optimizer = chainer.optimizers.Adam()
            optimizer.setup(link)
            x, t = data(batch_size)

            def plain():
                optimizer.update(link, first.send(x), first.send(t))
                return float(link.loss.array), float(link.accuracy.array)
            return plain
        wrapped = GPUDistributedGradient(get_model(model), devices[:n])
        wrapped.setup(chainer.optimizers.Adam())
        x, t = data(batch_size * n)
        return lambda: wrapped.step(x, t)

    # Interleaved repeats, best of each: machine noise hits all alike.
    counts = sorted({0, 1, len(devices)})
    steps = {n: models(n) for n in counts}
    best = {n: math.inf for n in counts}
    for n in counts:
        steps[n]()  # warm-up
    for _ in range(repeats):
        for n in counts:
            best[n] = min(best[n], timed(steps[n]))
    rates = {n: batch_size * max(n, 1) * iterations / best[n]
             for n in counts}
    cuda = chainer.backends.cuda
    rows = [('cuDNN', 'on' if first.xp is not np and cuda.cudnn_enabled
             else 'off (CPU)' if first.xp is np else 'off', ''),
            (f'plain Chainer loop, {devices[0]}', rates[0], 'images/s')]
    for n in counts[1:]:
        rows.append((f'GPUDistributedGradient, {n} replica(s) on '
                     f'{", ".join(devices[:n])}', rates[n], 'images/s'))
        if n == 1:
            rows.append(('wrapper overhead vs plain loop',
                         f'{100 * (rates[0] / rates[1] - 1):.1f} %', ''))
    wrapped = GPUDistributedGradient(get_model(model), devices)
    wrapped.setup(chainer.optimizers.Adam())
    n = len(devices)
    if n > 1:
        rows.append((f'scaling efficiency, {n} replicas',
                     f'{100 * rates[n] / (n * rates[1]):.0f} %', ''))
        # One step taken apart: compute, gradient merge, parameter sync.
        xs, ts = wrapped.split(*data(batch_size * n))
        parts = {'compute (forward + backward)': 0.0,
                 'gradient merge': 0.0,
                 'optimizer update': 0.0, 'parameter sync': 0.0}
        for _ in range(iterations):
            marks = [time.perf_counter()]
            wrapped.cleargrads()
            wrapped(xs, ts)
            wrapped.backward()
            sync()
            marks.append(time.perf_counter())
            wrapped.syncgrads()
            sync()
            marks.append(time.perf_counter())
            wrapped.optimizer.update()
            sync()
            marks.append(time.perf_counter())
            wrapped.syncparams()
            sync()
            marks.append(time.perf_counter())
            for key, a, b in zip(parts, marks, marks[1:]):
                parts[key] += (b - a) / iterations
        rows += [(f'step split: {key}', 1000 * value, 'ms')
                 for key, value in parts.items()]

    np.random.seed(0)
    trainer = GPUDistributedGradient(get_model(model), devices)
    trainer.setup(chainer.optimizers.Adam())
    images = rng.integers(0, 256, (epoch_images, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, epoch_images)
    with EpochLoader(images, labels, batch_size * len(devices),
                     augment_options={}, epochs=3) as loader:
        times = []
        for epoch in range(3):
            began = time.perf_counter()
            for xb, tb in loader.epoch(epoch):
                trainer.step(xb, tb)
            times.append(time.perf_counter() - began)
        waits = [loader.wait_times[e] for e in (1, 2)]
    rows += [('trainer data wait, first epoch', loader.wait_times[0], 's'),
             ('trainer data wait, later epochs (worst)', max(waits), 's'),
             ('data wait share of a later epoch',
              f'{100 * max(w / s for w, s in zip(waits, times[1:])):.2f} %',
              '')]
    return rows


def synthetic_cifar10(data_dir, n_train=50000, n_test=10000, seed=0):
    """Write a CIFAR-10-format folder of synthetic images into ``data_dir``
    (for benchmarks where the real archive cannot be fetched).

    Each class has a random smooth colour pattern; an image is its class's
    pattern at low contrast, shifted up to 4 pixels, under heavy noise: a
    task a convnet learns over epochs rather than in one step.
    """
    import pickle
    from pathlib import Path
    folder = Path(data_dir) / 'cifar-10-batches-py'
    if folder.is_dir():
        return folder
    rng = np.random.default_rng(seed)
    coarse = rng.standard_normal((10, 3, 8, 8))
    templates = coarse.repeat(4, axis=2).repeat(4, axis=3)

    def images(n):
        labels = rng.integers(0, 10, n)
        shift = rng.integers(-4, 5, (n, 2))
        x = np.empty((n, 3, 32, 32), np.float32)
        for i, (label, (dy, dx)) in enumerate(zip(labels, shift)):
            x[i] = np.roll(templates[label], (dy, dx), axis=(1, 2))
        x = 128 + 24 * x + rng.normal(0, 48, x.shape)
        return np.clip(x, 0, 255).astype(np.uint8).reshape(n, -1), labels

    tmp = folder.with_name(folder.name + '.part')
    tmp.mkdir(parents=True, exist_ok=True)
    sizes = [len(a) for a in np.array_split(np.arange(n_train), 5)]
    for name, n in [(f'data_batch_{i + 1}', k) for i, k in enumerate(sizes)
                    ] + [('test_batch', n_test)]:
        data, labels = images(n)
        with open(tmp / name, 'wb') as f:
            pickle.dump({b'data': data, b'labels': labels.tolist(),
                         b'batch_label': b'synthetic'}, f, protocol=4)
    with open(tmp / 'batches.meta', 'wb') as f:
        pickle.dump({b'label_names': [b'class%d' % i for i in range(10)]},
                    f, protocol=4)
    tmp.rename(folder)
    return folder
