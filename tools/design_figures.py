"""Draw docs/design.md's two pictures from the module names they show:
a run's way through the code, and a job's way.

    python tools/design_figures.py [OUT_DIR]   # default docs/figures

Every box names a module of the package (``tests/test_layout.py``
checks that each still exists); arrows are calls, in the order a run or
a job takes them. Columns are the processes the code runs in.
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

ROOT = Path(__file__).resolve().parents[1]
W, H = 2.6, 0.62  # a box

# (name, x, y, module, what it does there); x, y: the box's centre
RUN = [
    ('cli', 1.6, 9.0, 'commands/train.py', 'flags -> TrainConfig'),
    ('train', 1.6, 7.6, 'run/train.py', 'train(config): placement once'),
    ('launch', 1.6, 5.0, 'run/launch.py', 'dasktrain launch -n N'),
    ('place', 4.6, 9.0, 'parallel/placement.py', 'here | per device | ranks'),
    ('workers', 4.6, 7.6, 'cluster/workers.py', 'throwaway local workers'),
    ('driver', 4.6, 6.2, 'run/driver.py', 'the ranks, anywhere, watched'),
    ('loop', 7.6, 9.0, 'training/loop.py', 'run(): epochs, log, checkpoint'),
    ('rank', 7.6, 6.2, 'run/train.py', 'a training rank (_rank)'),
    ('keeper', 7.6, 5.0, 'keeper.py', "a launched rank's program"),
    ('loader', 10.6, 9.0, 'data/loader.py', 'EpochLoader: the shards'),
    ('gradient', 10.6, 7.6, 'parallel/gradient.py',
     'GPUDistributedGradient'),
    ('exchange', 10.6, 6.2, 'parallel/exchange/gradients.py',
     'gradient buckets'),
    ('comm', 10.6, 5.0, 'parallel/comm/', 'Solo | DaskComm | NcclComm'),
]
RUN_ARROWS = [
    ('cli', 'train', ''), ('train', 'place', 'where?'),
    ('train', 'loop', 'here'), ('train', 'workers', 'per device'),
    ('workers', 'driver', 'then'), ('train', 'driver', 'ranks'),
    ('launch', 'driver', ''), ('driver', 'rank', 'each rank'),
    ('rank', 'loop', ''), ('driver', 'keeper', "launch's ranks"),
    ('loop', 'loader', ''), ('loop', 'gradient', 'step'),
    ('gradient', 'exchange', ''), ('exchange', 'comm', 'all-reduce'),
]
# (x0, x1, y0, y1, label): the processes the code runs in
RUN_BANDS = [(0.1, 6.1, 4.3, 10.2, "the command's process"),
             (6.1, 9.1, 4.3, 10.2, 'each rank (a worker)'),
             (9.1, 12.1, 4.3, 10.2, 'inside a rank')]

JOB = [
    ('cli', 1.6, 9.3, 'commands/jobs.py', 'dasktrain submit'),
    ('request', 4.6, 9.3, 'jobs/request.py', 'one JobRequest, checked'),
    ('route', 7.6, 9.3, 'jobs/client/route.py', 'own queue or shared?'),
    ('submit', 7.6, 8.1, 'jobs/client/submit.py', 'own: folder + queue'),
    ('sock', 10.6, 8.1, 'jobs/client/socket_client.py', 'shared: the socket'),
    ('folder', 4.6, 8.1, 'jobs/folder.py', "the job's folder, whole"),
    ('dispatch', 7.6, 6.2, 'jobs/scheduler/dispatch.py',
     'holds every job, plans'),
    ('server', 10.6, 6.2, 'jobs/scheduler/socket_server.py',
     'the same request, checked'),
    ('policy', 4.6, 6.2, 'jobs/scheduler/policy.py', 'plan(): whose turn'),
    ('outside', 4.6, 5.0, 'jobs/scheduler/outside_use.py',
     'GPUs busy outside'),
    ('task', 7.6, 3.6, 'jobs/worker/task.py', 'one task body, every job'),
    ('env', 4.6, 3.6, 'jobs/worker/environment.py', "the submitter's env"),
    ('runas', 4.6, 2.5, 'jobs/worker/runas.py', 'as its submitter'),
    ('gang', 13.2, 2.5, 'jobs/worker/gang.py',
     'across workers: a task a rank'),
    ('keeper', 10.6, 3.6, 'keeper.py', 'the program, kept'),
    ('command', 7.6, 1.2, '(a command)', 'submit -- PROGRAM'),
    ('trainjob', 10.3, 1.2, 'jobs/worker/train_job.py',
     "a training job's program"),
    ('trainrun', 13.25, 1.2, 'run/train.py', 'train(config)'),
]
JOB_ARROWS = [
    ('cli', 'request', ''), ('request', 'route', ''),
    ('route', 'submit', 'own'), ('route', 'sock', 'shared'),
    ('submit', 'folder', ''), ('sock', 'server', 'wire.py'),
    ('server', 'folder', ''), ('submit', 'dispatch', 'queue()'),
    ('server', 'dispatch', ''), ('dispatch', 'policy', ''),
    ('dispatch', 'outside', ''), ('dispatch', 'task', 'a Dask task'),
    ('task', 'env', ''), ('task', 'runas', ''), ('task', 'keeper', ''),
    ('task', 'gang', ''), ('gang', 'keeper', 'each rank'),
    ('keeper', 'command', ''), ('keeper', 'trainjob', ''),
    ('trainjob', 'trainrun', ''),
]
JOB_BANDS = [(0.1, 14.6, 7.5, 10.2, "the submitter's process"),
             (0.1, 14.6, 4.4, 7.5, 'the scheduler'),
             (0.1, 14.6, 1.9, 4.4, 'a worker'),
             (0.1, 14.6, 0.5, 1.9, "the job's program")]


def draw(boxes, arrows, bands, title, path):
    right = max(x1 for _, x1, _, _, _ in bands)
    top = max(y1 for _, _, _, y1, _ in bands) + 0.1
    bottom = min(y0 for _, _, y0, _, _ in bands) - 0.1
    fig, ax = plt.subplots(figsize=(right * 1.05, (top - bottom) * 0.85),
                           dpi=100)
    ax.set_xlim(0, right + 0.1)
    ax.set_ylim(bottom, top)
    ax.axis('off')
    for i, (x0, x1, y0, y1, label) in enumerate(bands):
        ax.add_patch(plt.Rectangle((x0, y0), x1 - x0 - 0.06, y1 - y0 - 0.06,
                                   color='#f3f5f9' if i % 2 else '#e6ecf5',
                                   zorder=0))
        ax.text(x0 + 0.12, y1 - 0.2, label, ha='left', va='center',
                fontsize=11, color='#445', style='italic')
    where = {}
    for name, x, y, module, what in boxes:
        where[name] = (x, y)
        ax.add_patch(FancyBboxPatch((x - W / 2, y - H / 2), W, H,
                                    boxstyle='round,pad=0.02,rounding_size=0.08',
                                    fc='white', ec='#3b5b92', lw=1.3,
                                    zorder=2))
        ax.text(x, y + 0.12, module, ha='center', va='center', fontsize=9.5,
                family='monospace', weight='bold', color='#1d2b44', zorder=3)
        ax.text(x, y - 0.15, what, ha='center', va='center', fontsize=8.2,
                color='#333', zorder=3)
    for a, b, label in arrows:
        (xa, ya), (xb, yb) = where[a], where[b]
        start, end = _edge(xa, ya, xb, yb), _edge(xb, yb, xa, ya)
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle='-|>',
                                     mutation_scale=13, lw=1.2,
                                     color='#c0392b', zorder=1,
                                     shrinkA=2, shrinkB=2))
        if label:
            mx, my = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2
            ax.text(mx, my + 0.1, label, ha='center', va='bottom',
                    fontsize=8, color='#c0392b', zorder=4,
                    bbox=dict(fc='white', ec='none', pad=0.5, alpha=0.85))
    ax.set_title(title, fontsize=13, loc='left')
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _edge(x, y, tx, ty):
    """Where the line from box (x, y) towards (tx, ty) leaves the box."""
    dx, dy = tx - x, ty - y
    if dx == 0 and dy == 0:
        return x, y
    sx = (W / 2) / abs(dx) if dx else float('inf')
    sy = (H / 2) / abs(dy) if dy else float('inf')
    s = min(sx, sy)
    return x + dx * s, y + dy * s


def modules():
    """Every module a picture names (for the test that they exist)."""
    return {m for boxes in (RUN, JOB) for _, _, _, m, _ in boxes
            if not m.startswith('(')}


def main(out=None):
    out = Path(out or ROOT / 'docs' / 'figures')
    draw(RUN, RUN_ARROWS, RUN_BANDS, "A run's way through the code "
         '(dasktrain train, dasktrain launch)', out / 'design_run.png')
    draw(JOB, JOB_ARROWS, JOB_BANDS, "A job's way through the code "
         '(dasktrain submit)', out / 'design_job.png')


if __name__ == '__main__':
    main(*sys.argv[1:])
