"""``dasktrain launch -n 2`` against ``mpiexec -n 2`` with real ChainerMN,
on the same scripts, unchanged (their ``import chainermn`` is dasktrain's
under ``launch``), on this machine, interleaved round by round: images/s
while training and wall time to the same epoch (the whole command:
start-up, rendezvous, training, exit). Two kinds of parallelism:

* ``data``: bench/chainermn_example/train_mnist.py, two replicas of an
  MLP averaging their gradients;
* ``model``: bench/chainermn_example/train_mnist_model_parallel.py, one
  MLP split over the two ranks (``MultiNodeChainList``: activations one
  way, gradients back, every step).

    .venv/bin/python bench/chainermn.py --rounds 3

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
           'train_mnist_model_parallel.py'}


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


def run(argv, env, cwd):
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=1800)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f'{argv[0]} failed ({done.returncode}):\n'
                 f'{done.stderr[-3000:]}')
    found = re.search(r'throughput: ([\d.]+) images/s, ([\d.]+) s',
                      done.stdout)
    return {'images_per_s': float(found.group(1)),
            'train_s': float(found.group(2)), 'wall_s': wall}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--epochs', type=int, default=2)
    parser.add_argument('--kinds', default='data,model',
                        help='data, model or both (default: %(default)s)')
    parser.add_argument('--unit', type=int, default=2000,
                        help='2000: 5.6 M parameters, 22 MB of float32 '
                             'gradients per step')
    parser.add_argument('--n-train', type=int, default=4000)
    parser.add_argument('--batchsize', type=int, default=100)
    parser.add_argument('--out', default='results/bench-chainermn')
    args = parser.parse_args()
    kinds = args.kinds.split(',')
    if not set(kinds) <= set(SCRIPTS):
        parser.error(f'--kinds takes data and model, got {args.kinds!r}')
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix='bench-chainermn-'))
    common = ['--epoch', str(args.epochs), '--n-train', str(args.n_train),
              '--n-test', '500', '--unit', str(args.unit),
              '--batchsize', str(args.batchsize)]
    mpi_argv, mpi_env = mpiexec(2)
    # One BLAS thread per rank for both (dasktrain launch's CPU default).
    mpi_env.update(OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1',
                   MKL_NUM_THREADS='1')
    launch_env = dict(mpi_env)
    dasktrain = str(Path(sys.executable).with_name('dasktrain'))
    launchers = ('dasktrain launch', 'mpiexec + ChainerMN')
    runs = {kind: {name: [] for name in launchers} for kind in kinds}
    try:  # the runs' folders go with it, whatever happens
        for r in range(args.rounds):
            for kind in kinds:
                script = str(SCRIPTS[kind])
                for name in (launchers if r % 2 == 0 else launchers[::-1]):
                    folder = work / f'{r}-{kind}-{name.split()[0]}'
                    if name.startswith('dasktrain'):
                        argv = [dasktrain, 'launch', '-n', '2', '--out',
                                str(folder / 'ranks'), '--', sys.executable,
                                script, *common, '--out', str(folder)]
                        got = run(argv, launch_env, work)
                    else:
                        argv = [*mpi_argv, sys.executable, script, *common,
                                '--out', str(folder)]
                        got = run(argv, mpi_env, work)
                    runs[kind][name].append(got)
                    print(f'round {r + 1} {kind} {name}: '
                          f'{got["images_per_s"]:.0f} images/s, '
                          f'{got["train_s"]:.1f} s training, '
                          f'{got["wall_s"]:.1f} s wall', file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    machine = (f'{platform.node()}: {os.cpu_count()} CPUs '
               f'({platform.processor() or platform.machine()}), shared '
               'with other work while measured')
    (out / 'chainermn.json').write_text(json.dumps(
        {'machine': machine, 'args': vars(args), 'runs': runs}, indent=2))
    print(f'\n{machine}; {args.epochs} epochs of {args.n_train} images, '
          f'MLP 784-{args.unit}-{args.unit}-10, batch {args.batchsize}, '
          f'2 CPU ranks, median of {args.rounds} interleaved rounds\n')
    print('| parallelism | launcher | images/s | training s | '
          'wall s to the last epoch |')
    print('|---|---|---|---|---|')
    for kind, by_launcher in runs.items():
        for name, got in by_launcher.items():
            med = {k: statistics.median(g[k] for g in got) for k in got[0]}
            print(f'| {kind} | {name} | {med["images_per_s"]:.0f} | '
                  f'{med["train_s"]:.1f} | {med["wall_s"]:.1f} |')


if __name__ == '__main__':
    main()
