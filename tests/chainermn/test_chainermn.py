"""``dasktrain launch`` and ``dasktrain.chainermn`` with real processes:
a ChainerMN script (bench/chainermn_example/train_mnist.py), as it is or
with its import line changed, trains as one process on the whole batch; the
communicator's calls between two ranks; a rank that fails, is killed or
hangs ends the job with one line; Ctrl-C leaves no process; a launch
runs as a job of the queue; the same script under ``mpiexec`` with real
ChainerMN gives the same accuracy curve."""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.children import child

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / 'bench' / 'chainermn_example' / 'train_mnist.py'
SMALL = ['--epoch', '2', '--n-train', '256', '--n-test', '64',
         '--batchsize', '16', '--unit', '20']


def dasktrain_script(folder):
    """The example with its one line changed, as a user would."""
    text = SCRIPT.read_text()
    assert '\nimport chainermn\n' in text
    path = folder / 'train_dasktrain.py'
    path.write_text(text.replace('\nimport chainermn\n',
                                 '\nimport dasktrain.chainermn as '
                                 'chainermn\n'))
    return path


def launch(folder, n, program, *options, timeout=120):
    """``dasktrain launch -n N`` of ``program``: (exit code, stdout,
    stderr); every process it started is gone when it returns."""
    argv = [sys.executable, '-m', 'dasktrain.cli', 'launch', '-n', str(n),
            '--out', str(folder / 'ranks'), *options, '--',
            sys.executable, *map(str, program)]
    with child(argv, cwd=folder) as proc:
        code = proc.wait(timeout)
        err = proc.stderr()
        out = ''.join(proc.lines)
    assert_no_process_left(folder)
    return code, out, err


def assert_no_process_left(folder, within=10):
    """No process runs with ``folder`` in its command line."""
    deadline = time.monotonic() + within
    while True:
        left = []
        for p in psutil.process_iter(['cmdline']):
            try:
                if any(str(folder) in a for a in p.info['cmdline'] or ()):
                    left.append(p)
            except psutil.Error:
                continue
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for p in left:
        p.kill()
    assert not left, f'left running: {[p.info["cmdline"] for p in left]}'


def params(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.equivalence
@pytest.mark.parametrize('extra', [[], ['--double-buffering']],
                         ids=['exact', 'double-buffered'])
def test_two_ranks_train_as_one_process_on_the_whole_batch(tmp_path,
                                                          float64, extra):
    # Double-buffered: ChainerMN's one-step-stale updates, which one
    # process makes too (its sums are its own gradients).
    script = dasktrain_script(tmp_path)
    code, out, err = launch(tmp_path, 2, [script, *SMALL, *extra, '--out',
                                          tmp_path / 'two'])
    assert code == 0, err
    assert 'Num process (COMM_WORLD): 2' in out  # rank 0's, live
    assert "'naive' runs on shared memory among 2 ranks" in err
    assert (tmp_path / 'two' / 'snapshot_iter_16').exists()
    assert 'Num process' not in (tmp_path / 'ranks' / 'rank1.log') \
        .read_text()  # rank 1 prints nothing; its log is its own
    one = subprocess.run(
        [sys.executable, script, *SMALL, *extra, '--out',
         tmp_path / 'one', '--reference-ranks', '2'], cwd=tmp_path,
        capture_output=True,
        text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    two, one = (params(tmp_path / d / 'model.npz') for d in ('two', 'one'))
    # avg_var is ChainerMN's own running variance, whose unbiasing uses
    # the per-rank batch size: it differs by design, and only there.
    for key in sorted(one):
        if not key.endswith('avg_var'):
            np.testing.assert_allclose(two[key], one[key], rtol=0,
                                       atol=1e-10, err_msg=key)


FAIL_AT = """
    if os.environ.get('FAIL_AT'):  # the test's: a crash mid-run
        @training.make_extension(
            trigger=(int(os.environ['FAIL_AT']), 'iteration'))
        def crash(trainer):
            if comm.rank == 1:
                os._exit(3)
        trainer.extend(crash)
    start = time.perf_counter()
"""


def test_the_checkpointer_resumes_a_crashed_job(tmp_path, monkeypatch):
    """A rank dies in epoch 2; launched again, every rank resumes from the
    checkpoint of epoch 1 that all of them wrote (ChainerMN's
    ``maybe_load``). The other rank must be stopped, not unwound by an
    exception: Chainer's finalize would delete its checkpoint."""
    script = dasktrain_script(tmp_path)
    text = script.read_text().replace(
        '    start = time.perf_counter()\n', FAIL_AT, 1)
    script.write_text('import os\n' + text)
    args = [script, *SMALL[2:], '--epoch', '3', '--out', tmp_path / 'run']
    monkeypatch.setenv('FAIL_AT', '12')  # 8 iterations per epoch
    code, _, err = launch(tmp_path, 2, args)
    assert code == 3 and 'rank 1 failed (exit 3)' in err
    # rank 0 was stopped, not unwound: its checkpoint is still there
    saved = sorted(p.name for p in (tmp_path / 'run').glob('mnist.*'))
    assert saved == ['mnist.0.8', 'mnist.1.8']
    monkeypatch.delenv('FAIL_AT')
    code, _, err = launch(tmp_path, 2, args)
    assert code == 0, err

    # The script asks maybe_load before it adds its LogReport (as
    # ChainerMN's example does), so the log starts again, but the
    # iterations go on from the checkpoint's 8: a fresh run logs 8, 16, 24.
    log = json.loads((tmp_path / 'run' / 'log').read_text())
    assert [row['iteration'] for row in log] == [9, 16, 24]
    assert not list((tmp_path / 'run').glob('mnist.*'))  # done: removed


API = '''
import os, sys, numpy as np, chainer
import dasktrain.chainermn as chainermn
comm = chainermn.create_communicator(sys.argv[1])
r, n = comm.rank, comm.size
assert (comm.intra_rank, comm.intra_size) == (r, n)
assert (comm.inter_rank, comm.inter_size) == (0, 1)
# one machine: NCCL would not cross the network, whether or not the
# cluster allows it in clear between machines (DASKTRAIN_CLEAR_NCCL=0 in
# test_the_communicator_between_two_ranks)
assert comm.nccl_network
assert comm.bcast_obj({'from': r}, root=1) == {'from': 1}
assert comm.gather_obj(r * 10) == ([0, 10] if r == 0 else None)
assert comm.gather_obj(r, root=1) == ([0, 1] if r == 1 else None)
assert comm.allreduce_obj(r + 1.0) == 3.0
x = np.arange(4.0) * (r + 1)
np.testing.assert_array_equal(comm.allreduce(x), np.arange(4.0) * 3)
np.testing.assert_array_equal(x, np.arange(4.0) * (r + 1))  # untouched
np.testing.assert_array_equal(comm.bcast(x), np.arange(4.0))
if r == 0:
    comm.send(np.ones(3), dest=1, tag=7)
    comm.send([np.zeros(2), np.ones(1)], dest=1, tag=0)
    comm.send_obj('hello', dest=1)
else:
    np.testing.assert_array_equal(comm.recv(0, tag=7), np.ones(3))
    got = comm.recv(0)
    assert isinstance(got, tuple) and len(got) == 2
    assert comm.recv_obj(0) == 'hello'
link = chainer.links.Linear(3, 2)
link.W.array[...] = r
link.cleargrads()
link.W.grad = np.full((2, 3), float(r), dtype=link.W.dtype)
comm.bcast_data(link)
assert (link.W.array == 0).all()
comm.multi_node_mean_grad(link, zero_fill=True)
assert (link.W.grad == 0.5).all() and (link.b.grad == 0).all()
train = chainermn.scatter_dataset(list(range(10)) if r == 0 else None,
                                  comm, shuffle=True, seed=3)
parts = comm.allgather(np.array(list(train)))
order = np.random.RandomState(3).permutation(10)
np.testing.assert_array_equal(np.concatenate(parts), order)
# double buffering: the mean arrives while the next step goes on
link.cleargrads()
link.W.grad = np.full((2, 3), float(r + 1), dtype=link.W.dtype)
link.b.grad = np.zeros(2, dtype=link.b.dtype)
comm.multi_node_mean_grad_async(link)
comm.wait_mean()
assert (link.W.grad == 1.5).all(), link.W.grad
optimizer = chainermn.create_multi_node_optimizer(
    chainer.optimizers.SGD(), comm, double_buffering=True)
print(f'rank {r}: double buffering is', type(optimizer).__name__)
comm.finalize()
print(f'rank {r} ok')
'''


@pytest.mark.parametrize('shared', ['1', '0'], ids=['shm', 'tls'])
def test_the_communicator_between_two_ranks(tmp_path, monkeypatch, shared):
    script = tmp_path / 'api.py'
    script.write_text(API)
    monkeypatch.setenv('DASKTRAIN_SHARED_MEMORY', shared)
    monkeypatch.setenv('DASKTRAIN_CLEAR_NCCL', '0')
    code, out, err = launch(tmp_path, 2, [script, 'hierarchical'])
    assert code == 0, err
    assert ('on shared memory' if shared == '1' else
            'on TLS/TCP peer-to-peer connections') in err
    assert 'rank 0 ok' in out
    assert 'rank 1 ok' in (tmp_path / 'ranks' / 'rank1.log').read_text()
    assert 'rank 0: double buffering is DoubleBufferingOptimizer' in out


FAILS = '''
import os, signal, sys, time
import dasktrain.chainermn as chainermn
comm = chainermn.create_communicator()
open(f'pid{comm.rank}', 'w').write(str(os.getpid()))
if comm.rank == 1:
    if sys.argv[1] == 'raise':
        print('rank 1 about to fail')
        raise ValueError('the user code broke')
    if sys.argv[1] == 'kill':
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == 'hang':
        time.sleep(600)
comm.allreduce_obj(1)  # rank 0 waits for rank 1 here
time.sleep(600)
'''


@pytest.mark.parametrize('how, code, line', [
    ('raise', 1, 'rank 1 failed (exit 1): ValueError: the user code broke'),
    ('kill', 128 + 9, 'rank 1 failed (killed by SIGKILL)'),
    ('hang', 1, 'rank 0 failed (exit 1)'),
])
def test_a_failing_rank_ends_the_job_with_one_line(tmp_path, how, code,
                                                   line):
    script = tmp_path / 'fails.py'
    script.write_text(FAILS)
    started = time.monotonic()
    got, out, err = launch(tmp_path, 2, [script, how], '--timeout', '8')
    assert got == code, err
    assert line in err
    assert time.monotonic() - started < 60
    lines = [x for x in err.splitlines() if 'failed (' in x]
    assert len(lines) == 1, err
    if how == 'raise':  # the user's own traceback, in full
        assert 'Traceback' in err and 'rank 1 about to fail' in err
    if how == 'hang':
        assert 'no answer from rank(s) [1]' in err


@pytest.mark.parametrize('signum, group', [
    (signal.SIGINT, True),  # a terminal's Ctrl-C: the whole group
    (signal.SIGTERM, False),  # a queue's cancel, or kill PID
], ids=['ctrl-c', 'sigterm'])
def test_ctrl_c_or_sigterm_stops_every_rank(tmp_path, signum, group):
    script = tmp_path / 'fails.py'
    script.write_text(FAILS)
    argv = [sys.executable, '-m', 'dasktrain.cli', 'launch', '-n', '2',
            '--out', str(tmp_path / 'ranks'), '--', sys.executable,
            str(script), 'wait']
    with child(argv, cwd=tmp_path) as proc:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f'pid{r}').exists() for r in (0, 1)):
            assert time.monotonic() < deadline, proc.stderr(0)
            assert proc.proc.poll() is None, proc.stderr()
            time.sleep(0.2)
        pids = [int((tmp_path / f'pid{r}').read_text()) for r in (0, 1)]
        if group:
            os.killpg(proc.proc.pid, signum)
        else:
            os.kill(proc.proc.pid, signum)
        assert proc.wait(60) == 130
        err = proc.stderr()
    assert 'dasktrain launch: interrupted' in err
    assert 'Traceback' not in err
    for pid in pids:
        assert not psutil.pid_exists(pid) or \
            psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert_no_process_left(tmp_path)


def test_a_launch_on_a_running_cluster(tmp_path):
    """``--scheduler``: the ranks hold the workers' CPU slots, and a
    cluster with too few says so in one line before anything starts."""
    from distributed import Client
    from test_cluster import Processes
    job = tmp_path / 'job'  # the ranks' marker, not the cluster's
    job.mkdir()
    script = job / 'api.py'
    script.write_text(API)
    procs = Processes(tmp_path)
    try:
        procs.worker(resources='CPU=1', nthreads=2)
        with Client(procs.address) as client:
            client.wait_for_workers(1)
        code, _, err = launch(job, 2, [script, 'flat'], '--scheduler',
                              procs.address)
        assert code == 1
        assert 'dasktrain launch: error: 2 ranks must run at once and the '\
               'cluster has 1 CPU slots' in err
        assert 'Traceback' not in err
        procs.worker(resources='CPU=1', nthreads=2)
        with Client(procs.address) as client:
            client.wait_for_workers(2)
        code, out, err = launch(job, 2, [script, 'flat'], '--scheduler',
                                procs.address)
        assert code == 0, err
        assert 'rank 0 ok' in out
        assert 'on TLS/TCP peer-to-peer connections' not in err  # one host
        assert "'flat' runs on shared memory among 2 ranks" in err
    finally:
        procs.close()


def test_a_launch_is_a_job_of_the_queue(tmp_path, monkeypatch, capsys):
    """``dasktrain submit --gpus 2 -- dasktrain launch -n 2 -- ...``."""
    from distributed import Client
    from test_cluster import Processes
    from test_programs import wait_for_end

    from dasktrain.cli import main
    from dasktrain.jobs.job import Job
    script = tmp_path / 'api.py'
    script.write_text(API)
    procs = Processes(tmp_path)
    try:
        procs.worker(gpus=2)
        with Client(procs.address) as client:
            client.wait_for_workers(1)
        monkeypatch.chdir(tmp_path)
        jobs = tmp_path / 'jobs'
        dasktrain = str(Path(sys.executable).with_name('dasktrain'))
        assert main(['submit', '--gpus', '2', '--scheduler', procs.address,
                     '--jobs-dir', str(jobs), '--', dasktrain, 'launch',
                     '-n', '2', '--out', str(tmp_path / 'ranks'), '--',
                     sys.executable, str(script), 'naive']) == 0
        job_id = capsys.readouterr().out.strip()
        job = Job(job_id, jobs / job_id)
        status = wait_for_end(job, timeout=180)
        assert status['state'] == 'finished', job.logs()
        assert 'rank 0 ok' in job.logs()
    finally:
        procs.close()
    assert_no_process_left(tmp_path)


def test_mistakes_are_one_line(tmp_path):
    code, _, err = launch(tmp_path, 2, [tmp_path / 'none.py'])
    assert code != 0  # python itself says the file is missing
    cases = [(['-n', '0', '--', 'true'], '-n must be >= 1'),
             (['-n', '2'], 'give the program after --'),
             (['-n', '2', '--devices', '0', '--', 'true'],
              '--devices 0 names 1 distinct GPU for 2 ranks'),
             (['-n', '2', '--', 'no-such-program-xyz'],
              'cannot start no-such-program-xyz: no such program')]
    for args, words in cases:
        run = subprocess.run([sys.executable, '-m', 'dasktrain.cli',
                              'launch', *args], capture_output=True,
                             text=True, timeout=60, cwd=tmp_path)
        assert run.returncode != 0 and words in run.stderr, run.stderr
        assert 'Traceback' not in run.stderr


def test_what_remains_unsupported_names_itself():
    import chainer

    import dasktrain.chainermn as chainermn
    comm = chainermn.create_communicator('pure_nccl')
    assert (comm.rank, comm.size, comm.intra_rank, comm.inter_size) == \
        (0, 1, 0, 1)
    for name in chainermn.NAMES:
        assert chainermn.create_communicator(name).size == 1
    with pytest.raises(ValueError, match='unrecognized communicator'):
        chainermn.create_communicator('mpi')
    assert isinstance(chainermn.create_multi_node_optimizer(
        chainer.optimizers.SGD(), comm, double_buffering=True),
        chainermn.DoubleBufferingOptimizer)
    with pytest.raises(chainermn.Unsupported, match='mpi_comm'):
        chainermn.create_communicator(mpi_comm=object())
    # ChainerMN's rules for allreduce_grad_dtype, and its configs
    half = chainermn.create_communicator(allreduce_grad_dtype='float16')
    assert half.get_config('allreduce_grad_dtype') == np.float16
    assert half.get_config() == {'allreduce_grad_dtype': np.float16,
                                 'batched_copy': True}
    with pytest.raises(ValueError, match="only available at 'pure_nccl'"):
        chainermn.create_communicator('naive', allreduce_grad_dtype='float16')
    with pytest.raises(ValueError, match='must be numpy.float16'):
        chainermn.create_communicator(allreduce_grad_dtype='int32')
    with pytest.raises(ValueError, match='Unknown config'):
        comm.set_config('bucket_size', 3)
    for backend in ('auto', 'mpi', 'nccl'):  # all: the comm's transport
        chainermn.links.MultiNodeBatchNormalization(
            3, comm, communication_backend=backend)
    with pytest.raises(ValueError, match="does not support 'gloo'"):
        chainermn.links.MultiNodeBatchNormalization(
            3, comm, communication_backend='gloo')
    # a job of one rank: every call is its own answer
    assert comm.split(3, 0).size == 1
    x = np.arange(3.0)
    assert comm.allgather(x)[0] is not x
    np.testing.assert_array_equal(comm.alltoall([x])[0], x)
    np.testing.assert_array_equal(comm.scatter(x[None]), x)


def _mpi_problem():
    if shutil.which('mpiexec') is None:
        return 'no mpiexec (apt-get install openmpi-bin libopenmpi-dev)'
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return 'no mpi4py (pip install -e .[mpi])'
    return None


def mpiexec(n):
    """``mpiexec -n N`` and its environment for this machine, as the
    benchmark runs it (bench/chainermn.py, loaded by path: on sys.path
    its name would hide the real chainermn)."""
    spec = importlib.util.spec_from_file_location(
        'bench_chainermn', ROOT / 'bench' / 'chainermn.py')
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.mpiexec(n)


@pytest.mark.equivalence
@pytest.mark.skipif(_mpi_problem() is not None,
                    reason=str(_mpi_problem()))
def test_the_same_accuracy_curve_as_chainermn_under_mpiexec(tmp_path,
                                                           float64):
    """The same file under both: its ``import chainermn`` is dasktrain's
    under launch, ChainerMN's under mpiexec."""
    code, _, err = launch(tmp_path, 2, [SCRIPT, *SMALL,
                                        '--out', tmp_path / 'dask'])
    assert code == 0, err
    argv, env = mpiexec(2)
    # One BLAS thread per rank, as dasktrain launch gives CPU ranks.
    env.update(OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1')
    mpi = subprocess.run(
        [*argv, sys.executable, SCRIPT, *SMALL, '--out',
         tmp_path / 'mpi'], cwd=tmp_path, capture_output=True, text=True,
        timeout=180, env=env)
    assert mpi.returncode == 0, mpi.stderr[-3000:]
    curves = []
    for folder in ('dask', 'mpi'):
        log = json.loads((tmp_path / folder / 'log').read_text())
        curves.append([row['validation/main/accuracy'] for row in log])
    assert len(curves[0]) == 2
    np.testing.assert_allclose(curves[0], curves[1], rtol=0, atol=1e-9)
    two, mpi_params = (params(tmp_path / d / 'model.npz')
                       for d in ('dask', 'mpi'))
    for key in two:
        np.testing.assert_allclose(two[key], mpi_params[key], rtol=0,
                                   atol=1e-10, err_msg=key)


def test_launch_logs_go_to_a_new_folder_under_runs(tmp_path, monkeypatch):
    from dasktrain.training.outdir import launch_folder
    monkeypatch.chdir(tmp_path)
    first, second = launch_folder(now=0.0), launch_folder(now=0.0)
    stamp = time.strftime('launch-%Y%m%d-%H%M%S', time.localtime(0.0))
    # under runs/, not loose in the working folder; a launch of the same
    # second gets a folder of its own, never the other's rank logs
    assert first == tmp_path / 'runs' / stamp
    assert second == tmp_path / 'runs' / f'{stamp}-2'
    assert first.is_dir() and second.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ['runs']


def test_a_launch_here_never_imports_dask(tmp_path):
    # CPU ranks on this machine meet through rank 0: the launching
    # process starts no Dask and imports none, from start to exit (its
    # import alone is half a second of every launch's wall time), nor
    # NumPy (its import, about 0.05 s before the ranks begin).
    (tmp_path / 'hi.py').write_text('print("hi", flush=True)\n')
    program = textwrap.dedent(f'''
        import sys
        from dasktrain.cli import main
        code = main(['launch', '-n', '2', '--out', {str(tmp_path / 'ranks')!r},
                     '--', sys.executable, {str(tmp_path / 'hi.py')!r}])
        print('code', code, 'dask' in sys.modules,
              'distributed' in sys.modules, 'numpy' in sys.modules,
              flush=True)
    ''')
    with child([sys.executable, '-c', program], cwd=tmp_path) as proc:
        assert proc.wait(120) == 0, proc.stderr()
        out = proc.stdout()
    assert 'code 0 False False False' in out, out


MEETS = textwrap.dedent('''
    import os, sys
    import chainermn
    comm = chainermn.create_communicator('naive')
    total = comm.allreduce_obj(comm.rank + 1)
    if comm.rank == 0:
        print('met', total, os.environ['DASKTRAIN_LISTEN'].split(':')[0],
              [m for m in ('distributed', 'cryptography')
               if m in sys.modules], flush=True)
''')


def test_ranks_meet_over_unix_sockets_and_import_no_dask(tmp_path):
    # A rank's import of distributed and its TLS was most of what a
    # script's start took beyond mpiexec's.
    (tmp_path / 'meets.py').write_text(MEETS)
    code, out, err = launch(tmp_path, 2, [tmp_path / 'meets.py'])
    assert code == 0, err
    assert 'met 3 unix []' in out, out


def test_a_tmpdir_too_long_for_sockets_meets_over_tls(tmp_path):
    # sockaddr_un holds 107 bytes: a folder deeper than that has no room
    # for a socket's path, and the ranks listen on 127.0.0.1 with TLS.
    deep = tmp_path / ('d' * 100)
    deep.mkdir()
    (tmp_path / 'meets.py').write_text(MEETS)
    argv = [sys.executable, '-m', 'dasktrain.cli', 'launch', '-n', '2',
            '--out', str(tmp_path / 'ranks'), '--', sys.executable,
            str(tmp_path / 'meets.py')]
    with child(argv, cwd=tmp_path, env=dict(os.environ,
                                            TMPDIR=str(deep))) as proc:
        code = proc.wait(120)
        err, out = proc.stderr(), ''.join(proc.lines)
    assert code == 0, err
    assert "met 3 tls ['distributed']" in out, out
    assert os.listdir(deep) == []  # its folders and certificate gone
