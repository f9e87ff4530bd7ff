"""README's notebook figures: `python bench/notebooks.py --help`.

Executes the notebooks at a size this machine finishes in about half
an hour and copies every figure they draw into ``--figures``. Without
``--data-dir`` the data are synthetic CIFAR-format images (class patterns
under noise, see ``dasktrain.bench.synthetic_cifar10``), for machines that
cannot fetch CIFAR-10; the figures are then about speed and the methods'
behaviour, not about CIFAR-10 accuracy. `make notebooks` runs them at full
size instead.

With ``--commit`` the executed notebooks replace those in ``notebooks/``,
each with a note first saying where and on what it ran: the committed
notebooks show their tables and figures before anyone runs them (running
one again starts from its source: ``tools/nbrun.py``'s ``clean``).
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

from dasktrain.bench import machine, synthetic_cifar10
from dasktrain.errors import UserError
from dasktrain.files import atomic_write

sys.path.append(str(Path(__file__).resolve().parent.parent / 'tools'))
from nbrun import run_notebook

NOTEBOOKS = Path(__file__).resolve().parent.parent / 'notebooks'


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('only', nargs='*', metavar='NOTEBOOK',
                        help='names of the notebooks to run, without '
                             '.ipynb (default: all)')
    parser.add_argument('--epochs', type=int, default=5)
    parser.add_argument('--model', default=None,
                        help="every notebook's network (default: each "
                             "notebook's own; 04 always the small 'tiny')")
    parser.add_argument('--train-size', type=int, default=4000,
                        help='training images (default: %(default)s)')
    parser.add_argument('--test-size', type=int, default=1000,
                        help='test images (default: %(default)s)')
    parser.add_argument('--ipm-batch-size', type=int, default=50,
                        help='per replica in notebook 02, small enough that '
                             'mixing every 100 iterations happens within '
                             'the run (default: %(default)s)')
    parser.add_argument('--trials', type=int, default=10,
                        help='trials of the study in notebook 04 (default: '
                             '%(default)s)')
    parser.add_argument('--data-dir', help='CIFAR-10 folder (default: '
                                           'synthetic images in --work)')
    parser.add_argument('--work', type=Path,
                        help='runs and executed notebooks (default: a new '
                             'temporary folder)')
    parser.add_argument('--figures', type=Path, default=Path('docs/figures'),
                        help='where the PNGs go (default: %(default)s)')
    parser.add_argument('--commit', action='store_true',
                        help='write the executed notebooks over those in '
                             'notebooks/, with a note on how they ran')
    args = parser.parse_args(argv)

    work = args.work or Path(tempfile.mkdtemp(prefix='dasktrain-figures-'))
    data_dir = args.data_dir or str(work / 'data')
    size = dict(data_dir=data_dir, epochs=args.epochs,
                train_size=args.train_size, test_size=args.test_size,
                **({'model': args.model} if args.model else {}))
    parameters = {
        '01_single_vs_multi_gpu': dict(size, out_dir=str(work / '01')),
        '02_distributed_gradient_vs_parameter_mixture': dict(
            size, out_dir=str(work / '02'), batch_size=args.ipm_batch_size),
        # Free ports: a cluster already on 8786 must not take these jobs.
        '03_cluster_jobs': dict(size, jobs_dir=str(work / '03-jobs'),
                                port=0, dashboard_port=0),
        # A study is many runs: the small convnet, not the seed network
        # (a 2-core CPU trains that at 20 images/s).
        '04_hyperparameter_search': dict(
            size, jobs_dir=str(work / '04-jobs'), port=0, dashboard_port=0,
            trials=args.trials, startup_trials=3, model='tiny'),
        # Its own model and data: only the run's length and its folder.
        '05_own_model_and_data': dict(epochs=args.epochs,
                                      out_dir=str(work / '05')),
    }
    unknown = set(args.only) - set(parameters)
    if unknown:
        parser.error(f'no notebook named {sorted(unknown)[0]!r}; choose '
                     f'from {", ".join(parameters)}')
    if args.data_dir is None:
        synthetic_cifar10(data_dir, n_train=args.train_size,
                          n_test=args.test_size)
    print(f'machine: {machine()}; work folder {work}', flush=True)
    data = ('CIFAR-10 from ' + args.data_dir if args.data_dir else
            f'a **synthetic** CIFAR-format set ({args.train_size:,} training '
            f'and {args.test_size:,} test images: class colour patterns '
            'under noise, `dasktrain.bench.synthetic_cifar10`)')
    note = (f'*Executed by `python bench/notebooks.py --commit` on '
            f'{machine()}, on {data}, at the parameters in the cell after '
            'the defaults'
            + ('' if args.data_dir else
               ': the figures show what this notebook draws and how the '
               'methods behave on an easy task, not CIFAR-10 results')
            + '. `make notebooks` runs it on CIFAR-10 at its defaults.*')
    args.figures.mkdir(parents=True, exist_ok=True)
    for name, values in parameters.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        try:
            executed, figures = run_notebook(
                NOTEBOOKS / f'{name}.ipynb', work / 'executed', values,
                note=note if args.commit else None)
        except UserError as e:
            print(f'error: {e}', file=sys.stderr)
            return 1
        if args.commit:
            text = committed(executed, work)
            atomic_write(NOTEBOOKS / executed.name,
                         lambda f, text=text: f.write(text))
        for figure in figures:
            png = figure.read_bytes()
            atomic_write(args.figures / figure.name,
                         lambda f, png=png: f.write(png))
        print(f'{name}: {len(figures)} figures in '
              f'{time.perf_counter() - start:.0f} s', flush=True)
    return 0


def committed(executed, work):
    """The executed notebook's bytes as committed: its injected
    parameters without those naming the temporary ``work`` folder (a
    reader's "Run All" then writes under the repository's runs/)."""
    import nbformat
    nb = nbformat.read(executed, as_version=4)
    for cell in nb.cells:
        if 'injected-parameters' in cell.metadata.get('tags', ()):
            cell.source = '\n'.join(
                line for line in cell.source.splitlines()
                if str(work) not in line)
    return nbformat.writes(nb).encode() + b'\n'


if __name__ == '__main__':
    sys.exit(main())
