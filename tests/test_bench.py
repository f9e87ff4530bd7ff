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


def test_bench_allreduce_times_shared_memory_tcp_and_says_what_of_mpi(
        capsys):
    assert main(['bench', 'allreduce', '--mbytes', '0.5', '--iterations',
                 '2', '--rounds', '1']) == 0
    out = capsys.readouterr().out
    times = dict(re.findall(r'\| dasktrain all-reduce, ([a-z ]+) \| '
                            r'([\d,.]+) \| ms \|', out))
    assert set(times) == {'shared memory', 'tcp'}
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
