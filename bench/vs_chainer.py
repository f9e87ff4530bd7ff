"""``dasktrain train`` against plain Chainer and ChainerMN on the seed
post's network, as a user runs each: `python bench/vs_chainer.py`.

The same synthetic CIFAR-format images (``--n-train``, no augmentation
for anyone: the plain script has none), batch 100 per process, Adam,
interleaved round by round on this machine:

* plain Chainer, one process (``bench/chainer_example/train_cifar.py``: a
  Trainer, a StandardUpdater, an Evaluator), BLAS threads as they come;
* ``dasktrain train --devices cpu``: one process, the same;
* ChainerMN over Open MPI, ``mpiexec -n 2`` of the same script with
  ``--chainermn`` (its naive CPU communicator), one BLAS thread per rank;
* ``dasktrain train --devices cpu:2``: two worker processes, as dasktrain
  sets them up.

Images/s while training (from the second epoch on: the first warms up)
and the whole command's wall time. Needs mpiexec and mpi4py for the
ChainerMN rows (``pip install -e .[mpi]``); without them they are left
out, saying so. Prints a Markdown table; ``--json`` keeps the runs.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / 'chainer_example' / 'train_cifar.py'


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
    env.update(OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1',
               MKL_NUM_THREADS='1')
    return argv, env


def timed(argv, env, cwd):
    began = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=3600)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        sys.exit(f'{" ".join(argv[:3])} failed ({done.returncode}):\n'
                 f'{done.stdout[-2000:]}\n{done.stderr[-3000:]}')
    return done.stdout, wall


def plain(args, data, folder, mpi=None):
    argv = [sys.executable, str(SCRIPT), '--data', str(data),
            '--epoch', str(args.epochs), '--n-train', str(args.n_train),
            '--n-test', str(args.n_test), '--out', str(folder)]
    env = dict(os.environ)
    if mpi:
        argv, env = mpi[0] + argv + ['--chainermn'], mpi[1]
    out, wall = timed(argv, env, folder.parent)
    found = re.search(r'throughput: ([\d.]+) images/s', out)
    return {'images_per_s': float(found.group(1)), 'wall_s': wall}


def dasktrain(args, data, folder, devices):
    exe = str(Path(sys.executable).with_name('dasktrain'))
    argv = [exe, 'train', '--model', 'cifar10', '--devices', devices,
            '--epochs', str(args.epochs), '--train-size', str(args.n_train),
            '--test-size', str(args.n_test), '--augment', 'none',
            '--data-dir', str(data.parent), '--out', str(folder),
            '--batch-size', '100']
    _, wall = timed(argv, dict(os.environ), folder.parent)
    rows = json.loads((folder / 'log').read_text())[1:]
    return {'images_per_s': statistics.mean(r['images_per_sec']
                                            for r in rows), 'wall_s': wall}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--epochs', type=int, default=3)
    parser.add_argument('--n-train', type=int, default=4000)
    parser.add_argument('--n-test', type=int, default=1000)
    parser.add_argument('--json', type=Path, default=None)
    args = parser.parse_args(argv)
    from dasktrain.bench import machine, synthetic_cifar10
    work = Path(tempfile.mkdtemp(prefix='dasktrain-vs-chainer-'))
    data = synthetic_cifar10(work / 'data', n_train=max(args.n_train, 5),
                             n_test=args.n_test)
    ways = {'plain Chainer, 1 process':
            lambda f: plain(args, data, f),
            'dasktrain train --devices cpu':
            lambda f: dasktrain(args, data, f, 'cpu')}
    if shutil.which('mpiexec'):
        mpi = mpiexec(2)
        ways['ChainerMN, mpiexec -n 2'] = lambda f: plain(args, data, f, mpi)
    else:
        print('no mpiexec: the ChainerMN row is left out', file=sys.stderr)
    ways['dasktrain train --devices cpu:2'] = \
        lambda f: dasktrain(args, data, f, 'cpu:2')
    runs = {name: [] for name in ways}
    for r in range(args.rounds):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for name in order:
            folder = work / f'{r}-{list(ways).index(name)}'
            got = ways[name](folder)
            runs[name].append(got)
            print(f'round {r + 1} {name}: {got["images_per_s"]:.1f} '
                  f'images/s, {got["wall_s"]:.1f} s wall', file=sys.stderr,
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps({'machine': machine(),
                                         'args': vars(args) | {'json': None},
                                         'runs': runs}, indent=1))
    report(runs, args, machine())
    shutil.rmtree(work, ignore_errors=True)


def report(runs, args, machine):
    print(f'\nMachine: {machine}; seed network, {args.n_train} synthetic '
          f'images, batch 100 per process, {args.epochs} epochs, median of '
          f'{args.rounds} interleaved rounds\n')
    print('| run | images/s while training | wall s | vs plain Chainer |')
    print('|---|---:|---:|---:|')
    base = statistics.median(g['images_per_s']
                             for g in runs['plain Chainer, 1 process'])
    for name, got in runs.items():
        speed = statistics.median(g['images_per_s'] for g in got)
        wall = statistics.median(g['wall_s'] for g in got)
        print(f'| {name} | {speed:.1f} | {wall:.1f} | {speed / base:.2f}x |')


if __name__ == '__main__':
    main()
