"""The results of training runs, jobs and a study's trials, as tables and
figures, for notebooks and reports (named apart from Chainer's
``LogReport``, whose log rows it reads).

A *run* is a training log: the list of rows ``OUT/log`` holds (Chainer
LogReport format), or the ``OUT`` folder itself. Functions take a dict
``{label: run}`` so one call compares several runs. Jobs are
:class:`~dasktrain.jobs.job.Job` s, read from their folders.

Reads what runs, jobs and studies left behind; it never trains, queues or
changes anything.
"""
import html
import json
import time
from pathlib import Path

import numpy as np

from dasktrain.jobs.job import DONE
from dasktrain.training.curves import run_style
from dasktrain.training.curves import save_curves as save_curves
from dasktrain.tuning.trials import params_text

AXIS_LABELS = {
    'epoch': 'epoch',
    'elapsed_time': 'elapsed time (s)',
    'validation/main/accuracy': 'test accuracy (fraction)',
    'validation/main/loss': 'test loss (cross-entropy)',
    'main/accuracy': 'training accuracy (fraction)',
    'main/loss': 'training loss (cross-entropy)',
    'images_per_sec': 'training throughput (images/s)',
    'comm_time': 'communication time per epoch (s)',
    'drift': 'replica distance from their mean (L2)',
    'data_wait_time': 'data wait per epoch (s)',
}


def read_log(run):
    """The rows of a run: a log list, an ``OUT`` folder or its log file."""
    if isinstance(run, (list, tuple)):
        return list(run)
    if isinstance(run, dict) and 'log' in run:  # train()'s summary
        return list(run['log'])
    path = Path(run)
    path = path / 'log' if path.is_dir() else path
    return json.loads(path.read_text())


class Table:
    """Rows of values that render as HTML in Jupyter and as text elsewhere."""

    def __init__(self, columns, rows):
        self.columns = list(columns)
        self.rows = [list(r) for r in rows]

    @staticmethod
    def _cell(value):
        if isinstance(value, float):
            return f'{value:,.4g}' if abs(value) < 1000 else f'{value:,.0f}'
        return '-' if value is None else str(value)

    def _repr_html_(self):
        head = ''.join(f'<th>{html.escape(c)}</th>' for c in self.columns)
        body = ''.join('<tr>' + ''.join(
            f'<td>{html.escape(self._cell(v))}</td>' for v in row) + '</tr>'
            for row in self.rows)
        return f'<table><tr>{head}</tr>{body}</table>'

    def to_markdown(self):
        lines = ['| ' + ' | '.join(self.columns) + ' |',
                 '|' + '---|' * len(self.columns)]
        lines += ['| ' + ' | '.join(self._cell(v) for v in row) + ' |'
                  for row in self.rows]
        return '\n'.join(lines)

    def to_text(self):
        """Aligned columns, for a terminal."""
        cells = [self.columns] + [[self._cell(v) for v in row]
                                  for row in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
        return '\n'.join('  '.join(c.ljust(w) for c, w in zip(r, widths))
                         .rstrip() for r in cells)

    def __str__(self):
        return self.to_markdown()

    __repr__ = __str__


def throughput(run, skip_first=True):
    """Mean training images/s over a run's epochs (the first, which pays
    for warm-up and an empty prefetch, left out when there are others)."""
    rows = read_log(run)
    rows = rows[1:] if skip_first and len(rows) > 1 else rows
    return float(np.mean([r['images_per_sec'] for r in rows]))


def summary_table(runs):
    """One row per run: final test accuracy, throughput, times."""
    rows = []
    for label, run in runs.items():
        log = read_log(run)
        last = log[-1]
        rows.append([label, len(log), last['validation/main/accuracy'],
                     max(r['validation/main/accuracy'] for r in log),
                     throughput(log), last['elapsed_time'],
                     float(np.mean([r.get('comm_time', 0.0) for r in log]))])
    return Table(['run', 'epochs', 'final test accuracy',
                  'best test accuracy', 'images/s', 'total time (s)',
                  'communication per epoch (s)'], rows)


def scaling_table(runs_by_devices):
    """Images/s, speed-up and scaling efficiency against the smallest run.

    ``runs_by_devices`` maps a device count to a run.
    """
    counts = sorted(runs_by_devices)
    rates = {n: throughput(runs_by_devices[n]) for n in counts}
    per_device = rates[counts[0]] / counts[0]
    return Table(['devices', 'images/s', 'speed-up', 'scaling efficiency'],
                 [[n, rates[n], rates[n] / rates[counts[0]],
                   rates[n] / (per_device * n)] for n in counts])


def _axes(ax):
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(6.4, 4.2))
    return ax


def _legend(ax):
    """The legend beside the axes, never over the data."""
    ax.legend(loc='upper left', bbox_to_anchor=(1.02, 1.0), borderaxespad=0,
              fontsize='small')


def plot_curves(runs, x='epoch', y='validation/main/accuracy', ax=None,
                title=None, legend=True):
    """One line per run of ``y`` against ``x`` (log keys); each run keeps
    its :func:`run_style` by its place in ``runs``, also where it has no
    ``y`` (dg has no drift), so a run looks the same in every figure.
    ``legend=False`` leaves it to a neighbouring figure of the same runs."""
    ax = _axes(ax)
    for index, (label, run) in enumerate(runs.items()):
        log = [r for r in read_log(run) if y in r]
        if log:
            ax.plot([r[x] for r in log], [r[y] for r in log], label=label,
                    **run_style(index))
    if x == 'epoch':
        from matplotlib.ticker import MaxNLocator
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(AXIS_LABELS.get(x, x))
    ax.set_ylabel(AXIS_LABELS.get(y, y))
    ax.set_title(title or f'{AXIS_LABELS.get(y, y)} against '
                          f'{AXIS_LABELS.get(x, x)}')
    ax.grid(alpha=0.3)
    if legend:
        _legend(ax)
    return ax


def plot_scaling(runs_by_devices, ax=None, title=None, label='measured',
                 ideal=True):
    """Measured throughput against device count, with the ideal line (call
    again on the same ``ax`` with another ``label`` to compare schemes)."""
    ax = _axes(ax)
    counts = sorted(runs_by_devices)
    rates = [throughput(runs_by_devices[n]) for n in counts]
    if ideal:
        ax.plot(counts, [rates[0] / counts[0] * n for n in counts],
                linestyle='--', color='grey',
                label='ideal (linear in devices)')
    ax.plot(counts, rates, marker='o', label=label)
    ax.set_xticks(counts)
    ax.set_xlabel('devices (replicas)')
    ax.set_ylabel(AXIS_LABELS['images_per_sec'])
    if title or not ax.get_title():  # a second call keeps the first's
        ax.set_title(title or 'Training throughput against devices')
    ax.grid(alpha=0.3)
    _legend(ax)
    return ax


def plot_bars(runs, y='comm_time', ax=None, title=None):
    """Mean of ``y`` per epoch for each run, as horizontal bars (long run
    names stay level) in the runs' colours, each labelled with its value,
    zero included."""
    ax = _axes(ax)
    labels = list(runs)
    values = [float(np.mean([r.get(y, 0.0) for r in read_log(runs[k])]))
              for k in labels]
    bars = ax.barh(range(len(labels)), values,
                   color=[run_style(i)['color'] for i in range(len(labels))])
    ax.bar_label(bars, labels=[f'{v:.3g}' for v in values], padding=3)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()  # the first run on top, as in the legends
    ax.margins(x=0.15)  # room for the value labels
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(4))  # tiny values: long ticks
    ax.set_xlabel(AXIS_LABELS.get(y, y))
    ax.set_title(title or f'{AXIS_LABELS.get(y, y)}, mean over epochs')
    ax.grid(alpha=0.3, axis='x')
    return ax


# How a run ended, where that is not just "ran": its bar's label and colour.
ENDINGS = {'pruned': ('pruned', 'tab:orange'), 'failed': ('failed', 'tab:red')}


def plot_timeline(jobs, ax=None, title=None):
    """When each job waited in the queue and when it ran, in seconds since
    the first was submitted: one row per job (a job not started yet shows
    its wait so far, one still running its run so far). Runs that were
    pruned (hyperparameter search) or failed have their own colours."""
    ax = _axes(ax)
    jobs = list(jobs)
    specs = [job.spec() for job in jobs]
    statuses = [job.status() for job in jobs]
    origin = min(spec.submitted for spec in specs)
    now = time.time()
    labelled = set()

    def bar(row, begin, end, label, color):
        ax.barh(row, end - begin, left=begin - origin, color=color,
                label=None if label in labelled else label)
        labelled.add(label)

    for row, (spec, status) in enumerate(zip(specs, statuses)):
        bar(row, spec.submitted, status['started'] or status['ended']
            or now, 'queued', 'lightgrey')
        if status['started']:
            bar(row, status['started'], status['ended'] or now,
                *ENDINGS.get(status['state'], ('running', 'tab:blue')))
    ax.set_yticks(range(len(jobs)), [spec.name for spec in specs])
    ax.invert_yaxis()  # first submitted on top
    ax.set_xlabel('time since the first submission (s)')
    ax.set_ylabel('job')
    ax.set_title(title or 'Jobs: queued and running')
    ax.grid(alpha=0.3, axis='x')
    _legend(ax)
    return ax


def jobs_table(jobs):
    """State, GPUs, progress and accuracy of cluster jobs."""
    rows = []
    for job in jobs:
        s = job.status()
        rows.append([job.id, s['state'], ','.join(s['gpus'] or []) or '-',
                     f"{s['epoch']}/{s['epochs']}", s['accuracy']])
    return Table(['job', 'state', 'GPUs', 'epoch', 'test accuracy'], rows)


def watch_jobs(jobs, interval=2.0, timeout=None):
    """Show :func:`jobs_table`, refreshed in place, until every job ends."""
    try:
        from IPython.display import clear_output, display
    except ImportError:  # plain Python: print each change
        clear_output, display = (lambda wait=True: None), print
    began = time.monotonic()
    while True:
        table = jobs_table(jobs)
        clear_output(wait=True)
        display(table)
        if all(row[1] in DONE for row in table.rows):
            return table
        if timeout is not None and time.monotonic() - began > timeout:
            raise TimeoutError('jobs still running after '
                               f'{timeout:.0f} s')
        time.sleep(interval)


def trials_table(study):
    """Number, state, params, value, the epoch the value is from, and job
    of every trial of an Optuna study (:mod:`dasktrain.tuning`)."""
    return Table(['trial', 'state', 'params', 'value', 'epoch', 'job'], [
        [t.number, t.state.name.lower(), params_text(t.params), t.value,
         t.user_attrs.get('epoch'), t.user_attrs.get('job')]
        for t in study.get_trials(deepcopy=False)])
