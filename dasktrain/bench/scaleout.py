"""One job across 1, 2, ... Dask worker processes (``dasktrain bench
scaleout``): dg and ipm, communication per step, accuracy, against one
process on the same data and epochs. Measures only: it changes nothing
of what it runs.
"""
import tempfile
from pathlib import Path

import numpy as np

from dasktrain.bench.benchmarks import synthetic_cifar10


def bench_scaleout(workers=(1, 2), model='cifar10', batch_size=100,
                   mix_every=10, epochs=3, train_size=4000, test_size=2000,
                   data_dir=None, out=None):
    """Images/s of one job across 1, 2, ... Dask worker processes (one BLAS
    thread each) in dg and ipm, communication per step, final accuracy,
    and the single process using every core, on the same data and epochs.
    The runs' folders go to ``out``; without it, to a temporary folder
    removed at the end.
    """
    options = dict(workers=workers, model=model, batch_size=batch_size,
                   mix_every=mix_every, epochs=epochs, train_size=train_size,
                   test_size=test_size, data_dir=data_dir)
    if out is not None:
        return _rows(Path(out), **options)
    with tempfile.TemporaryDirectory(prefix='dasktrain-bench-') as scratch:
        return _rows(Path(scratch), **options)


def _rows(scratch, workers, model, batch_size, mix_every, epochs,
          train_size, test_size, data_dir):
    from dasktrain.cluster.workers import local_workers
    from dasktrain.config import TrainConfig
    from dasktrain.run.train import train
    if data_dir is None:
        data_dir = scratch / 'data'
        synthetic_cifar10(data_dir, n_train=train_size, n_test=test_size)
    base = TrainConfig(model=model, batch_size=batch_size, epochs=epochs,
                       train_size=train_size, test_size=test_size,
                       data_dir=str(data_dir), progress=False,
                       collective_timeout=600)

    def measure(summary, label, workers=None, mode='dg'):
        log = summary['log']
        later = log[1:] or log  # the first epoch pays for start-up
        rate = float(np.mean([r['images_per_sec'] for r in later]))
        steps = [b['iteration'] - a['iteration'] for a, b in
                 zip([{'iteration': 0}] + log, log)]
        comm = float(np.mean([r['comm_time'] / s for r, s in
                              zip(later, steps[-len(later):])]))
        return dict(label=label, rate=rate, comm=comm, workers=workers,
                    mode=mode, accuracy=log[-1]['validation/main/accuracy'])

    runs = [measure(train(base.replace(out=str(scratch / 'single'),
                                       devices=('@numpy',))),
                    'one process, 1 replica (BLAS threads: all)')]
    from dasktrain.run.train import train as plain_loop
    with local_workers(1) as client:  # the same loop, 1 BLAS thread
        runs.append(measure(client.submit(plain_loop, base.replace(
            out=str(scratch / 'plain-1'), devices=('@numpy',)),
            pure=False).result(), 'one process, 1 replica (BLAS threads: '
            '1), no Dask job'))
    most = max(workers)
    reference = {}  # the accuracy a job across workers must match
    for mode in ('dg', 'ipm'):
        summary = train(base.replace(
            out=str(scratch / f'single-{mode}'), devices=('@numpy',) * most,
            in_process=True, mode=mode,
            mix_every=mix_every if mode == 'ipm' else None))
        reference[mode] = summary['final']['validation/main/accuracy']
    for n in workers:
        for mode in (('dg',) if n == 1 else ('dg', 'ipm')):
            config = base.replace(
                workers=n, mode=mode, devices=('@numpy',),
                mix_every=mix_every if mode == 'ipm' else None,
                out=str(scratch / f'{mode}-{n}'))
            with local_workers(n) as client:
                summary = train(config, client=client)
            name = f'ipm, mix every {mix_every}' if mode == 'ipm' else 'dg'
            runs.append(measure(summary, f'{n} worker(s), {name} (BLAS '
                                'threads: 1)', n, mode))
    for label, extra in (('float16 communication', {'comm_dtype': 'float16'}),
                         ('double buffering', {'double_buffering': True})):
        if most < 2:
            break
        with local_workers(most) as client:
            summary = train(base.replace(
                workers=most, devices=('@numpy',), out=str(scratch / label),
                **extra), client=client)
        runs.append(measure(summary, f'{most} worker(s), dg, {label} (BLAS '
                            'threads: 1)', most, 'dg'))
    one = next(r['rate'] for r in runs if r['workers'] == 1)
    rows = []
    for r in runs:
        n = r['workers']
        rows.append((r['label'], r['rate'], 'images/s'))
        if n is not None and n > 1:
            rows.append(("  speed-up vs 1 worker / vs one process",
                         f"{r['rate'] / one:.2f}x / "
                         f"{r['rate'] / runs[0]['rate']:.2f}x", ''))
            rows.append(('  scaling efficiency',
                         f"{100 * r['rate'] / (n * one):.0f} %", ''))
        rows.append(('  communication per step', 1000 * r['comm'], 'ms'))
        if n is not None:  # images per step over images per second
            step = batch_size * n / r['rate']
            rows.append(('  exposed communication share of a step',
                         f"{100 * r['comm'] / step:.1f} %", ''))
        if n == 1:
            plain = runs[1]['rate']
            rows.append(('  vs the plain loop with 1 BLAS thread',
                         f"{100 * (r['rate'] / plain - 1):+.1f} %", ''))
        rows.append((f'  test accuracy after {epochs} epochs',
                     f"{100 * r['accuracy']:.1f} %", ''))
        if n == most > 1:  # exact dg or ipm, and dg's variants
            mode = r['mode']
            rows.append((f'  vs one process with {n} replicas, {mode} '
                         f'({100 * reference[mode]:.1f} %)',
                         f"{100 * (r['accuracy'] - reference[mode]):+.1f} "
                         'points', ''))
    return rows
