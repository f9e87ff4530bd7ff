"""dasktrain.run.train.train: the same loop here, one process per device, or
as ranks on Dask workers (real LocalClusters on 127.0.0.1), with the same
results; lost and hung workers."""
import glob
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dasktrain.cli import main
from dasktrain.config import TrainConfig
from dasktrain.parallel.comm import CollectiveError
from dasktrain.run.train import ScaleOutError, per_device_line, train

CONSOLE = Path(sys.executable).parent / 'dasktrain'
TIME_KEYS = {'elapsed_time', 'images_per_sec', 'data_wait_time',
             'comm_time'}


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(40, 30, 5)


def cluster(n):
    from distributed import LocalCluster
    return LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                        host='127.0.0.1', dashboard_address='127.0.0.1:0',
                        env={'OMP_NUM_THREADS': '1'})


def config(data_dir, out, **kw):
    base = dict(model='tiny', epochs=2, batch_size=8, lr=0.01,
                data_dir=str(data_dir), out=str(out), progress=False)
    base.update(kw)
    return TrainConfig(**base)


def log(out):
    return json.loads((out / 'log').read_text())


def assert_same_logs(a, b):
    """The same rows but for times. Runs compared here train in float64
    (the ``float64`` fixture): processes and thread counts sum in other
    orders (BLAS kernels split their work by thread), which float64 keeps
    ~1e-15 apart where float32 drifts by 1e-7 and more after Adam or
    BatchNorm; 1e-9 still catches any wrong sum."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert set(x) == set(y)
        for key in set(x) - TIME_KEYS:
            assert y[key] == pytest.approx(x[key], rel=1e-9, abs=1e-12), key


def npz(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files if k != 'state'}


# ------------------------------------------------------------ equivalence

@pytest.mark.equivalence
@pytest.mark.processes
@pytest.mark.parametrize('mode,model,local,extra', [
    ('dg', 'cifar10', 1, {}),                 # dropout: per-replica masks
    ('ipm', 'resnet20', 2, {'mix_every': 3,   # BatchNorm, 2 x 2 replicas
                            'optimizer': 'momentum-sgd',
                            'weight_decay': 5e-4}),
])
def test_workers_give_the_results_of_one_process_with_as_many_replicas(
        data_dir, tmp_path, mode, model, local, extra, float64):
    # 40 training images in batches of 4: 20 steps over 2 epochs, six
    # mixes at mix_every=3; 16 test images. More steps prove no more and
    # cost minutes (resnet20 in float64 on 2 cores).
    sizes = dict(train_size=40, test_size=16)
    common = config(data_dir, tmp_path, model=model, mode=mode,
                    batch_size=4, **sizes, **extra)
    single = train(common.replace(
        out=str(tmp_path / 'one'), devices=('@numpy',) * 2 * local,
        in_process=True))
    with cluster(2) as c:
        address = c.scheduler_address
        assert main(['train', '--workers', '2', '--scheduler', address,
                     '--out', str(tmp_path / 'two'), '--mode', mode,
                     '--model', model, '--devices', f'cpu:{local}',
                     '--epochs', '2', '--batch-size', '4', '--lr', '0.01',
                     '--train-size', '40', '--test-size', '16',
                     '--data-dir', str(data_dir), '--no-progress',
                     *(['--mix-every', '3', '--optimizer', 'momentum-sgd',
                        '--weight-decay', '5e-4'] if extra else [])]) == 0
    assert_same_logs(single['log'], log(tmp_path / 'two'))
    one, two = (npz(tmp_path / d / 'model_final.npz') for d in ('one', 'two'))
    for key in one:
        assert two[key].dtype.kind != 'f' or two[key].dtype == np.float64
        np.testing.assert_allclose(two[key], one[key], rtol=1e-9,
                                   atol=1e-12, err_msg=key)
    if mode == 'ipm':  # every replica and optimizer state, gathered
        one, two = (npz(tmp_path / d / 'checkpoint.npz')
                    for d in ('one', 'two'))
        assert sorted(one) == sorted(two)
        for key in one:
            np.testing.assert_allclose(two[key], one[key], rtol=1e-9,
                                       atol=1e-12, err_msg=key)


def launched_train(ranks, data_dir, out, *args):
    """``dasktrain launch -n 2 -- dasktrain train --model tiny ARGS`` (its
    ranks' logs in ``ranks``, the run's in ``out``); the exit status."""
    return main(['launch', '-n', '2', '--out', str(ranks), '--',
                 str(CONSOLE), 'train', '--model', 'tiny', *args,
                 '--data-dir', str(data_dir), '--out', str(out),
                 '--no-progress'])


@pytest.mark.equivalence
@pytest.mark.processes
@pytest.mark.parametrize('mode', ['dg', 'ipm'])
def test_train_under_launch_gives_the_results_of_one_process(
        data_dir, tmp_path, mode, float64, capfd):
    # `dasktrain launch -n 2 -- dasktrain train`: two programs, one CPU
    # replica each, joined by launch's environment; the same rows and
    # weights as both replicas in one process.
    extra = {'mix_every': 3} if mode == 'ipm' else {}
    common = config(data_dir, tmp_path, mode=mode, batch_size=4,
                    train_size=40, test_size=16, **extra)
    one = train(common.replace(out=str(tmp_path / 'one'),
                               devices=('@numpy',) * 2, in_process=True))
    two = tmp_path / 'two'
    assert launched_train(
        tmp_path / 'ranks', data_dir, two, '--mode', mode, '--epochs', '2',
        '--batch-size', '4', '--lr', '0.01', '--train-size', '40',
        '--test-size', '16', *(['--mix-every', '3'] if extra else [])) == 0
    assert_same_logs(one['log'], log(two))
    for key, value in npz(tmp_path / 'one' / 'model_final.npz').items():
        np.testing.assert_allclose(npz(two / 'model_final.npz')[key], value,
                                   rtol=1e-9, atol=1e-12, err_msg=key)
    # Rank 0 tells the run (relayed by launch); the other rank says nothing
    # of it, and only rank 0 wrote OUT.
    out = capfd.readouterr().out
    assert 'on 2 launched ranks (@numpy each)' in out and \
        out.count('done: epoch 2') == 1
    assert 'done:' not in (tmp_path / 'ranks' / 'rank1.log').read_text()
    # Again without --resume: rank 0's refusal is the one told, not its
    # peer's lost connection (which may end first).
    assert launched_train(tmp_path / 'again', data_dir, two) == 1
    err = capfd.readouterr().err
    assert 'rank 0 failed (exit 1)' in err and '--resume' in err, err


def test_train_under_launch_refuses_workers_in_one_line(data_dir, tmp_path,
                                                         capfd):
    assert launched_train(tmp_path / 'ranks', data_dir, tmp_path / 'x',
                          '--workers', '2') == 1
    err = capfd.readouterr().err
    assert 'already a rank of dasktrain launch; leave --workers out' in err
    assert 'Traceback' not in err and not (tmp_path / 'x').exists()


def test_train_under_launch_refuses_two_ranks_on_one_gpu(data_dir, tmp_path,
                                                        capfd):
    # `dasktrain launch -n 2 -- dasktrain train --devices 0`: both ranks
    # name GPU 0 of this machine. They compare their GPUs through the
    # rendezvous and refuse in one line before anything starts (here
    # without CUDA: the refusal asks nothing of a GPU).
    assert launched_train(tmp_path / 'ranks', data_dir, tmp_path / 'x',
                          '--devices', '0') == 1
    err = capfd.readouterr().err
    assert 'ranks 0 and 1 would both train on GPU 0 of 127.0.0.1, which ' \
        'NCCL does not support (it may hang)' in err, err
    assert 'leave --devices out: each rank takes its own' in err
    assert 'Traceback' not in err and not (tmp_path / 'x').exists()


# ------------------------------------------------------------ failures

def _pids(client):
    return client.run(os.getpid)


@pytest.mark.equivalence
@pytest.mark.processes
def test_several_devices_train_as_one_worker_process_each(data_dir,
                                                          tmp_path, float64):
    # `dasktrain train --devices cpu:2`: two single-threaded worker
    # processes, the same results as the two replicas in one process.
    both = dict(devices=('@numpy',) * 2, mode='ipm', mix_every=3)
    here = train(config(data_dir, tmp_path / 'here', in_process=True, **both))
    apart = train(config(data_dir, tmp_path / 'apart', **both))
    assert 'workers' not in here and len(apart['workers']) == 2
    assert_same_logs(here['log'], apart['log'])
    # args records the run as asked, so that --resume places it again
    # the same way (not the per-rank view, which names no cluster).
    args = json.loads((tmp_path / 'apart' / 'args').read_text())
    assert args['workers'] is None and args['devices'] == ['@numpy'] * 2
    more = train(config(data_dir, tmp_path / 'apart', epochs=3, resume=True,
                        **both))
    assert [row['epoch'] for row in more['log']] == [1, 2, 3]
    assert len(more['workers']) == 2


@pytest.mark.equivalence
@pytest.mark.processes
def test_float16_and_double_buffered_communication(data_dir, tmp_path,
                                                   float64):
    both = dict(devices=('@numpy',) * 2, epochs=2)
    exact = train(config(data_dir, tmp_path / 'exact', **both))['log']
    half = train(config(data_dir, tmp_path / 'half', comm_dtype='float16',
                        **both))['log']
    stale = train(config(data_dir, tmp_path / 'stale', double_buffering=True,
                         **both))['log']
    for rows in (half, stale):  # as many updates as exact dg
        assert [r['iteration'] for r in rows] == \
            [r['iteration'] for r in exact]
    for a, b in zip(exact, half):  # float16 sums: close to exact
        assert b['main/loss'] == pytest.approx(a['main/loss'], rel=0.01)
    # the first epoch is an exact warm-up; then one step stale (the
    # maths: test_parallel) learns, more slowly here
    assert_same_logs(stale[:1], exact[:1])
    assert stale[1]['main/loss'] < stale[0]['main/loss']
    # float16 rounds the sums; one-step-stale updates follow another path
    assert half[-1]['main/loss'] != exact[-1]['main/loss']
    assert stale[-1]['main/loss'] != exact[-1]['main/loss']
    # the communication thread changes nothing: the same replicas in one
    # process, double-buffered there too, give the same bits
    here = train(config(data_dir, tmp_path / 'stale-here', in_process=True,
                        double_buffering=True, **both))['log']
    assert_same_logs(here, stale)


@pytest.mark.parametrize('policy', ['continue', 'wait'])
def test_a_worker_killed_mid_job_and_the_job_goes_on(data_dir, tmp_path,
                                                      policy, float64):
    from distributed import Client
    common = config(data_dir, tmp_path, epochs=4, mode='ipm',
                    mix_every='epoch', workers=2, on_worker_loss=policy)
    killed = []
    before = set(glob.glob('/dev/shm/dasktrain-*'))  # others' are theirs
    with cluster(2) as c, Client(c) as client:
        pids = _pids(client)

        def kill_after_epoch_2(row):
            if row['epoch'] == 2 and not killed:
                victim = sorted(pids)[1]
                killed.append(victim)
                os.kill(pids[victim], signal.SIGKILL)

        summary = train(common.replace(out=str(tmp_path / 'k')),
                        callbacks=[kill_after_epoch_2], client=client)
    assert killed and summary['attempts'] == 2
    assert killed[0] not in summary['workers']
    # the shared-memory segments were unlinked once mapped: none outlives
    # its job, not even one of the SIGKILLed worker's (a test running
    # beside this one has its own for a moment: theirs go too)
    from test_cluster import wait_until
    wait_until(lambda: set(glob.glob('/dev/shm/dasktrain-*')) <= before, 15,
               "no segment of this job's left")
    rows = log(tmp_path / 'k')
    assert [r['epoch'] for r in rows] == [1, 2, 3, 4]
    if policy == 'wait':  # the nanny's new worker replaced the dead one
        assert len(summary['workers']) == 2
        return
    # Nothing before the checkpoint was lost: the first two epochs are those
    # of an uninterrupted run; the last two trained on the one worker left.
    with cluster(2) as c:
        whole = train(common.replace(out=str(tmp_path / 'w'),
                                     scheduler=c.scheduler_address))
    assert_same_logs(whole['log'][:2], rows[:2])
    assert len(summary['workers']) == 1
    assert rows[3]['iteration'] > whole['log'][3]['iteration']  # 1 replica
    assert rows[-1]['validation/main/accuracy'] > 0.3  # chance: 0.1


def test_a_hung_worker_fails_the_job_after_the_collective_timeout(
        data_dir, tmp_path):
    from distributed import Client
    with cluster(2) as c, Client(c) as client:
        pids = _pids(client)
        stopped = []

        def hang_after_epoch_1(row):
            stopped.append(pids[sorted(pids)[1]])
            os.kill(stopped[0], signal.SIGSTOP)

        began = time.monotonic()
        try:
            with pytest.raises(CollectiveError, match='collective_timeout'):
                train(config(data_dir, tmp_path / 'h', epochs=3, workers=2,
                             collective_timeout=3), client=client,
                      callbacks=[hang_after_epoch_1])
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        assert time.monotonic() - began < 60
    assert len(log(tmp_path / 'h')) == 1  # epoch 1 stays checkpointed


def test_asking_for_more_workers_than_the_cluster_has(dask_client, data_dir,
                                                      tmp_path):
    with pytest.raises(ScaleOutError, match='workers 3 needs 3 Dask workers'
                                            r'.*has 2'):
        train(config(data_dir, tmp_path / 'x', workers=3,
                     collective_timeout=1), client=dask_client)


def test_a_script_without_the_main_guard_is_told_to_add_it(data_dir,
                                                             tmp_path):
    import subprocess
    import sys
    script = tmp_path / 'script.py'
    script.write_text(
        'import dasktrain\n'
        f'dasktrain.train(dasktrain.TrainConfig(model="tiny", epochs=1, '
        f'devices="cpu:2", data_dir={str(data_dir)!r}, '
        f'out={str(tmp_path / "out")!r}, progress=False))\n')
    done = subprocess.run([sys.executable, str(script)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        f'dasktrain.errors.UserError: {script}, line 2, starts worker '
        "processes from the script's top level: each would run the script "
        "again. Put the calls under `if __name__ == '__main__':` (see "
        'docs/training.md)')
    assert not (tmp_path / 'out').exists()


def test_ctrl_c_in_a_terminal_ends_a_multi_process_run_in_one_line(
        data_dir, tmp_path):
    # A terminal's Ctrl-C reaches every process of its group: the command
    # and its local workers. One line, promptly, no worker tracebacks.
    import sys

    from children import child
    from test_cluster import wait_until
    argv = [sys.executable, '-m', 'dasktrain.cli', 'train', '--model',
            'tiny', '--epochs', '50', '--devices', 'cpu:2', '--data-dir',
            str(data_dir), '--out', str(tmp_path / 'r')]
    with child(argv) as run:
        wait_until(lambda: any('epoch   1/50' in line for line in run.lines),
                   120, 'the first epoch')
        os.killpg(run.proc.pid, signal.SIGINT)
        started = time.monotonic()
        assert run.wait(10) == 130
        assert time.monotonic() - started < 5
        err = run.stderr()
    assert 'Traceback' not in err
    assert err.strip().splitlines()[-1] == 'dasktrain train: interrupted'


def test_workers_train_in_the_dtype_of_each_run(data_dir, tmp_path,
                                                monkeypatch):
    # cpu:N workers fork from a server that imported Chainer once, and
    # Chainer reads CHAINER_DTYPE when it loads: a run under another
    # dtype than the server's gets spawned workers, not a stale default.
    import chainer
    small = dict(devices=('@numpy',) * 2, epochs=1, train_size=16,
                 test_size=8)
    before = chainer.global_config.dtype
    try:
        for dtype in ('float32', 'float64'):
            monkeypatch.setenv('CHAINER_DTYPE', dtype)
            chainer.global_config.dtype = np.dtype(dtype)
            train(config(data_dir, tmp_path / dtype, **small))
            weights = npz(tmp_path / dtype / 'model_final.npz')
            assert {w.dtype for w in weights.values()
                    if w.dtype.kind == 'f'} == {np.dtype(dtype)}, dtype
    finally:
        chainer.global_config.dtype = before


def test_the_line_before_one_process_per_device_is_a_plain_sentence():
    from dasktrain.errors import flag_names
    # A job's log (Python's names) shows no argument name as a word.
    assert per_device_line((0, 1)) == ('training on 2 devices (0, 1), each '
                                       'in a worker process of its own')
    with flag_names():  # the dasktrain command: what keeps them in one
        assert per_device_line(('cpu', 'cpu')) == (
            'training on 2 devices (cpu, cpu), each in a worker process of '
            'its own; --in-process trains them all in this one process')
