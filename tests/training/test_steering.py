"""Steering a running run through ChainerUI's commands file: each command
acts at its iteration and is answered (a refused one with its reason); a
snapshot or a stop within an epoch is a checkpoint that resumes bit for
bit; a malformed file is one warning; the ranks of a job act together;
`dasktrain ctl` on a run folder. Real runs on the CPU."""
import doctest
import json
import logging
import shutil
import threading

import chainer
import numpy as np
import pytest

from dasktrain.cli import main
from dasktrain.config import TrainConfig
from dasktrain.run.train import train
from dasktrain.training import (
    commandfile,
    control,
    hyperparams,
    steering,
)
from dasktrain.training.commandfile import (
    FAILURE,
    SUCCESS,
    Refused,
    request,
)
from dasktrain.training.hyperparams import Hyperparameters

TIME_KEYS = {'elapsed_time', 'images_per_sec', 'data_wait_time',
             'comm_time'}


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(100, 100, 3)  # 500 training images


def config(data_dir, out, **kw):
    base = dict(model='tiny', epochs=3, batch_size=25, devices=('@numpy',),
                data_dir=str(data_dir), out=str(out), progress=False,
                lr=0.01, optimizer='momentum-sgd', in_process=True)
    base.update(kw)
    return TrainConfig(**base)


def at(key, value):
    return {'key': key, 'value': value}


def commands(out):
    return json.loads((out / 'commands').read_text())


def answers(out):
    """{name: response} of the commands in ``out`` (the last of a name)."""
    return {c['name']: c['response'] for c in commands(out)}


def final_params(out):
    with np.load(out / 'model_final.npz') as npz:
        return {k: npz[k] for k in npz.files}


def assert_same_run(a, b, out_a, out_b):
    """The same rows but for times, and the same final weights, bit for
    bit."""
    assert len(a['log']) == len(b['log'])
    for x, y in zip(a['log'], b['log']):
        assert set(x) == set(y)
        for key in set(x) - TIME_KEYS:
            assert x[key] == y[key], key
    ours, theirs = final_params(out_a), final_params(out_b)
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        assert np.array_equal(ours[name], theirs[name]), name


def test_the_examples_hold():
    from dasktrain.commands import ctl
    from dasktrain.data import datasets
    for module in (commandfile, steering, hyperparams, control, ctl,
                   datasets):
        assert doctest.testmod(module).failed == 0, module.__name__


# ------------------------------------------------------------ decisions

def test_hyperparameters_take_the_runs_words_and_refuse_with_a_reason():
    adam = [chainer.optimizers.Adam(alpha=0.001) for _ in range(2)]
    hyper = Hyperparameters(adam)
    assert hyper.check({'hyperparam': {'lr': 0.01}}) == {'lr': 0.01}
    assert hyper.check({'hyperparam': {'alpha': 0.02}}) == {'lr': 0.02}
    # ChainerUI's form names MomentumSGD and sends its empty fields as null
    assert hyper.check({'optimizer': 'MomentumSGD',
                        'hyperparam': {'lr': 0.003, 'momentum': None}}) == \
        {'lr': 0.003}
    assert hyper.apply({'lr': 0.003, 'beta1': 0.8}) == {'lr': 0.001,
                                                         'beta1': 0.9}
    for optimizer in adam:  # every replica's optimizer
        assert optimizer.hyperparam.alpha == 0.003
        assert optimizer.hyperparam.beta1 == 0.8
    answer = hyper.answer()
    assert answer['optimizer'] == 'Adam'
    assert answer['hyperparam']['lr'] == answer['hyperparam']['alpha'] == \
        0.003
    for body, reason in [
            (None, 'its body must be'),
            ({'hyperparam': {}}, 'it asks for no change; give a value for '
                                 'one of lr (its alpha), alpha, beta1'),
            ({'hyperparam': {'momentum': 0.9}}, "optimizer is Adam, which "
                                                'has no momentum'),
            ({'optimizer': 'MomentumSGD', 'hyperparam': {'beta1': 0.5}},
             'not MomentumSGD: only lr'),
            ({'hyperparam': {'lr': -1}}, 'lr must be a finite number > 0, '
                                         'got -1'),
            ({'hyperparam': {'lr': True}}, 'lr must be a finite number, '
                                           'got true'),
            ({'hyperparam': {'lr': 'fast'}}, 'lr must be a finite number'),
            ({'hyperparam': {'beta1': 1.0}}, 'beta1 must be a number in '
                                             '[0, 1), got 1.0'),
            ({'hyperparam': {'lr': 0.1, 'amsgrad': 1}}, 'no amsgrad')]:
        with pytest.raises(Refused, match=reason.replace('(', r'\(')
                           .replace(')', r'\)').replace('[', r'\[')):
            hyper.check(body)
    sgd = Hyperparameters([chainer.optimizers.MomentumSGD(lr=0.05)])
    assert sgd.check({'optimizer': 'MomentumSGD',
                      'hyperparam': {'lr': 0.01, 'momentum': 0.5}}) == \
        {'lr': 0.01, 'momentum': 0.5}
    assert sgd.names() == 'lr, momentum'


def test_a_malformed_file_is_read_as_a_problem_never_an_error(tmp_path):
    assert commandfile.read_commands(tmp_path) == ([], None)
    for text, problem in [('{"name": "stop"}', 'holds a dict, not a list'),
                          ('[{"name": ', 'is not JSON'),
                          (' ' * (commandfile.MAX_BYTES + 1),
                           'is larger than 1 MiB')]:
        (tmp_path / 'commands').write_text(text)
        entries, why = commandfile.read_commands(tmp_path)
        assert entries is None and why.startswith(problem), why
    (tmp_path / 'commands').unlink()
    (tmp_path / 'commands').symlink_to('/etc/passwd')
    assert commandfile.read_commands(tmp_path)[0] is None
    (tmp_path / 'commands').unlink()
    key = request(tmp_path, 'stop', schedule=at('epoch', 2))
    (entry,) = commands(tmp_path)
    assert entry['request']['schedule'] == at('epoch', 2)
    assert entry['request']['status'] == 'OPEN' and entry['response'] is None
    assert commandfile.response(tmp_path, key) is None


def test_each_command_acts_at_its_iteration_and_is_answered(data_dir,
                                                            tmp_path):
    out = tmp_path / 'r'

    def send(row):  # after epoch 1 (20 iterations), as ChainerUI would
        if row['epoch'] != 1:
            return
        request(out, 'adjust_hyperparams',
                {'optimizer': 'MomentumSGD',
                 'hyperparam': {'lr': 0.02, 'momentum': None}})
        request(out, 'take_snapshot', None, at('iteration', 30))
        request(out, 'stop', None, at('epoch', 3))
        request(out, 'rewind')
        request(out, 'adjust_hyperparams', {'hyperparam': {'beta1': 0.5}})
        request(out, 'take_snapshot', None, at('iteration', 5))   # passed
        request(out, 'take_snapshot', None, at('epoch', 4))       # too late
    summary = train(config(data_dir, out, epochs=5), callbacks=[send])
    assert summary['stopped_by_request'] == {
        'epoch': 3, 'iteration': 60, 'checkpoint': str(out / 'checkpoint.npz'),
        'saved': True}
    assert [(r['epoch'], r['iteration'], r['lr']) for r in summary['log']] \
        == [(1, 20, 0.01), (2, 40, 0.02), (3, 60, 0.02)]
    got = commands(out)
    assert [c['name'] for c in got] == [
        'adjust_hyperparams', 'take_snapshot', 'stop', 'rewind',
        'adjust_hyperparams', 'take_snapshot', 'take_snapshot']
    answered = [(c['response']['status'], c['response']['epoch'],
                 c['response']['iteration']) for c in got]
    assert answered == [(SUCCESS, 1, 20), (SUCCESS, 1, 30), (SUCCESS, 3, 60),
                        (FAILURE, 1, 20), (FAILURE, 1, 20), (FAILURE, 1, 20),
                        (FAILURE, 3, 60)]
    bodies = [c['response']['body'] for c in got]
    assert bodies[0]['optimizer'] == 'MomentumSGD'
    assert bodies[0]['hyperparam'] == {'lr': 0.02, 'momentum': 0.9}
    assert bodies[0]['changed'] == {'lr': [0.01, 0.02]}
    assert bodies[1] == {'path': str(out / 'snapshot_iter_30'), 'epoch': 1,
                         'iteration': 30, 'within_epoch': True}
    assert bodies[2]['stopped'] and not bodies[2]['within_epoch']
    assert bodies[3]['message'] == (
        'rewind is not a command of this run; it takes take_snapshot, '
        'adjust_hyperparams, stop')
    assert "optimizer is MomentumSGD, which has no beta1; it takes lr, " \
        "momentum" in bodies[4]['message']
    assert bodies[5]['message'].startswith(
        'iteration 5 passed before the run read this command')
    assert bodies[6]['message'] == (
        'the run ended (stopped by request) at epoch 3, iteration 60: epoch '
        '4 never came')
    for c in got:  # ChainerUI's response, field for field
        assert set(c['response']) == {'executed_at', 'epoch', 'iteration',
                                      'elapsed_time', 'status', 'body'}
        assert c['response']['elapsed_time'] > 0
    args = json.loads((out / 'args').read_text())
    assert args['steered'] == [{'epoch': 1, 'iteration': 20,
                                'changed': {'lr': 0.02}}]
    assert args['lr'] == 0.01  # the setting: what the run was started with
    assert json.loads((out / '.chainerui_commands').read_text()) == \
        {'job_status': 'stopped'}
    assert (out / 'snapshot_iter_30').is_file()
    assert (out / 'model_final.npz').is_file()


@pytest.mark.parametrize('kw', [
    dict(model='cifar10', train_size=150, test_size=40),          # dropout
    dict(mode='ipm', devices=('@numpy',) * 2, mix_every=3,
         weight_decay=5e-4),                                      # ipm
    dict(devices=('@numpy',) * 2, double_buffering=True,
         exact_warmup=4, optimizer='adam'),                       # in flight
])
def test_a_snapshot_or_stop_within_an_epoch_resumes_bit_for_bit(
        data_dir, tmp_path, kw):
    """Run A takes a snapshot within an epoch (iteration 9: the third step
    of epoch 2 of 6 steps, the ninth of 10) and goes on; run B resumes
    from that snapshot; run C stops there and is resumed: all three end
    alike, bit for bit, also with the lr set by request."""
    common = dict(epochs=2, **kw)
    a, c = tmp_path / 'a', tmp_path / 'c'
    for out in (a, c):  # asked before the runs start: they act when due
        out.mkdir()
        request(out, 'adjust_hyperparams', {'hyperparam': {'lr': 0.02}},
                at('iteration', 2))
    request(a, 'take_snapshot', None, at('iteration', 9))
    request(c, 'stop', None, at('iteration', 9))
    whole = train(config(data_dir, a, **common))
    assert answers(a)['take_snapshot']['iteration'] == 9
    assert answers(a)['take_snapshot']['body']['within_epoch']
    stopped = train(config(data_dir, c, **common))
    assert stopped['stopped_by_request']['iteration'] == 9
    assert answers(c)['stop']['status'] == SUCCESS
    b = tmp_path / 'b'
    b.mkdir()
    shutil.copy(a / 'snapshot_iter_9', b / 'checkpoint.npz')
    resumed = train(config(data_dir, b, resume=True, **common))
    assert_same_run(whole, resumed, a, b)
    again = train(config(data_dir, c, resume=True, **common))
    assert_same_run(whole, again, a, c)
    assert all(row['lr'] == 0.02 for row in again['log'])  # kept
    args = json.loads((c / 'args').read_text())
    assert args['resumed'][0]['iteration'] == 9


def test_resume_keeps_what_was_set_by_request_unless_lr_is_given(
        data_dir, tmp_path, caplog):
    out = tmp_path / 'r'
    out.mkdir()
    request(out, 'adjust_hyperparams',
            {'hyperparam': {'lr': 0.02, 'momentum': 0.5}}, at('iteration', 5))
    train(config(data_dir, out, epochs=1))
    with caplog.at_level(logging.WARNING, logger='dasktrain'):
        log = train(config(data_dir, out, epochs=2, resume=True))['log']
    assert [(r['lr'], r['momentum']) for r in log] == [(0.02, 0.5),
                                                        (0.02, 0.5)]
    assert 'resuming with what was set by request: lr 0.02, momentum 0.5' \
        in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger='dasktrain'):
        log = train(config(data_dir, out, epochs=3, resume=True,
                           lr=0.003))['log']
    assert [(r['lr'], r['momentum']) for r in log][-1] == (0.003, 0.5)
    assert 'lr 0.003 given now replaces the lr set by request (0.02)' in \
        caplog.text


def test_a_malformed_commands_file_is_one_warning_and_the_run_goes_on(
        data_dir, tmp_path, caplog):
    out = tmp_path / 'r'
    out.mkdir()
    (out / 'commands').write_text('[{"name": "stop", ')

    def fix(row):
        if row['epoch'] == 2:  # fixed, with one entry that is not a dict
            (out / 'commands').write_text(json.dumps([
                7, {'name': 'stop', 'request': {'created_at': 'now',
                                                'status': 'OPEN',
                                                'body': None,
                                                'schedule': None},
                    'response': None}]))
    with caplog.at_level(logging.WARNING, logger='dasktrain'):
        summary = train(config(data_dir, out, epochs=4), callbacks=[fix])
    warnings = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith('warning:')]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f'warning: {out / "commands"} is not JSON')
    assert 'ignored until it is fixed' in warnings[0]
    assert [r['epoch'] for r in summary['log']] == [1, 2]
    assert summary['stopped_by_request']['epoch'] == 2
    got = commands(out)
    assert got[0] == 7 and got[1]['response']['status'] == SUCCESS


def test_a_run_says_which_augmentation_it_applies_and_why(data_dir,
                                                          tmp_path, capsys):
    train(config(data_dir, tmp_path / 'r', epochs=1, progress=True))
    out = capsys.readouterr().out
    assert "augmentation: random crop (padding 4), horizontal flip: " \
        "augment auto, on cifar10's natural images" in out.splitlines()[1]


# ------------------------------------------------------------ ctl

def test_ctl_steers_a_run_folder_and_says_what_was_done(data_dir, tmp_path,
                                                       capsys):
    out = tmp_path / 'r'
    assert main(['ctl', str(out), 'stop']) == 1
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'No such' not in err
    # neither a folder nor a job: said so, not "no job"
    for target in (str(out), 'nonexistent'):
        assert main(['ctl', target, 'stop', '--jobs-dir',
                     str(tmp_path / 'jobs')]) == 1
        assert capsys.readouterr().err == (
            f'dasktrain ctl: error: no run folder and no job named '
            f"{target!r}: give a run's folder (its --out) or a job id "
            '(`dasktrain jobs` lists them)\n')
    reached, asked = threading.Event(), threading.Event()

    def hold(row):  # epoch 1's end waits for ctl to have written
        if row['epoch'] == 1:
            reached.set()
            assert asked.wait(60)
    result = {}
    runner = threading.Thread(target=lambda: result.update(train(config(
        data_dir, out, epochs=4), callbacks=[hold])), daemon=True)
    runner.start()
    try:
        assert reached.wait(120)
        # ctl writes, then waits for the answer the run gives at the end
        # of epoch 1, once `hold` lets it go on
        watcher = threading.Thread(target=lambda: (
            _wait_for_request(out), asked.set()), daemon=True)
        watcher.start()
        assert main(['ctl', str(out), 'set', 'lr=0.04', 'momentum=0.8']) \
            == 0
        said = capsys.readouterr().out
        assert said.startswith(f'{out}: lr 0.01 -> 0.04, momentum 0.9 -> '
                               '0.8 (MomentumSGD) at iteration 20 (1 '
                               'epoch done), ')
        assert main(['ctl', str(out), 'stop', '--at', 'epoch=3']) == 0
        assert 'stop at epoch 3 requested' in capsys.readouterr().out
    finally:
        asked.set()
        runner.join(120)
    assert [r['lr'] for r in result['log']] == [0.01, 0.04, 0.04]
    assert result['stopped_by_request']['epoch'] == 3
    assert main(['ctl', str(out), 'snapshot']) == 1
    assert 'is not running (its run has stopped)' in capsys.readouterr().err
    for argv, message in [
            (['set'], 'set takes NAME=VALUE, e.g. set lr=0.01'),
            (['set', 'lr'], "set takes NAME=VALUE with a number, e.g. "
                            "lr=0.01; got 'lr'"),
            (['stop', 'lr=1'], 'stop takes no NAME=VALUE'),
            (['stop', '--at', 'epoch=x'], "--at takes epoch=N or "
                                           "iteration=N, got 'epoch=x'")]:
        assert main(['ctl', str(out), *argv]) == 2
        assert message in capsys.readouterr().err


def test_the_docs_ctl_lines_steer_the_run_the_docs_start(
        data_dir, tmp_path, monkeypatch, capsys):
    # docs/training.md's ctl block, its lines as written, on the run its
    # first line starts (smaller here, its optimizer the docs': the
    # default, Adam); what the run would refuse is refused at once.
    import re
    import shlex
    import time
    from pathlib import Path

    from dasktrain.commands import train_config
    page = (Path(__file__).resolve().parents[2] / 'docs' / 'training.md')
    block = next(b for _, b in re.findall(r'^```([^\n]*)\n(.*?)^```',
                                          page.read_text(), re.M | re.S)
                 if 'dasktrain ctl runs/' in b)
    first, *lines = block.splitlines()
    started = shlex.split(first.split('going on: ')[1].split(',')[0])
    assert started[:2] == ['dasktrain', 'train']
    docs = train_config(started[2:], 'dasktrain train')
    assert docs.optimizer == 'adam' and docs.out == 'runs/steer'
    monkeypatch.chdir(tmp_path)
    out = tmp_path / docs.out
    result = {}
    runner = threading.Thread(target=lambda: result.update(train(
        docs.replace(model='tiny', data_dir=str(data_dir), train_size=100,
                     test_size=50, batch_size=25, devices=('@numpy',),
                     progress=False),
        callbacks=[lambda row: time.sleep(1)])), daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while not (out / 'log').exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        for argv, reason in [
                (['set', 'momentum=0.8'], "set momentum=0.8 refused: this "
                 "run's optimizer is Adam, which has no momentum; it takes "
                 'lr (its alpha), alpha, beta1, beta2, eps, eta, '
                 'weight_decay_rate'),
                (['set', 'beta1=1'], 'set beta1=1 refused: beta1 must be a '
                 'number in [0, 1), got 1'),
                (['stop', '--at', 'epoch=0'], 'stop refused: epoch 0 has '
                 'passed: the run has completed '),
                (['stop', '--at', 'epoch=41'], 'stop refused: epoch 41 '
                 'never comes: the run trains 40 epochs')]:
            assert main(['ctl', docs.out, *argv]) == 1
            err = capsys.readouterr().err
            assert err.startswith(f'dasktrain ctl: error: {docs.out}: '
                                  f'{reason}'), err
        assert not (out / 'commands').exists()  # nothing asked of the run
        ran = 0
        for line in lines:
            words = shlex.split(line.split('#')[0])
            if words[2] != docs.out:  # a job's line: tests/jobs has them
                continue
            assert main(words[1:]) == 0, (line, capsys.readouterr().err)
            ran += 1
        assert ran == 5
    finally:
        runner.join(120)
    said = capsys.readouterr().out
    assert f'{docs.out}: lr 0.001 -> 0.0005 (Adam) at iteration ' in said
    assert f'{docs.out}: stopped at iteration ' in said
    assert result['stopped_by_request']['epoch'] < 10
    assert [c['response']['status'] for c in commands(out)] == [
        SUCCESS, SUCCESS, FAILURE, FAILURE, SUCCESS]  # the last stop acts


def _wait_for_request(out, timeout=60):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entries, _ = commandfile.read_commands(out)
        if entries:
            return
        time.sleep(0.05)


# ------------------------------------------------------------ ranks

@pytest.mark.equivalence
@pytest.mark.processes
@pytest.mark.parametrize('kw', [
    dict(model='cifar10'),  # dropout: per-replica streams, reseeded
    # a sum always in flight between steps: the ranks poll at epoch ends
    # only, and plan what is scheduled at an iteration
    dict(model='tiny', double_buffering=True, exact_warmup=3),
], ids=['dropout', 'double-buffered'])
def test_the_ranks_of_a_job_act_at_the_same_iteration_as_one_process(
        data_dir, tmp_path, float64, kw):
    """Two ranks on Dask workers, steered, end as one process with both
    replicas does, steered alike: every rank changed the lr, took its
    part of the snapshot and stopped at the same iteration."""
    from distributed import LocalCluster
    common = dict(batch_size=4, train_size=80, test_size=40, epochs=3, **kw)
    one, two = tmp_path / 'one', tmp_path / 'two'
    for out in (one, two):
        out.mkdir()
        request(out, 'adjust_hyperparams', {'hyperparam': {'lr': 0.02}},
                at('iteration', 7))
        request(out, 'take_snapshot', None, at('iteration', 13))
        request(out, 'stop', None, at('epoch', 2))
    single = train(config(data_dir, one, devices=('@numpy',) * 2,
                          **common))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      host='127.0.0.1', dashboard_address=None,
                      env={'OMP_NUM_THREADS': '1'}) as cluster:
        ranks = train(config(data_dir, two, in_process=False, workers=2,
                             scheduler=cluster.scheduler_address,
                             **common))
    for summary in (single, ranks):
        assert [(r['epoch'], r['iteration'], r['lr'])
                for r in summary['log']] == [(1, 10, 0.02), (2, 20, 0.02)]
        assert summary['stopped_by_request']['iteration'] == 20
    assert [(c['name'], c['response']['iteration'])
            for c in commands(one)] == [(c['name'], c['response']['iteration'])
                                        for c in commands(two)] == [
        ('adjust_hyperparams', 7), ('take_snapshot', 13), ('stop', 20)]
    for x, y in zip(single['log'], ranks['log'], strict=True):
        for key in set(x) - TIME_KEYS:
            assert y[key] == pytest.approx(x[key], rel=1e-9, abs=1e-12), key
    for name in ('model_final.npz', 'snapshot_iter_13'):
        with np.load(one / name) as a, np.load(two / name) as b:
            for key in b.files:  # dg: rank 0 saves its replica (all equal)
                if key != 'state':
                    np.testing.assert_allclose(b[key], a[key], rtol=1e-9,
                                               atol=1e-12, err_msg=key)


# ------------------------------------------------------------ jobs

def test_ctl_steers_queued_and_running_jobs_on_a_real_cluster(
        data_dir, tmp_path, capsys):
    from distributed import Client
    from test_cluster import Processes, job_config, wait_until

    from dasktrain.jobs.client.submit import submit
    procs = Processes(tmp_path)
    try:
        procs.worker(gpus=1)
        jobs = tmp_path / 'jobs'
        with Client(procs.address) as client:
            client.wait_for_workers(1)
            first = submit(job_config(data_dir, epochs=500,
                                      optimizer='momentum-sgd'),
                           gpus=1, name='long', client=client, path=jobs)
            later = submit(job_config(data_dir, epochs=20,
                                      optimizer='momentum-sgd'),
                           gpus=1, name='later', client=client, path=jobs)
        args = ['--jobs-dir', str(jobs)]
        wait_until(lambda: len(first.log_rows()) >= 1, 180, 'an epoch')
        # A queued job: what is scheduled waits for it to run; a stop now
        # is a cancel.
        assert later.status()['state'] == 'queued'
        assert main(['ctl', later.id, 'stop', *args]) == 1
        assert f'job {later.id} is queued, not running: `dasktrain cancel ' \
            f'{later.id}` takes it off the queue' in capsys.readouterr().err
        for argv in (['set', 'lr=0.02', '--at', 'iteration=12'],
                     ['snapshot', '--at', 'iteration=20'],
                     ['stop', '--at', 'epoch=4']):
            assert main(['ctl', later.id, *argv, *args]) == 0
        assert 'requested' in capsys.readouterr().out
        # A running job: each command answered, then it ends on a stop.
        assert main(['ctl', first.id, 'set', 'lr=0.05', *args]) == 0
        said = capsys.readouterr().out
        assert said.startswith(f'{first.id}: lr 0.01 -> 0.05 (MomentumSGD) '
                               'at iteration ')
        assert main(['ctl', first.id, 'snapshot', *args]) == 0
        said = capsys.readouterr().out
        snapshot = first.folder / 'out' / ('snapshot_iter_' + said.split(
            'snapshot_iter_')[1].split()[0])
        assert snapshot.is_file()
        assert main(['ctl', first.id, 'stop', *args]) == 0
        said = capsys.readouterr().out.splitlines()
        assert said[0].startswith(f'{first.id}: stopped at iteration ')
        assert said[1] == f'job {first.id}: finished (stopped by request)'
        status = first.status()
        assert status['state'] == 'finished'
        assert status['ending'] == 'stopped by request'
        assert status['epoch'] < 500
        # Then the queued one ran, steered as asked before it started.
        result = later.result(timeout=300)
        assert [(r['epoch'], r['iteration'], r['lr'])
                for r in result['log']] == [(1, 8, 0.01), (2, 16, 0.02),
                                            (3, 24, 0.02), (4, 32, 0.02)]
        out = later.folder / 'out'
        assert [(c['name'], c['response']['status'],
                 c['response']['iteration']) for c in commands(out)] == [
            ('adjust_hyperparams', SUCCESS, 12),
            ('take_snapshot', SUCCESS, 20), ('stop', SUCCESS, 32)]
        assert (out / 'snapshot_iter_20').is_file()
        assert later.status()['ending'] == 'stopped by request'
        assert main(['jobs', *args]) == 0
        table = capsys.readouterr().out
        assert table.count('finished (stopped by request)') == 2
        assert main(['ctl', later.id, 'snapshot', *args]) == 1
        assert f'job {later.id} is finished; nothing to steer' in \
            capsys.readouterr().err
        # Someone else's job: refused, as cancel refuses it.
        spec = json.loads((later.folder / 'job.json').read_text())
        spec['user'] = 'someone-else'
        (later.folder / 'job.json').write_text(json.dumps(spec))
        assert main(['ctl', later.id, 'stop', *args]) == 1
        assert f'job {later.id} was submitted by someone-else; only ' \
            'someone-else can steer it' in capsys.readouterr().err
    finally:
        procs.close()
