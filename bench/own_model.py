"""A built-in network by its name and by a spec, images/s interleaved:
`python bench/own_model.py`.

``--model cifar10`` and ``--model dasktrain.training.models:Cifar10`` build
the same network, the second the way a lab's own model file is built
(imported by spec, called with ``n_classes``, wrapped in
``L.Classifier``). Both train as ``GPUDistributedGradient`` steps on the
same random batch, one measurement of each in turn (so that the machine's
noise hits both alike), on the CPU or the first GPU; prints a Markdown
table of the best and median images/s and their ratio.
"""
import argparse
import statistics
import time

import numpy as np

PAIRS = {'cifar10': 'dasktrain.training.models:Cifar10',
         'tiny': 'dasktrain.training.models:Tiny'}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', default='cifar10', choices=PAIRS)
    parser.add_argument('--device', default='@numpy')
    parser.add_argument('--batch-size', type=int, default=100)
    parser.add_argument('--iterations', type=int, default=10,
                        help='steps per measurement (default: %(default)s)')
    parser.add_argument('--repeats', type=int, default=7,
                        help='measurements of each (default: %(default)s)')
    args = parser.parse_args(argv)
    import chainer

    from dasktrain.bench import machine
    from dasktrain.parallel import GPUDistributedGradient
    from dasktrain.parallel.devices import synchronize
    from dasktrain.training.models import get_model
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch_size, 3, 32, 32), dtype=np.float32)
    t = rng.integers(0, 10, args.batch_size).astype(np.int32)
    names = (args.model, PAIRS[args.model])
    steps = {}
    for name in names:
        np.random.seed(0)
        model = GPUDistributedGradient(get_model(name), [args.device])
        model.setup(chainer.optimizers.Adam())
        model.step(x, t)  # warm-up: allocations, first calls
        steps[name] = model
    device = [chainer.get_device(args.device)]
    rates = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            began = time.perf_counter()
            for _ in range(args.iterations):
                steps[name].step(x, t)
            synchronize(device)
            rates[name].append(args.iterations * args.batch_size /
                               (time.perf_counter() - began))
    print(f'Machine: {machine()}; {args.device}, batch {args.batch_size}, '
          f'{args.repeats} x {args.iterations} steps each, interleaved\n')
    print('| model | best images/s | median images/s |')
    print('|---|---:|---:|')
    for name in names:
        print(f'| `{name}` | {max(rates[name]):.1f} | '
              f'{statistics.median(rates[name]):.1f} |')
    best = max(rates[names[1]]) / max(rates[names[0]])
    median = statistics.median(rates[names[1]]) / \
        statistics.median(rates[names[0]])
    print(f'\nby spec / by name: {best:.3f} (best), {median:.3f} (median)')


if __name__ == '__main__':
    main()
