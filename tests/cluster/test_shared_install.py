"""A shared install every user can run: `make install-shared` builds a
venv from a Python every user can execute, with dasktrain and its
constraints, and puts `dasktrain` on every user's PATH; `cluster start
--shared` refuses, in one line, an install other users cannot run. The
rules as pure functions; then the real install, a shared queue started
from it as root, and a training job submitted by a second Unix user the
test creates (skipped, with the reason, where the test is not root)."""
import doctest
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from children import child

import dasktrain.cluster.shared as shared
import dasktrain.shared_install as everyone

ROOT = Path(__file__).resolve().parents[2]
CONSOLE = Path(sys.executable).parent / 'dasktrain'
DIR, FILE = 0o40000, 0o100000
MODES = {'/': DIR | 0o755, '/root': DIR | 0o700, '/usr': DIR | 0o755,
         '/usr/bin': DIR | 0o755, '/usr/bin/python3': FILE | 0o755,
         '/root/v/bin/python': FILE | 0o755, '/opt': DIR | 0o755,
         '/opt/dt': DIR | 0o755, '/opt/dt/bin': DIR | 0o755,
         '/opt/dt/bin/python': FILE | 0o755, '/opt/dt/pkg': DIR | 0o750,
         '/opt/dt/ok': DIR | 0o755, '/opt/dt/bin/py700': FILE | 0o700}


@pytest.mark.parametrize('module', [everyone, shared])
def test_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize('path, need, found', [
    ('/usr/bin/python3', 'x', None),
    ('/root/v/bin/python', 'x', '/root (drwx------)'),
    ('/opt/dt/bin/py700', 'x', '/opt/dt/bin/py700 (-rwx------)'),
    ('/opt/dt/pkg', 'rx', '/opt/dt/pkg (drwxr-x---)'),
    ('/opt/dt/ok', 'rx', None),
])
def test_what_other_users_cannot_use(path, need, found):
    got = everyone.blocked(path, need, MODES.get)
    assert (got and everyone.describe(got)) == found


def test_the_install_problem_names_the_path_and_the_closed_folder():
    def same(path):  # no symlinks in this table
        return path

    assert everyone.install_problem('/opt/dt/bin/python', '/opt/dt/ok',
                                    MODES.get, same) is None
    assert everyone.install_problem(
        '/opt/dt/bin/python', '/opt/dt/pkg', MODES.get, same) == (
        'other users cannot read /opt/dt/pkg: /opt/dt/pkg (drwxr-x---) is '
        'closed to them')
    # a venv's python is a symlink: its target must be open too
    assert everyone.install_problem(
        '/opt/dt/bin/python', '/opt/dt/ok', MODES.get,
        {'/opt/dt/bin/python': '/root/v/bin/python'}.get) == (
        'other users cannot run /opt/dt/bin/python: /root (drwx------) is '
        'closed to them')


def test_the_shared_python_is_the_first_every_user_can_run():
    args = dict(mode_of=MODES.get, real=lambda p: p,
                exists=MODES.__contains__)
    assert everyone.choose_python(
        ['/root/v/bin/python', '/usr/bin/python3'],
        version_of=lambda p: (3, 11), **args) == ('/usr/bin/python3', None)
    assert everyone.choose_python(
        ['/usr/bin/python3', '/nowhere/python'],
        version_of=lambda p: (3, 8), **args) == (
        None, '/usr/bin/python3: not a Python >= 3.10 with venv; '
              '/nowhere/python: not found')


def test_a_shared_start_from_a_private_python_is_one_line(tmp_path):
    if os.geteuid() != 0:
        pytest.skip('only root starts a shared cluster: the install check '
                    'comes after the root check')
    if everyone.install_problem() is None:
        pytest.skip(f'{sys.executable} is one every user can run here')
    env = {k: v for k, v in os.environ.items()
           if k != shared.PRIVATE_PYTHON_ENV}
    done = subprocess.run([str(CONSOLE), 'cluster', 'start', '--shared',
                           '--shared-dir', str(tmp_path / 'q')],
                          capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 1
    assert done.stderr.count('\n') == 1, done.stderr
    assert done.stderr.startswith('dasktrain cluster: error: other users '
                                  f'cannot run {sys.executable}: ')
    # the plain command: install-shared puts it on sudo's PATH
    assert 'start that one: `sudo dasktrain cluster start --shared` ' in \
        done.stderr
    assert not (tmp_path / 'q').exists()  # nothing started, nothing made


def test_a_shared_start_refuses_what_another_user_could_change():
    """A group-writable folder above the shared place, or a group-writable
    prefix of the interpreter root runs: eve, in that group, could swap
    the place or a module every root process of the queue imports
    (she really can write there); `cluster start --shared` refuses, in
    one line naming the folder, its owner, group and mode."""
    if os.geteuid() != 0:
        pytest.skip('only root starts a shared cluster and creates a '
                    'second Unix user')
    if not shutil.which('useradd'):
        pytest.skip('no useradd here to create a second Unix user')
    top = Path(tempfile.mkdtemp(prefix='dasktrain-root-only-'))
    os.chmod(top, 0o755)
    name = f'dtro{uuid.uuid4().hex[:6]}'
    places = [top / 'group' / 'q', top / 'q']
    try:
        added = subprocess.run(['useradd', '--system', '--no-create-home',
                                name], capture_output=True, text=True)
        if added.returncode:
            pytest.skip(f'cannot create a second Unix user here (useradd: '
                        f'{added.stderr.strip()})')
        gid = pwd.getpwnam(name).pw_gid
        mode = f'drwxrwxr-x, owner root, group {name}) is writable by the ' \
            f'group {name}'
        env = dict(os.environ, DASKTRAIN_SHARED_PRIVATE_PYTHON='1')

        def start(python, place):
            return subprocess.run(
                [str(python), '-m', 'dasktrain.cli', 'cluster', 'start',
                 '--shared', '--shared-dir', str(place), '--port', '0',
                 '--dashboard-port', '0', '--gpus', '0'],
                capture_output=True, text=True, env=env, timeout=180)

        def group_writable(path):
            path.mkdir()
            os.chown(path, 0, gid)
            os.chmod(path, 0o775)
            done = subprocess.run(['runuser', '-u', name, '--', 'touch',
                                   str(path / 'eve-was-here')])
            assert done.returncode == 0  # she can
        # The shared place below a folder eve's group may write.
        group_writable(top / 'group')
        done = start(sys.executable, places[0])
        assert done.returncode == 1 and done.stderr.count('\n') == 1, done
        assert done.stderr.startswith(
            f'dasktrain cluster: error: the shared place {places[0]} lies '
            f'where users other than root can change it: {top / "group"} '
            f'({mode}; a shared cluster runs as root with it'), done.stderr
        # An interpreter whose prefix eve's group may write.
        venv = top / 'venv'
        group_writable(venv)
        subprocess.run([sys._base_executable, '-m', 'venv', '--without-pip',
                        str(venv)], check=True, timeout=120)
        site = next(venv.glob('lib/python*/site-packages'))
        ours = next(Path(sys.prefix).glob('lib/python*/site-packages'))
        (site / 'ours.pth').write_text(
            f'import site; site.addsitedir({str(ours)!r})\n')
        done = start(venv / 'bin' / 'python', places[1])
        assert done.returncode == 1 and done.stderr.count('\n') == 1, done
        assert done.stderr.startswith(
            f'dasktrain cluster: error: {venv / "bin" / "python"} holds code '
            'that root runs, and users other than root can change it: '
            f'{venv} ({mode}; a shared cluster runs'), done.stderr
        assert not places[1].exists()  # nothing started, nothing made
    finally:
        for place in places:
            if (place / 'private').exists():  # (a start that went ahead)
                subprocess.run([str(CONSOLE), 'cluster', 'stop', '--shared',
                                '--shared-dir', str(place)],
                               capture_output=True, timeout=120)
        subprocess.run(['userdel', name], capture_output=True)
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.timeout(1500)
def test_install_shared_then_a_second_user_trains_through_the_queue():
    if os.geteuid() != 0:
        pytest.skip('only root makes a shared install and creates a '
                    'second Unix user')
    if not (shutil.which('useradd') and shutil.which('runuser')):
        pytest.skip('no useradd/runuser here to be a second Unix user')
    top = Path(tempfile.mkdtemp(prefix='dasktrain-shared-install-'))
    os.chmod(top, 0o755)
    prefix, bindir, queue = top / 'opt', top / 'bin', top / 'queue'
    name = f'dtsi{uuid.uuid4().hex[:6]}'
    started = False
    try:
        made = subprocess.run(
            ['make', '-C', str(ROOT), 'install-shared', f'PREFIX={prefix}',
             f'BINDIR={bindir}', 'CUDA=none'],
            capture_output=True, text=True, timeout=1200)
        assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
        assert f'a venv in {prefix} from ' in made.stdout
        assert 'every user can run' in made.stdout
        python = (prefix / 'bin' / 'python').resolve()
        assert not str(python).startswith('/root')
        assert (bindir / 'dasktrain').resolve() == \
            (prefix / 'bin' / 'dasktrain').resolve()
        # not the checkout's: an install of its own
        where = subprocess.run(
            [str(prefix / 'bin' / 'python'), '-c',
             'import dasktrain; print(dasktrain.__file__)'],
            capture_output=True, text=True, check=True).stdout
        assert where.startswith(str(prefix))

        added = subprocess.run(['useradd', '--system', '--no-create-home',
                                name], capture_output=True, text=True)
        if added.returncode:
            pytest.skip(f'cannot create a second Unix user here (useradd: '
                        f'{added.stderr.strip()})')
        home = top / 'home'
        home.mkdir(mode=0o700)
        entry = pwd.getpwnam(name)
        os.chown(home, entry.pw_uid, entry.pw_gid)
        env = {'PATH': f'{bindir}:/usr/bin:/bin', 'HOME': str(home),
               'DASKTRAIN_SHARED_DIR': str(queue), 'LANG': 'C.UTF-8'}
        # root, as the docs say: the full path (sudo's secure_path)
        with child([str(prefix / 'bin' / 'dasktrain'), 'cluster', 'start',
                    '--shared', '--port', '0', '--dashboard-port', '0',
                    '--gpus', '0', '--cpu-slots', '1'],
                   env=dict(env, HOME='/root')) as c:
            started = True
            assert c.wait(180) == 0, c.stderr()

        def as_user(*words, timeout=300):
            return subprocess.run(
                [shutil.which('runuser'), '-u', name, '--', 'sh', '-c',
                 ' '.join(words)], capture_output=True, text=True,
                env=env, cwd=home, timeout=timeout)

        submitted = as_user(
            'dasktrain submit --gpus 0 -- --dataset sample --model tiny',
            '--epochs 1 --train-size 200 --test-size 100 --devices cpu')
        assert submitted.returncode == 0, submitted.stderr
        job = submitted.stdout.split()[-1]
        result = as_user('dasktrain result --wait', job)
        assert result.returncode == 0, result.stdout + result.stderr
        assert 'validation/main/accuracy: ' in result.stdout
        log = queue / 'jobs' / job / 'out' / 'log'
        assert log.stat().st_uid == entry.pw_uid  # run as its submitter
        assert json.loads(log.read_text())[-1]['epoch'] == 1

        # A job across two workers (a second joined by hand, as root): its
        # ranks, their rendezvous and their files are the submitter's.
        state = json.loads((queue / 'private' / 'cluster.json').read_text())
        tls = state['tls']
        with child([str(prefix / 'bin' / 'python'), '-m',
                    'distributed.cli.dask_worker', state['scheduler'],
                    '--preload', 'dasktrain.jobs.worker.preload',
                    '--nthreads', '2', '--resources', 'CPU=1', '--host',
                    '127.0.0.1', '--dashboard-address', '127.0.0.1:0',
                    '--local-directory', str(top / 'second'),
                    '--tls-ca-file', tls['tls_ca_file'], '--tls-cert',
                    tls['tls_cert'], '--tls-key', tls['tls_key']],
                   env=dict(env, HOME='/root',
                            DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION='1')):
            from dasktrain.cluster.local import connect, security_from
            with connect(state['scheduler'], security_from(**tls)) as c:
                c.wait_for_workers(2, timeout=120)  # joined: then submit
            submitted = as_user(
                'dasktrain submit --gpus 0 -- --dataset sample --model tiny',
                '--epochs 1 --train-size 200 --test-size 100 --devices cpu',
                '--workers 2')
            assert submitted.returncode == 0, submitted.stderr
            gang = submitted.stdout.split()[-1]
            result = as_user('dasktrain result --wait', gang)
            assert result.returncode == 0, result.stdout + result.stderr
        folder = queue / 'jobs' / gang
        for path in ('out/log', 'rank1.log', 'rendezvous.log'):
            assert (folder / path).stat().st_uid == entry.pw_uid, path
        assert json.loads((folder / 'out' / 'log').read_text())[-1][
            'epoch'] == 1
    finally:
        if started:
            subprocess.run([str(prefix / 'bin' / 'dasktrain'), 'cluster',
                            'stop', '--shared', '--shared-dir', str(queue)],
                           capture_output=True, timeout=120)
        subprocess.run(['userdel', name], capture_output=True)
        shutil.rmtree(top, ignore_errors=True)
