"""One job over 2 single-threaded worker processes against 1, interleaved:
`python bench/two_workers.py`.

The seed post's network on synthetic CIFAR-format images, batch 100 per
worker, each worker one BLAS thread, in turns round by round so that the
machine's drift falls on every row alike: 1 worker (dg), 2 workers in dg
with the all-reduce overlapped in buckets of ``--bucket-mb`` (each size
its own row; 0: one all-reduce after the backward pass), and 2 workers in
ipm mixing every ``--mix-every`` steps. Images/s are each run's mean over
its epochs after the first; the table shows each row's median over the
rounds and its ratio to 1 worker.
"""
import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path


def run(base, out, workers, **options):
    from dasktrain.cluster.workers import local_workers
    from dasktrain.run.train import train
    config = base.replace(workers=workers, devices=('@numpy',), out=str(out),
                          **options)
    with local_workers(workers) as client:
        log = train(config, client=client)['log']
    later = log[1:] or log
    return statistics.mean(r['images_per_sec'] for r in later)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--epochs', type=int, default=3)
    parser.add_argument('--train-size', type=int, default=4000)
    parser.add_argument('--bucket-mb', default='4,0',
                        help='comma-separated sizes (default: %(default)s)')
    parser.add_argument('--mix-every', type=int, default=10)
    parser.add_argument('--json', type=Path, default=None)
    args = parser.parse_args(argv)
    from dasktrain.bench import machine, synthetic_cifar10
    from dasktrain.config import TrainConfig
    work = Path(tempfile.mkdtemp(prefix='dasktrain-two-workers-'))
    synthetic_cifar10(work / 'data', n_train=args.train_size, n_test=500)
    base = TrainConfig(model='cifar10', batch_size=100, epochs=args.epochs,
                       train_size=args.train_size, test_size=500,
                       data_dir=str(work / 'data'), progress=False,
                       augment='none', collective_timeout=600)
    ways = {'1 worker, dg': (1, {})}
    for mb in (float(m) for m in args.bucket_mb.split(',')):
        ways[f'2 workers, dg, buckets of {mb:g} MiB'] = (2, {'bucket_mb': mb})
    ways[f'2 workers, ipm, mix every {args.mix_every}'] = (
        2, {'mode': 'ipm', 'mix_every': args.mix_every})
    rates = {name: [] for name in ways}
    try:  # the runs' folders and data go with it, whatever happens
        for r in range(args.rounds):
            for i, name in enumerate(ways if r % 2 == 0 else reversed(ways)):
                workers, options = ways[name]
                rate = run(base, work / f'{r}-{i}', workers, **options)
                rates[name].append(rate)
                print(f'round {r + 1} {name}: {rate:.1f} images/s', flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps({'machine': machine(),
                                         'rates': rates}, indent=1))
    one = statistics.median(rates['1 worker, dg'])
    print(f'\nMachine: {machine()}; seed network, batch 100 per worker, '
          f'{args.epochs} epochs of {args.train_size} synthetic images, '
          f'one BLAS thread per worker, median of {args.rounds} '
          'interleaved rounds\n')
    print('| run | images/s | vs 1 worker |')
    print('|---|---:|---:|')
    for name, got in rates.items():
        mid = statistics.median(got)
        print(f'| {name} | {mid:.1f} | {mid / one:.2f}x |')


if __name__ == '__main__':
    main()
