"""A run's ``OUT/curves.png``: its loss and accuracy, training and
test, against epoch, drawn where a run ends (``dasktrain train``, and a
training job's program in the queue) with matplotlib's Agg backend, no
display needed; :mod:`dasktrain.results` draws many runs together in the
same :func:`run_style`.
"""
import json
from pathlib import Path

from dasktrain.files import atomic_write

LABELS = {'loss': 'loss (cross-entropy)', 'accuracy': 'accuracy (fraction)'}
LINE_STYLES = ('-', '--', '-.', ':')
MARKERS = ('o', 's', '^', 'D', 'v', 'P', 'X', '*')


def run_style(index):
    """Colour, line and marker of the ``index``-th run. Runs with the same
    numbers stay visible: later runs are drawn thinner, in another dash
    pattern and with smaller hollow markers of another shape, on top of
    the earlier ones."""
    return dict(color=f'C{index % 10}',
                linestyle=LINE_STYLES[index % len(LINE_STYLES)],
                linewidth=max(3.6 - 0.5 * index, 1.0),
                marker=MARKERS[index % len(MARKERS)],
                markersize=max(12.0 - 2.0 * index, 3.5),
                markerfacecolor='none', markeredgewidth=1.4,
                zorder=2 + index)


def save_curves(out, path=None):
    """Draw a run's loss and accuracy, training and test, against epoch
    into ``path`` (default ``OUT/curves.png``), atomically; returns the
    path, or None before the first epoch.

    Examples
    --------
    >>> save_curves('results')  # doctest: +SKIP
    PosixPath('results/curves.png')
    """
    try:
        rows = json.loads((Path(out) / 'log').read_text())
    except FileNotFoundError:
        return None
    if not rows:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    figure = Figure(figsize=(10, 3.8), layout='constrained')
    FigureCanvasAgg(figure)
    for ax, what in zip(figure.subplots(1, 2), ('loss', 'accuracy')):
        for index, (split, key) in enumerate((
                ('training', f'main/{what}'),
                ('test', f'validation/main/{what}'))):
            have = [r for r in rows if key in r]
            ax.plot([r['epoch'] for r in have], [r[key] for r in have],
                    label=split, **run_style(index))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel('epoch')
        ax.set_ylabel(LABELS[what])
        ax.set_title(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize='small')
    figure.suptitle(f'{Path(out).name}: training and test')
    path = Path(path or Path(out) / 'curves.png')
    atomic_write(path, lambda f: figure.savefig(f, format='png', dpi=100))
    return path
