"""How long a job of 2 ranks takes to start and end, and where the time
goes: `python bench/startup.py`.

Round by round, the order turned every round, on this machine:

* ``mpiexec -n 2 python -c pass`` and ``dasktrain launch -n 2 -- python
  -c pass``: the launcher alone (start, ranks that do nothing, exit);
* the same with ranks that join and meet once: ``from mpi4py import MPI;
  MPI.COMM_WORLD.Barrier()`` under mpiexec, ``dasktrain.chainermn.
  create_communicator()`` and its ``barrier()`` under ``dasktrain
  launch``, each rank stamping the time it started, joined and met;
* ``dasktrain train --devices cpu:2`` of 2 epochs of 200 images
  against ``mpiexec -n 2`` of the ChainerMN script
  (``bench/chainer_example/train_cifar.py --chainermn``) of the same.

With ``--before DIR`` each dasktrain way runs again with the previous
version imported from DIR (a checkout's folder holding ``dasktrain/``).
Each run's wall time is the whole command, from before its process
starts to its exit; the parts are from the ranks' stamps (the first rank
to start, the last to join, the last to meet). Prints Markdown tables;
``--json`` keeps every figure.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / 'chainer_example' / 'train_cifar.py'

STAMPED = '''
import os, sys, time
began = time.time()
{join}
joined = time.time()
{meet}
met = time.time()
rank = {rank}
with open(os.path.join(sys.argv[1], f'stamps{{rank}}'), 'w') as f:
    f.write(f'{{began}} {{joined}} {{met}}')
'''
MPI = dict(join='from mpi4py import MPI; comm = MPI.COMM_WORLD',
           meet='comm.allreduce(1)', rank='comm.rank')
DASK = dict(join='import dasktrain.chainermn as cmn; '
            'comm = cmn.create_communicator()',
            meet='comm.allreduce_obj(1)', rank='comm.rank')


def mpiexec(n):
    argv, env = ['mpiexec', '-n', str(n), '--oversubscribe',
                 '--bind-to', 'none'], dict(os.environ)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT='1',
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM='1')
    env.update(OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1')
    return argv, env


BEFORE = None  # --before: a checkout of the previous version


def _env(before):
    """This environment; with ``before``, the previous version's
    dasktrain imported instead (``PYTHONPATH``)."""
    env = dict(os.environ)
    if before:
        env['PYTHONPATH'] = str(BEFORE)
    return env


def dasktrain_launch(n, out, before=False):
    exe = str(Path(sys.executable).with_name('dasktrain'))
    return [exe, 'launch', '-n', str(n), '--out', str(out), '--'], \
        _env(before)


def timed(argv, env, cwd):
    began = time.time()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)
    ended = time.time()
    if done.returncode:
        sys.exit(f'{" ".join(argv[:4])} failed ({done.returncode}):\n'
                 f'{done.stdout[-1500:]}\n{done.stderr[-3000:]}')
    return began, ended


def stamped(kind, folder):
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / 'rank.py'
    script.write_text(STAMPED.format(**(MPI if kind == 'mpi' else DASK)))
    if kind == 'mpi':
        argv, env = mpiexec(2)
    else:
        argv, env = dasktrain_launch(2, folder / 'out', kind == 'before')
    began, ended = timed(argv + [sys.executable, str(script), str(folder)],
                         env, folder)
    stamps = [[float(x) for x in (folder / f'stamps{r}').read_text().split()]
              for r in range(2)]
    first = min(s[0] for s in stamps)
    return {'wall_s': ended - began,
            'to_first_rank_s': first - began,
            'imports_and_join_s': max(s[1] for s in stamps) - first,
            'first_collective_s': max(s[2] for s in stamps) -
            max(s[1] for s in stamps),
            'after_last_rank_s': ended - max(s[2] for s in stamps)}


def bare(kind, folder):
    folder.mkdir(parents=True, exist_ok=True)
    if kind == 'mpi':
        argv, env = mpiexec(2)
    else:
        argv, env = dasktrain_launch(2, folder / 'out', kind == 'before')
    began, ended = timed(argv + [sys.executable, '-c', 'pass'], env, folder)
    return {'wall_s': ended - began}


def training(kind, folder, data):
    folder.mkdir(parents=True, exist_ok=True)
    if kind == 'mpi':
        argv, env = mpiexec(2)
        argv += [sys.executable, str(SCRIPT), '--data', str(data),
                 '--epoch', '2', '--n-train', '200', '--n-test', '100',
                 '--out', str(folder / 'out'), '--chainermn']
    else:
        exe = str(Path(sys.executable).with_name('dasktrain'))
        argv, env = [exe, 'train', '--devices', 'cpu:2', '--epochs', '2',
                     '--train-size', '200', '--test-size', '100',
                     '--augment', 'none', '--data-dir', str(data.parent),
                     '--out', str(folder / 'out'), '--no-progress'], \
            _env(kind == 'before')
    began, ended = timed(argv, env, folder)
    return {'wall_s': ended - began}


WAYS = {
    'mpiexec -n 2 python -c pass': ('mpi', bare),
    'dasktrain launch -n 2 -- python -c pass': ('dask', bare),
    'mpiexec -n 2, ranks join and meet once': ('mpi', stamped),
    'dasktrain launch -n 2, ranks join and meet once': ('dask', stamped),
    'mpiexec -n 2, ChainerMN, 2 epochs of 200 images': ('mpi', training),
    'dasktrain train --devices cpu:2, 2 epochs of 200 images':
        ('dask', training),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--only', default=None,
                        help='run the ways whose name contains this')
    parser.add_argument('--before', type=Path, default=None,
                        help="also the previous version's dasktrain, "
                             'imported from this checkout')
    parser.add_argument('--json', type=Path, default=None)
    args = parser.parse_args(argv)
    global BEFORE
    BEFORE = args.before
    from dasktrain.bench import machine, synthetic_cifar10
    if shutil.which('mpiexec') is None:
        sys.exit('needs mpiexec (apt-get install openmpi-bin) and mpi4py '
                 '(pip install -e .[mpi])')
    ways = dict(WAYS)
    if args.before:  # each dasktrain way again, as it was
        for name, (kind, how) in WAYS.items():
            if kind == 'dask':
                ways[f'{name} (before)'] = ('before', how)
    ways = {k: v for k, v in ways.items()
            if args.only is None or args.only in k}
    work = Path(tempfile.mkdtemp(prefix='dasktrain-startup-'))
    load = [os.getloadavg()[0]]
    try:
        data = synthetic_cifar10(work / 'data', n_train=200, n_test=100)
        runs = {name: [] for name in ways}
        for r in range(args.rounds):
            for i, name in enumerate(ways if r % 2 == 0 else
                                     reversed(list(ways))):
                kind, how = ways[name]
                folder = work / f'{r}-{i}'
                got = how(kind, folder, data) if how is training else \
                    how(kind, folder)
                runs[name].append(got)
                print(f'round {r + 1} {name}: ' + ', '.join(
                    f'{k} {v:.2f}' for k, v in got.items()),
                    file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load.append(os.getloadavg()[0])
    if args.json:
        args.json.write_text(json.dumps({'machine': machine(), 'load': load,
                                         'runs': runs}, indent=1))
    print(f'\nMachine: {machine()}; load average {load[0]:.1f} before, '
          f'{load[1]:.1f} after; medians of {args.rounds} interleaved '
          'rounds, seconds\n')
    print('| run | wall | to the first rank | imports and join | first '
          'collective | after the last rank |')
    print('|---|---:|---:|---:|---:|---:|')
    for name, got in runs.items():
        cells = [f'{statistics.median(g[k] for g in got):.2f}'
                 if k in got[0] else '' for k in (
                     'wall_s', 'to_first_rank_s', 'imports_and_join_s',
                     'first_collective_s', 'after_last_rank_s')]
        print(f'| {name} | {" | ".join(cells)} |')


if __name__ == '__main__':
    main()
