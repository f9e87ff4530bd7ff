"""`dasktrain tune`: Optuna studies whose trials are jobs on real `dask
scheduler` / `dask worker` processes on 127.0.0.1 (CPU slots), training the
tiny model on small CIFAR-format data."""
import io
import json
import os
import signal
import subprocess
import sys
import threading

import optuna
import pytest
from distributed import Client
from optuna.trial import TrialState
from test_cluster import Processes, wait_until

from dasktrain.cli import main
from dasktrain.config import TrainConfig
from dasktrain.errors import UserError
from dasktrain.jobs.job import list_jobs
from dasktrain.tuning import tune
from dasktrain.tuning.trials import open_storage

METRIC = 'validation/main/accuracy'


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(40, 100, 5)


@pytest.fixture(scope='module')
def slots(tmp_path_factory):
    """A scheduler and one worker with 2 CPU slots (as `cluster start`
    makes it on a machine without GPUs), for the whole module."""
    procs = Processes(tmp_path_factory.mktemp('slots'))
    procs.spawn('worker', procs.address, '--no-nanny', '--nthreads', '3',
                '--resources', 'CPU=2', '--host', '127.0.0.1',
                '--local-directory', str(procs.tmp_path / 'space'))
    with Client(procs.address) as client:
        client.wait_for_workers(1)
    yield procs
    procs.close()


def base(data_dir, **kw):
    options = dict(model='tiny', epochs=3, batch_size=50, devices=('@numpy',),
                   data_dir=str(data_dir), optimizer='momentum-sgd',
                   train_size=100, test_size=50)
    options.update(kw)
    return TrainConfig(**options)


def base_flags(data_dir, epochs=3):
    return ['--model', 'tiny', '--epochs', str(epochs), '--batch-size', '50',
            '--devices', 'cpu', '--data-dir', str(data_dir), '--optimizer',
            'momentum-sgd', '--train-size', '100', '--test-size', '50']


def enqueue(storage, name, lrs):
    """Fix the first trials' learning rates with Optuna's own enqueue_trial,
    so that which trial is good, bad or diverging is known."""
    study = optuna.create_study(study_name=name, storage=open_storage(
        str(storage)), direction='maximize')
    for lr in lrs:
        study.enqueue_trial({'lr': lr})


def spans(jobs):
    return {j.spec().trial['number']: (j.status()['started'],
                                         j.status()['ended']) for j in jobs}


def study_jobs(root, name):
    return [j for j in list_jobs(root) if j.spec().trial['study'] == name]


def test_six_trials_on_two_slots_match_optunas_storage(slots, data_dir,
                                                      tmp_path, capsys):
    space = tmp_path / 'lr.yaml'  # YAML 1.1 reads 1e4 as a string: meant
    space.write_text('lr: [0.03, 0.1, 0.3, 1e4]\n')
    storage = tmp_path / 'study.log'
    # 0.1 peaks at epoch 1 then gets worse; 1e4 diverges to NaN.
    enqueue(storage, 'six', [0.03, 0.1, 1e4, 0.3, 0.03, 0.1])
    with Client(slots.address) as client:
        study = tune(str(space), base(data_dir), trials=6, parallel=3,
                     gpus=0, pruner='none', storage=str(storage),
                     study='six', client=client, path=tmp_path / 'jobs',
                     out=io.StringIO())
    trials = study.trials
    assert [t.number for t in trials] == list(range(6))
    assert [t.params['lr'] for t in trials] == [0.03, 0.1, 1e4, 0.3, 0.03,
                                                0.1]
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2 + [
        TrialState.FAIL] + [TrialState.COMPLETE] * 3
    assert 'loss became nan at epoch' in trials[2].user_attrs['error']
    jobs = {j.spec().trial['number']: j
            for j in study_jobs(tmp_path / 'jobs', 'six')}
    assert sorted(jobs) == list(range(6))
    assert jobs[2].status()['state'] == 'failed'
    # model_best.npz is the best epoch's, by a mode stated, not guessed.
    assert (jobs[0].spec().config['early_stop_monitor'],
            jobs[0].spec().config['early_stop_mode']) == (METRIC, 'max')
    # Never more than the 2 slots at once, though 3 were in flight.
    times = spans(jobs.values())
    overlaps = [sum(1 for s, e in times.values() if s <= start < e)
                for start, _ in times.values()]
    assert max(overlaps) == 2
    # A trial is worth its best epoch, not its last.
    for t in trials:
        if t.state != TrialState.COMPLETE:
            continue
        rows = jobs[t.number].log_rows()
        assert len(rows) == 3
        assert t.intermediate_values == {r['epoch']: r[METRIC] for r in rows}
        best = max(rows, key=lambda r: r[METRIC])
        assert (t.value, t.user_attrs['epoch']) == (best[METRIC],
                                                    best['epoch'])
        assert t.user_attrs['job'] == jobs[t.number].id
        assert t.user_attrs['out'] == str(jobs[t.number].folder / 'out')
    assert trials[1].user_attrs['epoch'] == 1
    assert trials[1].value > jobs[1].log_rows()[-1][METRIC]
    # What tune returned is what Optuna's storage holds.
    stored = optuna.load_study(study_name='six',
                               storage=open_storage(str(storage))).trials
    for ours, theirs in zip(trials, stored, strict=True):
        for attr in ('number', 'state', 'params', 'value', 'user_attrs',
                     'intermediate_values'):
            assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert study.best_trial.number == max(
        (t for t in stored if t.state == TrialState.COMPLETE),
        key=lambda t: t.value).number
    assert main(['tune', '--status', 'six', '--jobs-dir',
                 str(tmp_path / 'jobs')]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ['trial', 'state', 'params', 'value', 'epoch',
                                'job']
    assert lines[3].split()[:3] == ['2', 'fail', 'lr=1e+04']
    assert lines[2].split() == ['1', 'complete', 'lr=0.1',
                                f'{trials[1].value:.4g}', '1', jobs[1].id]
    assert lines[-1].startswith(f'best: trial {study.best_trial.number}, '
                                f'{METRIC} ')


def test_a_pruned_trial_stops_at_once_and_its_slot_is_reused(
        slots, data_dir, tmp_path, capsys):
    storage = tmp_path / 'study.log'
    # A good learning rate finishes first; then a clearly bad one is
    # pruned at its first epoch, against the median there.
    enqueue(storage, 'prune', [0.03, 1e-6])
    space = {'lr': {'type': 'float', 'low': 1e-7, 'high': 0.1, 'log': True}}
    with Client(slots.address) as client:
        study = tune(space, base(data_dir), trials=3, parallel=1, gpus=0,
                     pruner='median', startup_trials=1, sampler='random',
                     seed=0, storage=str(storage), study='prune',
                     client=client, path=tmp_path / 'jobs', out=io.StringIO())
    good, bad = study.trials[:2]
    assert good.state == TrialState.COMPLETE
    assert bad.state == TrialState.PRUNED and bad.last_step == 1
    jobs = {j.spec().trial['number']: j
            for j in study_jobs(tmp_path / 'jobs', 'prune')}
    assert jobs[1].status()['state'] == 'pruned'
    assert len(jobs[1].log_rows()) == 1  # of 3 epochs
    assert 'pruned: the pruner stopped it after epoch 1' in jobs[1].logs()
    times = spans(jobs.values())
    full = times[0][1] - times[0][0]  # what a whole trial takes here
    # The next trial (asked once the pruned one ended: one at a time) took
    # its place within seconds, long before it would have ended.
    assert jobs[2].spec().submitted > times[1][0]
    assert times[2][0] < times[1][0] + full
    assert abs(times[2][0] - times[1][1]) < 10
    assert study.best_trial.state == TrialState.COMPLETE  # never a pruned one
    assert main(['jobs', '--jobs-dir', str(tmp_path / 'jobs')]) == 0
    listing = capsys.readouterr().out
    row, = [line.split() for line in listing.splitlines()
            if line.startswith(jobs[1].id)]
    assert row[3:6] == ['pruned', '0', '1/3']  # STATE GPUS PROGRESS


def test_killing_tune_and_its_cluster_then_running_it_again(
        slots, data_dir, tmp_path, capsys):
    space = tmp_path / 'again.yaml'
    space.write_text('lr: {type: float, low: 0.01, high: 0.1, log: true}\n')
    jobs_dir = tmp_path / 'jobs'
    (tmp_path / 'lost').mkdir()
    lost = Processes(tmp_path / 'lost')  # a cluster that will go away
    lost.spawn('worker', lost.address, '--no-nanny', '--nthreads', '3',
               '--resources', 'CPU=2', '--host', '127.0.0.1',
               '--local-directory', str(tmp_path / 'lost' / 'space'))

    def command(scheduler):
        return ['tune', '--space', str(space), '--trials', '5', '--parallel',
                '2', '--gpus', '0', '--pruner', 'none', '--scheduler',
                scheduler, '--jobs-dir', str(jobs_dir), '--',
                *base_flags(data_dir)]
    storage = jobs_dir / 'studies' / 'again' / 'journal.log'

    def study():
        return optuna.load_study(study_name='again',
                                 storage=open_storage(str(storage)))

    def midway():  # a trial finished, another one's job 1 epoch of 3 in
        try:
            finished = [t for t in study().trials if t.state.is_finished()]
        except (UserError, KeyError):  # no journal, or no study in it yet
            return False
        return finished and any(
            j.status()['state'] == 'running' and len(j.log_rows()) == 1
            for j in study_jobs(jobs_dir, 'again'))
    try:
        with Client(lost.address) as client:
            client.wait_for_workers(1)
        proc = subprocess.Popen(
            [sys.executable, '-m', 'dasktrain.cli', *command(lost.address)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(midway, 120, 'a trial finished, another midway')
        finally:
            proc.kill()
            proc.wait()
    finally:
        lost.close()  # its worker's trials die with it
    # As if tune had been killed between asking for a trial and submitting.
    study().ask()
    # The same command on another cluster carries on.
    assert main(command(slots.address)) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith('study again: ') and ' of 5 trials done' in first
    trials = study().trials
    assert [t.number for t in trials] == list(range(5))
    assert all(t.state == TrialState.COMPLETE for t in trials)
    jobs = study_jobs(jobs_dir, 'again')
    # One job per trial: none run twice, the lost one resumed.
    assert sorted(j.spec().trial['number'] for j in jobs) == list(range(5))
    assert {t.user_attrs['job'] for t in trials} == {j.id for j in jobs}
    # The lost jobs ran again; the one killed midway (an epoch done) went
    # on from its checkpoint. Another lost one may not have finished an
    # epoch yet, and then starts over: pick the midway one by its log.
    again = [j for j in jobs if j.status()['attempts'] == 2]
    resumed = [j for j in again if 'resuming after epoch' in j.logs()]
    assert resumed, [j.logs() for j in again]
    for job in again:
        assert [r['epoch'] for r in job.log_rows()] == [1, 2, 3]
    # The same study with another space is refused.
    space.write_text('lr: {type: float, low: 0.01, high: 0.2, log: true}\n')
    assert main(command(slots.address)) == 1
    assert "study 'again' was started with another space" in \
        capsys.readouterr().err


def test_a_killed_worker_resumes_its_trial(data_dir, tmp_path):
    procs = Processes(tmp_path)

    def worker():
        return procs.spawn('worker', procs.address, '--no-nanny',
                           '--nthreads', '2', '--resources', 'CPU=1',
                           '--host', '127.0.0.1', '--local-directory',
                           str(tmp_path / 'space'))
    try:
        first = worker()
        result, out = {}, io.StringIO()
        with Client(procs.address) as client:
            client.wait_for_workers(1)
            run = threading.Thread(target=lambda: result.update(study=tune(
                {'lr': [0.03]}, base(data_dir, epochs=5), trials=1,
                parallel=1, gpus=0, pruner='none', client=client,
                path=tmp_path / 'jobs', out=out)), daemon=True)
            run.start()
            wait_until(lambda: any(len(j.log_rows()) >= 1 for j in
                                   list_jobs(tmp_path / 'jobs')), 120,
                       'the first epoch')
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
            worker()
            run.join(180)
        assert not run.is_alive()
        (trial,) = result['study'].trials
        (job,) = list_jobs(tmp_path / 'jobs')
        assert job.status()['attempts'] == 2
        assert 'resuming after epoch' in job.logs()
        rows = job.log_rows()
        assert [r['epoch'] for r in rows] == [1, 2, 3, 4, 5]
        assert trial.state == TrialState.COMPLETE
        assert trial.intermediate_values == {r['epoch']: r[METRIC]
                                             for r in rows}
        assert trial.value == max(r[METRIC] for r in rows)
    finally:
        procs.close()


@pytest.mark.parametrize('space, flags, message', [
    ({'learning_rate': [0.1]}, [],
     'the space: learning_rate: TrainConfig has no such field'),
    ({'lr': {'type': 'float', 'low': 0.1, 'high': 0.01}}, [],
     'the space: lr: low 0.1 must be below high 0.01'),
    ({'lr': {'type': 'float', 'low': 0, 'high': 0.1, 'log': True}}, [],
     'the space: lr: log needs low > 0, got low 0'),
    ({'batch_size': {'type': 'int', 'low': 0, 'high': 64}}, [],
     'the space: batch_size: 0 is not a valid value (--batch-size must be'),
    ({'mix_every': [1, 10]}, [],
     'the space: mix_every applies to mode ipm only'),
    ({'lr': [0.1]}, ['--metric', 'validation/main/acc'],
     '--metric validation/main/acc is never in the training log'),
    ({'lr': [0.1]}, ['--metric', 'drift', '--direction', 'minimize'],
     '--metric drift is never in the training log'),
    ({'lr': [0.1]}, ['--direction', 'minimize'],
     '--direction minimize contradicts --metric validation/main/accuracy'),
    ({'lr': [0.1]}, ['--metric', 'elapsed_time'],
     '--metric elapsed_time: whether higher or lower is better is not in'),
    ({'lr': [0.1]}, ['--storage', 'sqlite:////nonexistent/dir/s.db'],
     'cannot open --storage sqlite:////nonexistent/dir/s.db'),
    ({'lr': [0.1]}, ['--storage', '/nonexistent/dir/s.log'],
     'cannot open --storage /nonexistent/dir/s.log'),
    ({'lr': [0.1]}, ['--gpus', '3'], 'no worker has 3 GPU'),
    ({'lr': [0.1]}, ['--trials', '0'], '--trials must be an int >= 1'),
], ids=['field', 'bounds', 'log', 'value', 'ipm-only', 'metric', 'drift',
        'direction', 'no-direction', 'sqlite', 'journal', 'gpus', 'trials'])
def test_bad_input_is_one_line_before_anything_is_written(
        slots, data_dir, tmp_path, capsys, space, flags, message):
    path = tmp_path / 'space.json'
    path.write_text(json.dumps(space))
    code = main(['tune', '--space', str(path), '--gpus', '0', '--scheduler',
                 slots.address, '--jobs-dir', str(tmp_path / 'jobs'),
                 *flags, '--', *base_flags(data_dir)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count('\n') == 1 and 'Traceback' not in err
    assert message.replace('the space', 'space.json') in err
    assert not (tmp_path / 'jobs').exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ['space.json']


@pytest.mark.parametrize('train_flags, message', [
    (['--model', 'nothere.py:Net'], '--model nothere.py:Net: no file '
                                    'nothere.py'),
    (['--dataset', 'npz:none.npz'], '--dataset npz:none.npz: no file '
                                    'none.npz'),
])
def test_a_bad_model_or_dataset_is_one_line_at_tune(
        slots, data_dir, tmp_path, capsys, train_flags, message):
    path = tmp_path / 'space.json'
    path.write_text(json.dumps({'lr': [0.1]}))
    code = main(['tune', '--space', str(path), '--gpus', '0', '--scheduler',
                 slots.address, '--jobs-dir', str(tmp_path / 'jobs'), '--',
                 *base_flags(data_dir), *train_flags])
    err = capsys.readouterr().err
    assert code == 1 and err.count('\n') == 1 and message in err, err
    assert not (tmp_path / 'jobs').exists()


def test_early_stopping_mode_is_stated_not_guessed(data_dir, tmp_path,
                                                   capsys):
    from dasktrain.training import EarlyStopping
    with pytest.raises(UserError, match='pass early_stop_mode max or min'):
        EarlyStopping('elapsed_time', 2)
    assert EarlyStopping('elapsed_time', 2, mode='max').maximize
    assert EarlyStopping('validation/main/accuracy', 2).maximize
    assert not EarlyStopping('main/loss', 2).maximize
    # A search's trials stop early the way the study's direction says.
    path = tmp_path / 'space.json'
    path.write_text('{"lr": [0.1]}')
    assert main(['tune', '--space', str(path), '--scheduler',
                 'tcp://127.0.0.1:9', '--jobs-dir', str(tmp_path / 'jobs'),
                 '--', *base_flags(data_dir), '--early-stop-patience', '2',
                 '--early-stop-monitor', METRIC, '--early-stop-mode',
                 'min']) == 1
    assert ('--early-stop-mode min contradicts --direction maximize for '
            f'{METRIC}') in capsys.readouterr().err
    assert not (tmp_path / 'jobs').exists()


def test_a_study_keeps_its_metric_and_direction(slots, data_dir, tmp_path,
                                                capsys):
    import optuna

    from dasktrain.tuning.trials import open_storage
    path = tmp_path / 'space.json'
    path.write_text('{"lr": [0.1]}')
    folder = tmp_path / 'jobs' / 'studies' / 's'
    folder.mkdir(parents=True)
    # A study that ranks accuracies, its study.json deleted since
    kept = optuna.create_study(study_name='s', direction='maximize',
                               storage=open_storage(
                                   str(folder / 'journal.log')))
    kept.set_user_attr('metric', 'validation/main/accuracy')

    def tune(*flags):
        return main(['tune', '--space', str(path), '--gpus', '0',
                     '--scheduler', slots.address, '--study', 's',
                     '--jobs-dir', str(tmp_path / 'jobs'), *flags, '--',
                     *base_flags(data_dir)])
    assert tune('--metric', 'main/loss') == 1
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and (
        f"--storage {folder / 'journal.log'} holds study 's', which is to "
        'maximize validation/main/accuracy, not to minimize main/loss') in err
    assert sorted(p.name for p in folder.iterdir()) == ['journal.log']
    # a damaged study.json is no study of another kind: one line
    (folder / 'study.json').write_text('{"name": "s", "metr')
    assert tune() == 1
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'study.json is damaged' in err
    assert len(kept.trials) == 0  # nothing ran


def test_a_space_can_name_the_models_own_arguments(tmp_path):
    import optuna

    from dasktrain.tuning.space import (
        SpaceError,
        config_for,
        load_space,
        suggest,
    )
    (tmp_path / 'nets.py').write_text(
        'import chainer.links as L\n'
        'def mlp(n_units=8, depth=1, n_classes=10):\n'
        '    return L.Linear(None, n_classes)\n')
    base = TrainConfig(model=f'{tmp_path / "nets.py"}:mlp',
                       model_args={'depth': 2})
    space = load_space({'model_args.n_units': {'type': 'int', 'low': 64,
                                               'high': 512, 'log': True},
                        'lr': [0.01, 0.1]}, base)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(0))
    for _ in range(3):
        trial = study.ask()
        config = config_for(base, suggest(trial, space, base))
        assert 64 <= config.model_args['n_units'] <= 512
        assert config.model_args['depth'] == 2  # the base's args stay
        assert config.lr in (0.01, 0.1)
        study.tell(trial, 0.5)
    # a built-in network takes no model arguments: one line, at once
    with pytest.raises(SpaceError, match='model_args.n_units: 64 is not a '
                                         'valid value'):
        load_space({'model_args.n_units': [64, 128]}, TrainConfig())
