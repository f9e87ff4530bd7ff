"""Draw docs/figures/chainermn_parallelism.png: the ranks of ChainerMN's
model parallelism (one MLP over two ranks) and dual parallelism (two such
replicas on four ranks) and what flows between them.

    .venv/bin/python tools/chainermn_figure.py
"""
import argparse
from pathlib import Path

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

FORWARD, BACKWARD, MEAN = '#1f77b4', '#d62728', '#2ca02c'


def box(ax, x, y, w, h, text, color='#f2f2f2', size=9, weight='normal'):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle='round,pad=0.02',
                                facecolor=color, edgecolor='#444444'))
    ax.text(x + w / 2, y + h / 2, text, ha='center', va='center',
            fontsize=size, weight=weight)


def arrow(ax, start, end, color, text=None, offset=(0, 0), rad=0.0,
          size=8):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle='-|>',
                                 mutation_scale=12, color=color, lw=1.6,
                                 connectionstyle=f'arc3,rad={rad}'))
    if text:
        ax.text((start[0] + end[0]) / 2 + offset[0],
                (start[1] + end[1]) / 2 + offset[1], text, color=color,
                ha='center', va='center', fontsize=size)


def rank(ax, x, y, title, layers, w=3.0):
    """A rank: its title and its part of the model, layer by layer."""
    box(ax, x, y, w, 2.2, '', color='#fbfbfb')
    ax.text(x + w / 2, y + 2.0, title, ha='center', va='center',
            fontsize=10, weight='bold')
    for i, layer in enumerate(layers):
        box(ax, x + 0.25, y + 1.35 - 0.55 * i, w - 0.5, 0.4, layer,
            color='#e8eef7')


def model_parallel(ax):
    ax.set_title('Model parallelism: one MLP over two ranks '
                 '(MultiNodeChainList)', fontsize=11)
    rank(ax, 0.2, 0.6, 'rank 0', ['x → l1 → relu → send(h)',
                                  'recv(y) → softmax cross entropy'])
    rank(ax, 5.0, 0.6, 'rank 1', ['recv(h) → l2 → relu → l3',
                                  'send(y) → delegate variable'])
    for y, (start, end), color, text in (
            (2.25, (3.2, 5.0), FORWARD, '1. h (forward)'),
            (1.75, (5.0, 3.2), FORWARD, '2. y (forward)'),
            (1.25, (3.2, 5.0), BACKWARD, '3. ∂L/∂y (backward)'),
            (0.75, (5.0, 3.2), BACKWARD, '4. ∂L/∂h (backward)')):
        arrow(ax, (start, y), (end, y), color, text, (0, 0.15))
    ax.text(4.1, 0.05, 'each rank calls backward(): rank 0 from the loss, '
            'rank 1 from its send\'s delegate variable', ha='center',
            fontsize=8, style='italic')
    ax.set_xlim(0, 8.4)
    ax.set_ylim(-0.1, 3.2)


def dual_parallel(ax):
    ax.set_title('Dual parallelism, 2 × 2: data_comm = comm.split(rank % 2),'
                 ' model_comm = comm.split(rank // 2)', fontsize=11)
    parts = [['l1 + loss'], ['l2, l3']]
    for replica in (0, 1):
        y = 3.2 - 2.6 * replica
        for part in (0, 1):
            r = 2 * replica + part
            rank(ax, 0.2 + 4.8 * part, y,
                 f'rank {r}  (part {part}, replica {replica})',
                 parts[part] + [f'half {replica} of every batch'
                                if part == 0 else 'no data'])
        arrow(ax, (3.2, y + 1.5), (5.0, y + 1.5), FORWARD,
              'h, then ∂L/∂y', (0, 0.18))
        arrow(ax, (5.0, y + 0.9), (3.2, y + 0.9), BACKWARD,
              'y, then ∂L/∂h', (0, -0.2))
        ax.text(4.1, y + 0.35, f'model_comm {replica}', ha='center',
                fontsize=8, color='#555555')
    for part in (0, 1):
        x = 1.7 + 4.8 * part
        arrow(ax, (x, 3.2), (x, 2.8), MEAN)
        arrow(ax, (x, 2.8), (x, 3.2), MEAN)
        ax.text(x + 0.15, 3.0, f'data_comm {part}: mean of\nthe gradients',
                color=MEAN, fontsize=8, va='center')
    ax.set_xlim(0, 8.4)
    ax.set_ylim(0.5, 5.6)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', type=Path, default=Path(
        'docs/figures/chainermn_parallelism.png'))
    args = parser.parse_args()
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 8.2), gridspec_kw={'height_ratios': [3.3, 5.1]})
    for ax in (top, bottom):
        ax.axis('off')
    model_parallel(top)
    dual_parallel(bottom)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == '__main__':
    main()
