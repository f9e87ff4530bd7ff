"""``dasktrain launch -n 2`` against ``mpiexec -n 2`` with real ChainerMN,
on the same scripts, unchanged (their ``import chainermn`` is dasktrain's
under ``launch``), on this machine, interleaved round by round: images/s
while training and wall time to the same epoch (the whole command:
start-up, rendezvous, training, exit). Two kinds of parallelism:

* ``data``: bench/chainermn_example/train_mnist.py, two replicas of an
  MLP averaging their gradients;
* ``model``: bench/chainermn_example/train_mnist_model_parallel.py, one
  MLP split over the two ranks (``MultiNodeChainList``: activations one
  way, gradients back, every step);
* ``dual``: bench/chainermn_example/train_mnist_dual_parallel.py on 4
  ranks, both at once (two replicas of the split MLP, ``comm.split``);
* ``start``: a ChainerMN script's start, ``import chainermn``,
  ``create_communicator()`` and one ``allreduce_obj``, on 2 ranks: the
  whole command's wall time, and from the ranks' stamps when the last
  rank had imported, joined and finished the collective.

    .venv/bin/python bench/chainermn.py --rounds 3

The load average of the machine (1 minute) is taken before every run
and reported: other work on the machine moves the order of the two.

Needs mpiexec and mpi4py (``pip install -e .[mpi]`` after ``apt-get
install openmpi-bin libopenmpi-dev``). Prints a Markdown table and writes
the runs to ``--out``/chainermn.json.
"""
import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = {'data': HERE / 'chainermn_example' / 'train_mnist.py',
           'model': HERE / 'chainermn_example' /
           'train_mnist_model_parallel.py',
           'dual': HERE / 'chainermn_example' /
           'train_mnist_dual_parallel.py'}
RANKS = {'data': 2, 'model': 2, 'dual': 4, 'start': 2}
#: ``start``'s script: each rank prints when it began, had imported
#: ChainerMN, had its communicator and had made one collective.
START = """
import os, sys, time
began = time.time()
import chainermn
imported = time.time()
comm = chainermn.create_communicator('naive')
joined = time.time()
comm.allreduce_obj(1)
met = time.time()
print('stamps %d %.6f %.6f %.6f %.6f' % (comm.rank, began, imported,
                                        joined, met), flush=True)
"""


def mpiexec(n):
    """Open MPI's mpiexec, allowed to run as root and oversubscribe."""
    argv, env = ['mpiexec', '-n', str(n)], dict(os.environ)
    version = subprocess.run(['mpiexec', '--version'], capture_output=True,
                             text=True).stdout
    if 'OpenRTE' in version or 'Open MPI' in version:
        argv += ['--oversubscribe', '--bind-to', 'none']
        if os.geteuid() == 0:
            env.update(OMPI_ALLOW_RUN_AS_ROOT='1',
                       OMPI_ALLOW_RUN_AS_ROOT_CONFIRM='1')
    return argv, env


def run(argv, env, cwd, logs=None):
    """One command's figures: images/s and training seconds (rank 0's
    ``throughput`` line) or, for ``start``, the ranks' stamps; its wall
    time; the load average before it."""
    load = os.getloadavg()[0]
    start = time.time()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=1800)
    wall = time.time() - start
    if done.returncode != 0:
        sys.exit(f'{argv[0]} failed ({done.returncode}):\n'
                 f'{done.stderr[-3000:]}')
    got = {'wall_s': wall, 'load': load}
    found = re.search(r'throughput: ([\d.]+) images/s, ([\d.]+) s',
                      done.stdout)
    if found:
        got.update(images_per_s=float(found.group(1)),
                   train_s=float(found.group(2)))
    text = done.stdout + ''.join(
        p.read_text() for p in Path(logs).glob('rank*.log')) if logs \
        else done.stdout
    stamps = list({int(found[0]): list(map(float, found[1:]))
                   for found in re.findall(
                       r'stamps (\d+) (\d+\.\d{6}) (\d+\.\d{6}) '
                       r'(\d+\.\d{6}) (\d+\.\d{6})', text)}.values())
    if stamps:  # the last rank to import, join, finish the collective
        got.update({k: max(s[i] for s in stamps) - start for i, k in
                    enumerate(('imported_s', 'joined_s', 'met_s'), 1)})
        got['began_s'] = max(s[0] for s in stamps) - start
        got['ranks_seen'] = len(stamps)
    return got


def summary(ratios, speed):
    """Each round's ratio (dasktrain over mpiexec, of one interleaved
    pair: the machine's drift between rounds cancels in it), their median
    and how many rounds dasktrain was level or ahead in (a speed at least
    1, a time at most 1).

    >>> summary([1.1, 0.9, 1.0], True)
    'median of rounds 1.00, 2 of 3 level or ahead: 1.10, 0.90, 1.00'
    """
    ahead = sum(r >= 1.0 if speed else r <= 1.0 for r in ratios)
    return (f'median of rounds {statistics.median(ratios):.2f}, {ahead} of '
            f'{len(ratios)} level or ahead: '
            + ', '.join(f'{r:.2f}' for r in ratios))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--epochs', type=int, default=2)
    parser.add_argument('--kinds', default='start,data,model,dual',
                        help='start, data, model, dual, comma-separated '
                             '(default: %(default)s)')
    parser.add_argument('--unit', type=int, default=2000,
                        help='2000: 5.6 M parameters, 22 MB of float32 '
                             'gradients per step')
    parser.add_argument('--n-train', type=int, default=4000)
    parser.add_argument('--batchsize', type=int, default=100)
    parser.add_argument('--out', default='results/bench-chainermn')
    args = parser.parse_args()
    kinds = args.kinds.split(',')
    if not set(kinds) <= set(RANKS):
        parser.error(f'--kinds takes {", ".join(RANKS)}, got {args.kinds!r}')
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix='bench-chainermn-'))
    common = ['--epoch', str(args.epochs), '--n-train', str(args.n_train),
              '--n-test', '500', '--unit', str(args.unit),
              '--batchsize', str(args.batchsize)]
    _, mpi_env = mpiexec(2)
    # One BLAS thread per rank for both (dasktrain launch's CPU default).
    mpi_env.update(OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1',
                   MKL_NUM_THREADS='1')
    launch_env = dict(mpi_env)
    (work / 'start.py').write_text(START)
    dasktrain = str(Path(sys.executable).with_name('dasktrain'))
    launchers = ('dasktrain launch', 'mpiexec + ChainerMN')
    runs = {kind: {name: [] for name in launchers} for kind in kinds}
    try:  # the runs' folders go with it, whatever happens
        for r in range(args.rounds):
            for kind in kinds:
                n = RANKS[kind]
                program = [str(work / 'start.py')] if kind == 'start' else \
                    [str(SCRIPTS[kind]), *common]
                for name in (launchers if r % 2 == 0 else launchers[::-1]):
                    folder = work / f'{r}-{kind}-{name.split()[0]}'
                    out_args = [] if kind == 'start' else \
                        ['--out', str(folder)]
                    if name.startswith('dasktrain'):
                        argv = [dasktrain, 'launch', '-n', str(n), '--out',
                                str(folder / 'ranks'), '--', sys.executable,
                                *program, *out_args]
                        got = run(argv, launch_env, work, folder / 'ranks')
                    else:
                        argv = [*mpiexec(n)[0], sys.executable, *program,
                                *out_args]
                        got = run(argv, mpi_env, work)
                    runs[kind][name].append(got)
                    print(f'round {r + 1} {kind} {name}: ' + ', '.join(
                        f'{k} {v:.2f}' for k, v in got.items()),
                        file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    loads = [g['load'] for by in runs.values() for got in by.values()
             for g in got]
    machine = (f'{platform.node()}: {os.cpu_count()} CPUs '
               f'({platform.processor() or platform.machine()}), load '
               f'average {min(loads):.2f} to {max(loads):.2f} before the '
               "runs (the bench's own ranks count about 2)")
    (out / 'chainermn.json').write_text(json.dumps(
        {'machine': machine, 'args': vars(args), 'runs': runs}, indent=2))
    print(f'\n{machine}; {args.epochs} epochs of {args.n_train} images, '
          f'MLP 784-{args.unit}-{args.unit}-10, batch {args.batchsize}, '
          f'CPU ranks, median of {args.rounds} interleaved rounds\n')
    print('| run | ranks | launcher | images/s | training s | wall s | '
          'dasktrain / mpiexec (each round\'s) |')
    print('|---|---|---|---|---|---|---|')
    for kind, by_launcher in runs.items():
        med = {name: {k: statistics.median(g[k] for g in got)
                      for k in got[0]} for name, got in by_launcher.items()}
        mine, theirs = (med[name] for name in launchers)
        key = 'met_s' if kind == 'start' else 'images_per_s'
        each = [a[key] / b[key] for a, b in zip(
            *(by_launcher[name] for name in launchers))]
        rounds = summary(each, 'start' != kind)
        for name in launchers:
            m = med[name]
            if kind == 'start':
                ratio = mine['met_s'] / theirs['met_s']
                print(f'| start (last rank: began {m["began_s"]:.2f} s, '
                      f'imported {m["imported_s"]:.2f}'
                      f' s, joined {m["joined_s"]:.2f} s, one collective '
                      f'{m["met_s"]:.2f} s) | {RANKS[kind]} | {name} | | | '
                      f'{m["wall_s"]:.2f} | '
                      + (f'{ratio:.2f}x the time ({rounds}) |'
                         if name == launchers[0] else ' |'))
                continue
            ratio = mine['images_per_s'] / theirs['images_per_s']
            print(f'| {kind} | {RANKS[kind]} | {name} | '
                  f'{m["images_per_s"]:.0f} | {m["train_s"]:.2f} | '
                  f'{m["wall_s"]:.2f} | '
                  + (f'{ratio:.2f}x the speed ({rounds}) |'
                     if name == launchers[0] else ' |'))


if __name__ == '__main__':
    main()
