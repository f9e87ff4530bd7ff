"""Exact dg against double buffering, epoch by epoch:
`python bench/double_buffering.py`.

Trains the same model on the same synthetic CIFAR-format images (see
``dasktrain.bench.synthetic_cifar10``) for ``--epochs`` epochs, as two
replicas in one process (the double-buffered maths is the same bits across
processes: ``tests/run/test_train.py``), with Adam and momentum SGD at the
project's default learning rates (``--lr OPTIMIZER=LR`` to change one),
five ways: exact; double-buffered as ChainerMN does it (each gradient
computed at the weights it sees, applied one step later, ``--stale-steps
plain``); the job's gradient applied a step late but computed one update
ahead (``predicted``), after an exact first epoch; and corrected stale
steps (each replica's own gradient at once, the job's mean a step late in
its place: ``corrected``) from the first step and after an exact first
epoch (dasktrain's default). Prints a Markdown table of validation
accuracy per epoch and saves the curves (``--figure``). About 50 minutes
on 2 quiet cores with both models.
"""
import argparse
import json
import shutil
import tempfile
from pathlib import Path

WAYS = (('exact', dict(double_buffering=False)),
        ('stale, as ChainerMN', dict(double_buffering=True, exact_warmup=0,
                                     stale_steps='plain')),
        ('stale, predicted, exact 1st epoch',
         dict(double_buffering=True, stale_steps='predicted')),
        ('corrected, from step 1',
         dict(double_buffering=True, exact_warmup=0)),
        ('corrected, exact 1st epoch (default)',
         dict(double_buffering=True)))


def run(work, model, optimizer, extra, args):
    from dasktrain.config import TrainConfig
    from dasktrain.run.train import train
    out = Path(tempfile.mkdtemp(dir=work, prefix=f'{model}-{optimizer}-'))
    if optimizer in args.lr:
        extra = dict(extra, lr=args.lr[optimizer])
    config = TrainConfig(model=model, optimizer=optimizer,
                         devices=('@numpy',) * 2, in_process=True,
                         epochs=args.epochs, batch_size=args.batch_size,
                         train_size=args.train_size,
                         test_size=args.test_size, data_dir=str(work / 'data'),
                         out=str(out), progress=False, **extra)
    log = train(config)['log']
    return [r['validation/main/accuracy'] for r in log]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--models', default='tiny,cifar10')
    parser.add_argument('--epochs', type=int, default=5)
    parser.add_argument('--batch-size', type=int, default=50,
                        help='per replica (default: %(default)s)')
    parser.add_argument('--optimizers', default='adam,momentum-sgd')
    parser.add_argument('--lr', action='append', default=[],
                        metavar='OPTIMIZER=LR',
                        help='a learning rate other than the default')
    parser.add_argument('--train-size', type=int, default=4000)
    parser.add_argument('--test-size', type=int, default=1000)
    parser.add_argument('--figure', type=Path,
                        default=Path('docs/figures/double_buffering.png'))
    parser.add_argument('--json', type=Path, default=None,
                        help='also write the accuracies here')
    parser.add_argument('--from-json', type=Path, nargs='+', default=None,
                        metavar='FILE', help='train nothing: the table and '
                        'figure of runs saved with --json (several runs '
                        'made apart, in parallel)')
    args = parser.parse_args(argv)
    args.lr = {k: float(v) for k, _, v in
               (item.partition('=') for item in args.lr)}
    from dasktrain.bench import machine, synthetic_cifar10
    results = {}
    for path in args.from_json or ():
        for r in json.loads(path.read_text()):
            results[r['model'], r['optimizer'], r['way']] = r['accuracy']
    if args.from_json:
        args.epochs = max(len(c) for c in results.values())
        return report(results, args, machine())
    work = Path(tempfile.mkdtemp(prefix='dasktrain-bench-db-'))
    try:  # the runs' folders and data go with it, whatever happens
        synthetic_cifar10(work / 'data', n_train=args.train_size,
                          n_test=args.test_size)
        for model in args.models.split(','):
            for optimizer in args.optimizers.split(','):
                label = optimizer if optimizer not in args.lr else \
                    f'{optimizer} lr {args.lr[optimizer]:g}'
                for way, extra in WAYS:
                    curve = run(work, model, optimizer, extra, args)
                    results[model, label, way] = curve
                    print(f'{model:8} {label:13} {way:44} ' +
                          ' '.join(f'{a:.3f}' for a in curve), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(
            [dict(model=m, optimizer=o, way=w, accuracy=c)
             for (m, o, w), c in results.items()], indent=1))
    report(results, args, machine())


def report(results, args, machine):
    print(f'\nMachine: {machine}; {args.train_size} synthetic images, '
          f'2 replicas x {args.batch_size}, {args.epochs} epochs\n')
    epochs = range(1, args.epochs + 1)
    print('| model | optimizer | exchange | ' +
          ' | '.join(f'epoch {e}' for e in epochs) + ' | behind exact |')
    print('|---|---|---|' + '---:|' * (args.epochs + 1))
    for (model, optimizer, way), curve in results.items():
        gap = results[model, optimizer, 'exact'][-1] - curve[-1]
        print(f'| {model} | {optimizer} | {way} | ' +
              ' | '.join(f'{100 * a:.1f} %' for a in curve) +
              f' | {100 * gap:+.1f} pts |')
    plot(results, args)


def plot(results, args):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    panels = sorted({(m, o) for m, o, _ in results})
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    # A spare cell holds the legend; without one it goes below the grid.
    spare = rows * cols > len(panels)
    rows += not spare
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows),
                             squeeze=False)
    cells = axes.ravel()
    for ax, (model, optimizer) in zip(cells, panels):
        for (way, _), style in zip(WAYS, ('-', ':', '-.', '--', (0, (5, 1)))):
            curve = results.get((model, optimizer, way))
            if curve is None:
                continue
            ax.plot(range(1, len(curve) + 1), curve, linestyle=style,
                    marker='o', label=way)
        ax.set_title(f'{model}, {optimizer}')
        ax.set_xlabel('epoch')
        ax.set_ylabel('validation accuracy')
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    for ax in cells[len(panels):]:
        ax.axis('off')
    cells[-1].legend(*cells[0].get_legend_handles_labels(), loc='center',
                     fontsize=9, title='exchange')
    fig.tight_layout()
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.figure, dpi=100)


if __name__ == '__main__':
    main()
