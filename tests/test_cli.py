import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dasktrain.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
NAMES = [cmd.name for cmd in COMMANDS]


def test_download_command(tmp_path, archive_server, cifar_archive, capsys):
    code = main(['download', '--data-dir', str(tmp_path), '--url',
                 archive_server.url(), '--md5', cifar_archive[1]])
    assert code == 0
    out = capsys.readouterr().out
    assert '100 training and 20 test images' in out
    assert (tmp_path / 'cifar-10-batches-py' / 'test_batch').is_file()


def test_user_error_is_one_line(tmp_path, archive_server, capsys):
    code = main(['download', '--data-dir', str(tmp_path), '--url',
                 archive_server.url('missing.tar.gz')])
    assert code == 1
    err = capsys.readouterr().err
    assert err.count('\n') == 1
    assert err.startswith('dasktrain download: error: cannot download')
    assert 'Traceback' not in err


def test_usage_error_prints_usage_error_and_where_help_is(capsys):
    assert main(['download', '--no-such-flag']) == 2
    assert capsys.readouterr().err.splitlines() == [
        'usage: dasktrain download [-h] [--dataset SPEC] '
        '[--label-set {fine,coarse}]',
        '                          [--data-dir DIR] [--url URL] [--md5 MD5]',
        'dasktrain download: error: unrecognized arguments: --no-such-flag',
        'see `dasktrain download --help`']


def test_usage_errors_of_nested_commands(capsys):
    assert main(['cluster', 'start', '--port', 'x']) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-2:] == [
        "dasktrain cluster start: error: argument --port: invalid int "
        "value: 'x'", 'see `dasktrain cluster start --help`']
    assert lines[0].startswith('usage: dasktrain cluster start ')
    assert len(lines) <= 5


@pytest.mark.parametrize('name', sorted(NAMES))
def test_every_subcommand_has_help(name, capsys):
    assert main([name, '--help']) == 0
    assert f'usage: dasktrain {name}' in capsys.readouterr().out


def test_installed_entry_point():
    exe = Path(sys.executable).with_name('dasktrain')
    out = subprocess.run([str(exe), '--help'], capture_output=True,
                         text=True, check=True).stdout
    for name in NAMES:
        assert name in out


@pytest.mark.skipif(not (ROOT / '.venv' / 'bin' / 'dasktrain').exists()
                    or shutil.which('make') is None,
                    reason='make test creates .venv; not run through make')
def test_make_train_passes_args():
    env = {k: v for k, v in os.environ.items() if not k.startswith('MAKE')}
    out = subprocess.run(['make', '-s', 'train', 'ARGS=--help'], cwd=ROOT,
                         capture_output=True, text=True, env=env, check=True)
    assert 'usage: dasktrain train' in out.stdout


def test_help_lists_the_commands_in_the_tables_order(capsys):
    assert NAMES == ['download', 'train', 'launch', 'cluster', 'submit',
                     'jobs', 'gpus', 'logs', 'cancel', 'requeue', 'result',
                     'ctl', 'tune', 'bench']
    assert main(['--help']) == 0
    commands = capsys.readouterr().out.split('COMMAND\n', 1)[1]
    listed = [line.split()[0] for line in commands.split('\n\n')[0]
              .splitlines() if line[4:5].strip()]  # not a wrapped help
    assert listed == NAMES


def test_every_command_runs_as_python_m_dasktrain_cli():
    # `python -m` runs cli.py as __main__, a second copy of the module,
    # which must see every command of the table
    for name in ('jobs', 'tune', 'bench', 'cluster'):
        out = subprocess.run([sys.executable, '-m', 'dasktrain.cli', name,
                              '--help'], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f'usage: dasktrain {name}')


def test_the_jobs_table_escapes_pages_and_says_what_it_left_out(capsys):
    from dasktrain.commands.jobs import Jobs
    row = {'id': 'a-1', 'name': 'x\x1b]0;TITLE\x07\x1b[2J',
           'user': 'bob\u202e', 'state': 'failed', 'ending': None,
           'gpus': '0', 'progress': '1/2', 'accuracy': 0.5, 'submitted': 0,
           'started': None, 'ended': None, 'seen': 'ended', 'view': {}}
    text = Jobs.table([row], [('b-2', 'job b-2: status.json\x1b[2J')],
                      {'page': 1, 'pages': 3, 'total': 250, 'older': 4})
    assert not set(text) & {'\x1b', '\x07', '\u202e'}
    lines = text.splitlines()
    assert lines[1].split()[:4] == ['a-1', 'x\\x1b]0;TITLE\\x07\\x1b[2J',
                                    'bob\\u202e', 'failed']
    assert lines[2].split()[:4] == ['b-2', '-', '-', 'unreadable']
    assert lines[3:] == [
        'unreadable: job b-2: status.json\\x1b[2J',
        'page 1 of 3 (250 jobs): --page 2 for another',
        '4 job(s) that ended more than a day ago not shown: --all lists '
        'them']
    # Its flags: checked before anything is asked.
    for argv, error in ((['--page', '0'], '--page must be >= 1, got 0'),
                        (['--interval', '0'], '--interval must be > 0, '
                                              'got 0')):
        assert main(['jobs', *argv]) == 2
        assert capsys.readouterr().err.splitlines()[-2:] == [
            f'dasktrain jobs: error: {error}',
            'see `dasktrain jobs --help`']
    assert main(['jobs', '--mine', '--user', 'bob']) == 2
    assert 'not allowed with argument' in capsys.readouterr().err


def _with_closed_stdout(argv, env=None, timeout=60):
    """``dasktrain ARGV`` whose stdout's reader has gone, as after
    ``| head``: the pipe's read end closed before the command writes."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [str(Path(sys.executable).with_name('dasktrain')), *argv],
            stdout=write, stderr=subprocess.PIPE, text=True, env=env,
            timeout=timeout)
    finally:
        os.close(write)


@pytest.mark.parametrize('argv', [
    ['--help'], ['train', '--help'], ['jobs'], ['jobs', '--all'],
    ['jobs', '--watch', '--interval', '0.1'],
], ids=' '.join)
def test_a_closed_stdout_ends_the_output_not_the_command(argv, tmp_path):
    # `dasktrain jobs | head -1`: no BrokenPipeError, no "Exception
    # ignored"; a --watch ends, with nothing more to show anyone.
    env = dict(os.environ, DASKTRAIN_JOBS_DIR=str(tmp_path / 'jobs'),
               DASKTRAIN_HOME=str(tmp_path / 'home'))
    done = _with_closed_stdout(argv, env)
    assert (done.returncode, done.stderr) == (0, '')


def test_an_abbreviated_option_is_refused_naming_the_whole_one(capsys):
    # A ChainerMN script's `--epoch 1` given to `dasktrain train` once
    # became --epochs 1 without a word (and the short CPU run was off).
    for argv, prog in ((['train', '--epoch', '1'], 'train'),
                       (['submit', '--', '--epoch', '1'], 'submit --')):
        assert main(argv) == 2
        assert capsys.readouterr().err.splitlines()[-2] == (
            f'dasktrain {prog}: error: unrecognized arguments: --epoch 1; '
            'options are never abbreviated: --epoch is not --epochs')
    from dasktrain.commands.options import given_fields
    assert given_fields(['--epoch', '1']) == set()


def test_examples():
    import doctest

    import dasktrain.commands
    import dasktrain.commands.cluster
    for module in (dasktrain.commands, dasktrain.commands.cluster):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
