import dataclasses
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from dasktrain.cli import build_parser, main
from dasktrain.config import ConfigError, TrainConfig, parse_devices
from dasktrain.errors import FLAGS, UserError, flag_names
from dasktrain.parallel.devices import gpu_count
from dasktrain.run.train import train
from dasktrain.training.loop import TrainingDiverged

TIME_KEYS = {'elapsed_time', 'images_per_sec', 'data_wait_time',
             'comm_time'}
LOG_KEYS = {'epoch', 'iteration', 'main/loss', 'main/accuracy',
            'validation/main/loss', 'validation/main/accuracy',
            'elapsed_time', 'images_per_sec', 'data_wait_time', 'lr'}


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(100, 100, 3)


def config(data_dir, out, **kw):
    # in_process: several replicas train in this one process
    base = dict(model='tiny', epochs=2, batch_size=25, devices=('@numpy',),
                data_dir=str(data_dir), out=str(out), progress=False,
                lr=0.01, in_process=True)
    base.update(kw)
    return TrainConfig(**base)


def final_params(out):
    with np.load(out / 'model_final.npz') as npz:
        return {k: npz[k] for k in npz.files}


def test_a_short_run_learns_and_writes_chainer_logs(data_dir, tmp_path):
    summary = train(config(data_dir, tmp_path / 'r', epochs=3,
                           devices=('@numpy', '@numpy'), tta=2))
    log = json.loads((tmp_path / 'r' / 'log').read_text())
    assert [row['epoch'] for row in log] == [1, 2, 3]
    assert LOG_KEYS <= set(log[0])
    assert log[-1]['iteration'] == 3 * 10  # 500 images / (2 x 25)
    assert log[-1]['validation/main/accuracy'] > 0.6  # chance is 0.1
    assert log[-1]['main/loss'] < log[0]['main/loss']
    assert all(row['images_per_sec'] > 0 for row in log)
    args = json.loads((tmp_path / 'r' / 'args').read_text())
    assert args['devices'] == ['@numpy', '@numpy'] and args['tta'] == 2
    assert TrainConfig.from_json(json.dumps(args)) == config(
        data_dir, tmp_path / 'r', epochs=3, devices=('@numpy', '@numpy'),
        tta=2)
    for name in ('model_final.npz', 'model_best.npz', 'checkpoint.npz'):
        assert (tmp_path / 'r' / name).is_file()
    assert summary['final'] == log[-1]
    leftovers = [p.name for p in (tmp_path / 'r').iterdir()
                 if p.name.startswith('.')]
    assert leftovers == ['.chainerui_commands']  # ChainerUI: it stopped
    assert json.loads((tmp_path / 'r' / '.chainerui_commands').read_text()
                      ) == {'job_status': 'stopped'}


class Crash(Exception):
    pass


def crash_after(epoch):
    def callback(row):
        if row['epoch'] == epoch:
            raise Crash
    return callback


@pytest.mark.parametrize('kw', [
    dict(model='cifar10', mode='dg', train_size=50, test_size=20),  # dropout
    dict(mode='ipm', devices=('@numpy', '@numpy')),                 # one-shot
    dict(mode='ipm', devices=('@numpy', '@numpy'), mix_every=3,
         optimizer='momentum-sgd', weight_decay=5e-4),
    # the loss scale and the float32 masters (parallel/precision.py)
    dict(dtype='mixed16', devices=('@numpy', '@numpy'), train_size=50,
         test_size=20),
    dict(dtype='mixed16', mode='ipm', devices=('@numpy', '@numpy'),
         mix_every=3, optimizer='momentum-sgd', weight_decay=5e-4,
         train_size=50, test_size=20),
], ids=['dropout', 'ipm', 'ipm-mixes', 'mixed16', 'mixed16-ipm'])
def test_resume_ends_exactly_where_an_uninterrupted_run_ends(data_dir,
                                                             tmp_path, kw):
    kw = dict(epochs=3, **kw)
    whole = train(config(data_dir, tmp_path / 'whole', **kw))
    with pytest.raises(Crash):
        train(config(data_dir, tmp_path / 'cut', **kw),
              callbacks=[crash_after(2)])
    assert not (tmp_path / 'cut' / 'model_final.npz').exists()
    resumed = train(config(data_dir, tmp_path / 'cut', resume=True, **kw))
    for a, b in zip(whole['log'], resumed['log'], strict=True):
        for key in set(a) - TIME_KEYS:
            assert a[key] == b[key], key
    ours, theirs = final_params(tmp_path / 'whole'), \
        final_params(tmp_path / 'cut')
    for name in ours:
        assert np.array_equal(ours[name], theirs[name]), name


def test_early_stopping(data_dir, tmp_path):
    # A learning rate far below float32 resolution leaves the weights as
    # they are, so the validation loss never improves after epoch 1.
    summary = train(config(data_dir, tmp_path / 'r', epochs=10, lr=1e-12,
                           early_stop_patience=2))
    assert summary['stopped_early']
    assert [row['epoch'] for row in summary['log']] == [1, 2, 3]
    # Resuming a run that stopped early does not train further.
    again = train(config(data_dir, tmp_path / 'r', epochs=10, lr=1e-12,
                         early_stop_patience=2, resume=True))
    assert len(again['log']) == 3


def test_a_monitor_no_log_row_can_have_is_refused_at_start(
        data_dir, tmp_path, capsys):
    args = ['--data-dir', str(data_dir), '--out', str(tmp_path / 'r'),
            '--devices', 'cpu', '--model', 'tiny']
    assert main(['train', *args, '--early-stop-monitor', 'nope']) == 2
    error = capsys.readouterr().err.splitlines()[1]  # after the usage
    assert "--early-stop-monitor must be a key of the log: one of epoch, " \
        "iteration, main/loss" in error and error.endswith("got 'nope'")
    with pytest.raises(ConfigError, match="one of .*lr, got 'drift'"):
        TrainConfig(early_stop_monitor='drift')  # dg has no drift
    # ipm has it with several replicas only, known once the run starts
    with pytest.raises(UserError, match='drift needs mode ipm with '
                                        'several replicas; this run has 1'):
        train(config(data_dir, tmp_path / 'r', mode='ipm',
                     early_stop_monitor='drift'))
    assert not (tmp_path / 'r').exists()


def test_every_log_key_is_a_monitor(data_dir, tmp_path):
    from dasktrain.config import LOG_KEYS as monitors
    summary = train(config(data_dir, tmp_path / 'r', epochs=1, mode='ipm',
                           devices=('@numpy',) * 2, train_size=100,
                           early_stop_monitor='drift',
                           early_stop_mode='min'))
    assert set(summary['final']) == set(monitors) | {'drift'}


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(data_dir,
                                                           tmp_path):
    out = tmp_path / 'r'
    train(config(data_dir, out, epochs=1))
    before = (out / 'checkpoint.npz').read_bytes()
    with pytest.raises(TrainingDiverged, match=r'loss became (nan|inf) at '
                                               r'epoch 2.*from epoch 1 is '
                                               r'kept.*Lower lr'):
        train(config(data_dir, out, epochs=3, resume=True,
                     optimizer='momentum-sgd', lr=1e6))
    assert (out / 'checkpoint.npz').read_bytes() == before
    assert len(json.loads((out / 'log').read_text())) == 1


def test_an_existing_run_needs_resume(data_dir, tmp_path):
    train(config(data_dir, tmp_path / 'r', epochs=1))
    with pytest.raises(Exception, match='already holds a run.*resume'):
        train(config(data_dir, tmp_path / 'r', epochs=1))


def test_flags_map_one_to_one_onto_config_fields():
    parser = build_parser()
    train_parser = parser._subparsers._group_actions[0].choices['train']
    dests = {a.dest for a in train_parser._actions if a.dest != 'help'}
    assert dests == {f.name for f in dataclasses.fields(TrainConfig)}


@pytest.mark.parametrize('argv,message', [
    (['--batch-size', '0'], '--batch-size must be an int >= 1, got 0'),
    (['--mix-every', '5'], '--mix-every applies to --mode ipm only, got '
                           '--mix-every 5 with --mode dg'),
    (['--mode', 'ipm', '--mix-every', 'often'],
     "argument --mix-every: expected an int or 'epoch', got 'often'"),
    (['--devices', 'gpu0'], "argument --devices: expected GPU ids like "
                            "'0,1', 'cpu' or 'cpu:N', got 'gpu0'"),
    (['--tta', '11'], '--tta must be an int in 1..10, got 11'),
    (['--lr', '-1'], '--lr must be a finite number > 0, got -1.0'),
    (['--lr', 'inf'], '--lr must be a finite number > 0, got inf'),
    (['--lr', 'nan'], '--lr must be a finite number > 0, got nan'),
    (['--weight-decay', 'inf'], '--weight-decay must be a finite number >= '
                                '0'),
    (['--scheduler', 'tcp://x:1'], '--scheduler applies with --workers '
                                   'only'),
    (['--model', 'vgg'], "--model must be one of cifar10, resnet20, "
                         "resnet32, resnet56, tiny, or your own model"),
    (['--model-arg', 'n=1'], '--model-arg apply to your own model (--model '
                             'file.py:NAME), not to cifar10'),
    (['--model', 'm.py:M', '--model-arg', '1x'],
     "argument --model-arg: expected KEY=VALUE, got '1x'"),
])
def test_bad_option_values_are_usage_errors(argv, message, capsys):
    """The usage line, the error naming the flag, and where help is: no
    screenful of help that scrolls the error away."""
    assert main(['train', *argv]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3
    assert lines[0] == 'usage: dasktrain train [options]'
    assert lines[1].startswith('dasktrain train: error: ')
    assert message in lines[1]
    assert lines[2] == 'see `dasktrain train --help`'


def _wrong_type(field):
    """A value of the wrong type for each field's annotation."""
    if field.name in ('mix_every', 'exact_warmup'):  # an int or 'epoch'
        return 2.5
    return 'seven' if field.type in (int, float, int | None,
                                     float | None) else 7


@pytest.mark.parametrize('field', dataclasses.fields(TrainConfig),
                         ids=lambda f: f.name)
def test_every_field_is_type_checked(field):
    value = _wrong_type(field)
    # A Python caller reads the field's name; the CLI, its flag.
    with pytest.raises(ConfigError, match=f'^{field.name} must be .*, got '
                                          f'{value!r}$'):
        TrainConfig(**{field.name: value})
    flag = field.name if field.type is bool else \
        FLAGS.get(field.name, '--' + field.name.replace('_', '-'))
    with flag_names(), pytest.raises(ConfigError, match=f'^{flag} must be'):
        TrainConfig(**{field.name: value})


def test_types_that_mean_the_same_pass():
    import pathlib
    config = TrainConfig(lr=1, collective_timeout=5, out=pathlib.Path('o'),
                         data_dir=pathlib.Path('/d'),
                         devices=('@numpy',), mode='ipm', mix_every='epoch')
    assert (config.out, config.data_dir) == ('o', '/d')
    assert TrainConfig.from_json(config.to_json()) == config
    # what `--devices` takes, and a list
    assert TrainConfig(devices='cpu:2').devices == ('@numpy', '@numpy')
    assert TrainConfig(devices='0,2').devices == ('@cupy:0', '@cupy:2')
    assert TrainConfig(devices=['@numpy']).devices == ('@numpy',)
    with pytest.raises(ConfigError, match=r"^devices: 'cpu:N' needs N >= 1, "
                       r"got 'cpu:0'$"):
        TrainConfig(devices='cpu:0')


def test_missing_gpu_is_one_clear_line(data_dir, tmp_path, capsys):
    missing = gpu_count()[0]  # ids past this machine's GPUs
    code = main(['train', '--devices', f'{missing},{missing + 1}',
                 '--data-dir', str(data_dir),
                 '--out', str(tmp_path / 'r')])
    assert code == 1
    err = capsys.readouterr().err
    assert err.count('\n') == 1
    assert 'available: @numpy' in err


def test_parse_devices():
    assert parse_devices('cpu') == ('@numpy',)
    assert parse_devices('cpu:3') == ('@numpy',) * 3
    assert parse_devices('0, 2') == ('@cupy:0', '@cupy:2')
    with pytest.raises(ConfigError):
        parse_devices('cpu:0')


def test_the_examples_hold():
    import doctest

    from dasktrain.training import loop, progress, stopping
    for module in (loop, progress, stopping):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_a_runs_warnings_reach_the_cli_user_as_lines(capsys):
    from dasktrain.cli import show_logs
    from dasktrain.training.progress import Progress
    show_logs()
    show_logs()  # once, however often main() runs
    Progress(False, 2).warn('warning: 2 GPUs unused')
    assert capsys.readouterr() == ('', 'warning: 2 GPUs unused\n')


def test_train_command_end_to_end(data_dir, tmp_path):
    out = subprocess.run(
        [sys.executable, '-m', 'dasktrain.cli', 'train', '--model', 'tiny',
         '--epochs', '1', '--devices', 'cpu', '--data-dir', str(data_dir),
         '--out', str(tmp_path / 'r'), '--lr', '0.01'],
        capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[0] == \
        'training on the CPU, 1 replica (@numpy)'  # says where, first
    assert 'epoch   1/1' in out.stdout and 'done: epoch 1' in out.stdout
    assert 'Traceback' not in out.stderr
    # and the curves, as a picture
    curves = tmp_path / 'r' / 'curves.png'
    assert f'curves: {curves}' in out.stdout
    assert curves.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


# ------------------------------------------------- output folder and resume

def one_line_error(capsys):
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'Traceback' not in err, err
    return err


def cli_args(data_dir, out, *more):
    return ['train', '--model', 'tiny', '--devices', 'cpu', '--batch-size',
            '25', '--lr', '0.01', '--data-dir', str(data_dir), '--out',
            str(out), '--no-progress', *more]


@pytest.mark.parametrize('damage', ['truncated', 'another model',
                                    'pickled state'])
def test_resume_from_a_checkpoint_that_does_not_fit_is_one_line(
        data_dir, tmp_path, capsys, damage):
    out = tmp_path / 'r'
    train(config(data_dir, out, epochs=1))
    checkpoint = out / 'checkpoint.npz'
    more = ['--epochs', '2']
    if damage == 'truncated':
        data = checkpoint.read_bytes()
        checkpoint.write_bytes(data[:len(data) // 2])
        expected = [f'{checkpoint} is not a readable .npz file '
                    '(BadZipFile']
    elif damage == 'another model':
        more = ['--model', 'cifar10', '--train-size', '50', '--test-size',
                '20']
        # a missing array or one of another shape, whichever comes first
        expected = [f"{checkpoint} does not match this run (--model "
                    "cifar10): ", "'model/replica0/predictor/"]
    else:  # a file someone handed over: its pickle would run code
        marker = tmp_path / 'pwned'

        class Evil:
            def __reduce__(self):
                return open, (str(marker), 'w')
        with np.load(checkpoint) as npz:
            arrays = {k: npz[k] for k in npz.files}
        arrays['state'] = np.array([Evil()], dtype=object)
        np.savez(checkpoint, **arrays)
        expected = [f"{checkpoint}: 'state' holds pickled Python objects"]
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(cli_args(data_dir, out, '--resume', *more)) == 1
    err = one_line_error(capsys)
    assert all(part in err for part in expected), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    if damage == 'pickled state':
        assert not marker.exists()


def test_load_model_reads_saved_weights_and_never_unpickles(data_dir,
                                                            tmp_path):
    from dasktrain import load_model
    train(config(data_dir, tmp_path / 'r', epochs=1))
    chain = load_model(tmp_path / 'r' / 'model_final.npz', 'tiny')
    saved = final_params(tmp_path / 'r')
    params = {name.lstrip('/'): p.array for name, p in chain.namedparams()}
    assert params.keys() <= saved.keys() and params
    for name, array in params.items():
        assert np.array_equal(array, saved[name]), name
    with pytest.raises(UserError, match=r"does not match model resnet20"):
        load_model(tmp_path / 'r' / 'model_final.npz', 'resnet20')
    marker = tmp_path / 'pwned'

    class Evil:
        def __reduce__(self):
            return open, (str(marker), 'w')
    np.savez(tmp_path / 'evil.npz', **dict(saved, **{
        'predictor/fc/b': np.array([Evil()], dtype=object)}))
    with pytest.raises(UserError, match='pickled Python objects'):
        load_model(tmp_path / 'evil.npz', 'tiny')
    assert not marker.exists()


def test_an_out_that_cannot_be_written_is_refused_before_any_data(
        tmp_path, capsys):
    assert main(cli_args(tmp_path / 'data', '/proc/self')) == 1
    err = one_line_error(capsys)
    assert 'error: --out /proc/self is not writable' in err
    assert not (tmp_path / 'data').exists()  # no data loaded, no download


def test_a_second_run_into_the_same_out_is_refused(data_dir, tmp_path):
    out = tmp_path / 'r'
    second = {}

    def start_another(row):  # while the first run holds --out
        second['run'] = subprocess.run(
            [sys.executable, '-m', 'dasktrain.cli',
             *cli_args(data_dir, out, '--resume', '--epochs', '3')],
            capture_output=True, text=True)
    summary = train(config(data_dir, out, epochs=2),
                    callbacks=[start_another])
    run = second['run']
    assert run.returncode == 1 and run.stdout == ''
    assert run.stderr.count('\n') == 1
    assert (f'--out {out} is in use by another run (pid {os.getpid()} on '
            f'{socket.gethostname()})') in run.stderr
    # the first run was not disturbed; once it is over, --out is free
    assert [r['epoch'] for r in summary['log']] == [1, 2]
    again = train(config(data_dir, out, epochs=3, resume=True))
    assert [r['epoch'] for r in again['log']] == [1, 2, 3]


@pytest.mark.parametrize('why', ['missing GPUs', 'loss diverges'])
def test_a_run_that_fails_before_its_first_epoch_leaves_no_folder(
        data_dir, tmp_path, capsys, why):
    more = ['--devices', '0,1'] if why == 'missing GPUs' else \
        ['--optimizer', 'momentum-sgd', '--lr', '1e6']
    out = tmp_path / 'new' / 'r'
    assert main(cli_args(data_dir, out, *more)) == 1
    err = capsys.readouterr().err  # NumPy may warn of the overflow first
    assert 'Traceback' not in err
    assert err.splitlines()[-1].startswith('dasktrain train: error: ')
    assert list(tmp_path.iterdir()) == []
    # a folder that was there before stays, as it was
    (tmp_path / 'mine').mkdir()
    assert main(cli_args(data_dir, tmp_path / 'mine', *more)) == 1
    assert (tmp_path / 'mine').is_dir()


def test_resume_keeps_the_original_args_and_appends_what_changed(
        data_dir, tmp_path):
    out = tmp_path / 'r'
    train(config(data_dir, out, epochs=1))
    original = json.loads((out / 'args').read_text())
    train(config(data_dir, out, epochs=2, resume=True))
    train(config(data_dir, out, epochs=3, lr=0.005, resume=True))
    args = json.loads((out / 'args').read_text())
    assert args.pop('resumed') == [
        {'epoch': 1, 'changed': {'epochs': 2}},
        {'epoch': 2, 'changed': {'epochs': 3, 'lr': 0.005}}]
    assert args == original and args['epochs'] == 1


def test_resume_takes_every_option_from_out_args(data_dir, tmp_path,
                                                 capsys):
    out = tmp_path / 'r'
    assert main(['train', '--model', 'tiny', '--devices', 'cpu',
                 '--batch-size', '20', '--lr', '0.02', '--epochs', '1',
                 '--train-size', '100', '--data-dir', str(data_dir),
                 '--out', str(out), '--no-progress']) == 0
    # only what changes: the model, sizes and lr come from OUT/args
    assert main(['train', '--resume', '--out', str(out), '--epochs', '2',
                 '--data-dir', str(data_dir)]) == 0
    assert 'done: epoch 2' in capsys.readouterr().out
    args = json.loads((out / 'args').read_text())
    assert args['model'] == 'tiny' and args['batch_size'] == 20
    assert args['resumed'] == [{'epoch': 1, 'changed': {'epochs': 2}}]
    rows = json.loads((out / 'log').read_text())
    assert [r['iteration'] for r in rows] == [5, 10]  # 100 images / 20
    # a change that cannot resume is one line
    assert main(['train', '--resume', '--out', str(out), '--epochs', '3',
                 '--model', 'resnet20', '--data-dir', str(data_dir)]) == 1
    one_line_error(capsys)
