import re

from dasktrain.cli import main


def test_bench_augment_prints_a_table_of_real_measurements(capsys):
    assert main(['bench', 'augment', '--images', '800', '--chunk', '200',
                 '--repeats', '1', '--trainer-rate', '50000']) == 0
    out = capsys.readouterr().out
    assert out.startswith('dasktrain bench augment')
    assert 'Machine: ' in out and ' cores' in out
    rates = [float(v.replace(',', '')) for v in
             re.findall(r'\| ([\d,.]+) \| images/s \|', out)]
    assert len(rates) == 4 and all(r > 0 for r in rates)
    assert re.search(r'parallel efficiency vs Dask with 1 worker \| \d+ %',
                     out)


def test_bench_train_compares_plain_chainer_and_the_wrapper(capsys):
    assert main(['bench', 'train', '--model', 'tiny', '--devices', 'cpu:2',
                 '--batch-size', '8', '--iterations', '2', '--repeats', '1',
                 '--epoch-images', '64']) == 0
    out = capsys.readouterr().out
    rates = [float(v.replace(',', '')) for v in
             re.findall(r'\| ([\d,.]+) \| images/s \|', out)]
    assert len(rates) == 3 and all(r > 0 for r in rates)
    for row in ('wrapper overhead vs plain loop', 'scaling efficiency, 2',
                'step split: gradient merge', 'data wait share'):
        assert row in out


def test_bench_usage_errors(capsys):
    assert main(['bench', 'train', '--iterations', '0']) == 2
    assert capsys.readouterr().err.splitlines()[1:] == [
        'dasktrain bench train: error: --iterations must be >= 1, got 0',
        'see `dasktrain bench train --help`']


def test_bench_allreduce_times_shared_memory_links_and_says_what_of_mpi(
        capsys):
    assert main(['bench', 'allreduce', '--mbytes', '0.5', '--iterations',
                 '2', '--rounds', '1']) == 0
    out = capsys.readouterr().out
    times = dict(re.findall(r'\| dasktrain all-reduce, ([a-z ]+) \| '
                            r'([\d,.]+) \| ms \|', out))
    assert set(times) == {'shared memory', 'links'}
    assert all(float(v.replace(',', '')) > 0 for v in times.values())
    # MPI: a time and the ratios, or why not (mpi4py is bench-only)
    assert re.search(r'\| OpenMPI Allreduce \(mpi4py\) \| ([\d,.]+ \| ms|'
                     r'(mpi4py is not installed|no mpirun|mpirun failed))',
                     out)


def test_bench_overlap_times_dg_steps_with_and_without_buckets(capsys):
    assert main(['bench', 'overlap', '--model', 'tiny', '--batch-size', '4',
                 '--buckets', '0,0.01', '--steps', '2', '--rounds',
                 '1']) == 0
    out = capsys.readouterr().out
    steps = re.findall(r'\| dg step, (after the backward pass|buckets of '
                       r'0.01 MiB) \| ([\d,.]+) \| ms \|', out)
    assert [label for label, _ in steps] == ['after the backward pass',
                                              'buckets of 0.01 MiB']
    assert all(float(v.replace(',', '')) > 0 for _, v in steps)
    assert re.search(r'speed-up vs after the backward pass \| \d\.\d+x', out)
    assert main(['bench', 'overlap', '--buckets', '1,-2']) == 2
    assert "got '1,-2'" in capsys.readouterr().err


def _gpu_script(monkeypatch):
    """bench/gpu.py as the module ``gpu`` (a script, not in the package),
    importable by the workers it starts (they inherit ``sys.path``)."""
    import importlib
    from pathlib import Path
    bench = Path(__file__).resolve().parents[2] / 'bench'
    monkeypatch.syspath_prepend(str(bench))
    return importlib.import_module('gpu'), bench / 'gpu.py'


def test_bench_gpu_says_in_one_line_that_there_is_no_gpu(monkeypatch):
    import subprocess
    import sys

    import pytest

    from dasktrain.parallel.devices import gpu_count
    if gpu_count()[0]:
        pytest.skip('this machine has a GPU: tests/gpu runs bench/gpu.py')
    _, path = _gpu_script(monkeypatch)
    out = subprocess.run([sys.executable, str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and out.stdout == ''
    assert len(out.stderr.splitlines()) == 1
    assert out.stderr.startswith('bench/gpu.py: no GPU here (')


def test_bench_gpu_rows_from_two_ranks_on_cpu_stand_ins(monkeypatch):
    # The script's own machinery (throwaway TLS workers, the rank body
    # sent by value, its rows) on '@numpy' in place of each rank's GPU,
    # over Dask's shared memory as ranks without NCCL sum.
    import argparse

    from dasktrain.bench.benchmarks import table
    gpu, _ = _gpu_script(monkeypatch)
    rows = gpu.one_gpu('tiny', 4, 1, 1, where='@numpy')
    args = argparse.Namespace(model='tiny', batch_size=4, steps=1, rounds=1,
                              mbytes=0.1, iterations=1)
    how = gpu.rank_layout(['0'], True)[1]
    rows += gpu.rank_rows(gpu.two_ranks(['', ''], False, args, '@numpy'),
                          how, args.mbytes)
    out = table(rows, 'bench/gpu.py')
    for label, _ in gpu.CONFIGS:
        ms = re.search(rf'\| dg step, 2 ranks, {re.escape(label)} \| '
                       r'([\d,.]+) \| ms \|', out)
        assert ms and float(ms.group(1).replace(',', '')) > 0, label
    assert 'NCCL all-reduce, 0.1 MB, 2 GPUs | skipped: this machine has ' \
        'one GPU' in out
    assert '| ranks sum over | Dask shared memory, both ranks on one GPU' \
        in out
    assert re.search(r'step, GPUDistributedGradient, 1 GPU \| [\d.]+ \| ms',
                     out)
