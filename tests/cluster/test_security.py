"""Who can run what, and who sees what: no module planted where a command
runs is ever imported; job folders are made whole and private; the user
is the OS's; only the submitter cancels; a cluster refuses a job it
could not write. On real `dasktrain cluster` / `dask` processes."""
import json
import os
import pwd
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from children import child
from distributed import Client
from test_cluster import Processes, job_config

from dasktrain.cli import main
from dasktrain.jobs.client.submit import check_owner, submit
from dasktrain.jobs.job import JobError, current_user, list_jobs
from dasktrain.spawn import python

# Modules the scheduler, the worker and a job's child import at start-up
# (``dask`` is what ``python -m dask`` runs): planted where a command runs,
# each would leave its marker.
PLANTED = ('dask', 'getpass', 'chainer', 'psutil')
CONSOLE = Path(sys.executable).parent / 'dasktrain'


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(200, 100, 5)


@pytest.fixture
def cluster(tmp_path):
    procs = Processes(tmp_path)
    procs.worker(gpus=1)
    yield procs
    procs.close()


def test_spawned_python_never_has_the_working_directory_on_its_path(
        tmp_path):
    (tmp_path / 'planted_here.py').write_text('')
    argv = python('site')  # prints sys.path
    out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    if sys.version_info >= (3, 11):
        assert f"'{tmp_path}'" not in out and "    ''," not in out
    assert argv[-2:] == ['-m', 'site']


def test_modules_planted_where_commands_run_are_never_imported(
        tmp_path, data_dir):
    shared = tmp_path / 'shared'  # e.g. a lab's project folder
    shared.mkdir()
    markers = tmp_path / 'markers'
    markers.mkdir()
    for name in PLANTED:
        (shared / f'{name}.py').write_text(
            f'open({str(markers / name)!r}, "w").close()\n')
    env = dict(os.environ, DASKTRAIN_HOME=str(tmp_path / 'home'),
               DASKTRAIN_JOBS_DIR=str(tmp_path / 'jobs'))
    env.pop('PYTHONPATH', None)

    def dasktrain(*args, timeout=180):
        with child([str(CONSOLE), *args], env=env, cwd=shared) as c:
            assert c.wait(timeout) == 0, c.stderr()
            return c.stdout()
    try:
        dasktrain('cluster', 'start', '--port', '0', '--dashboard-port', '0',
                  '--gpus', '0')
        dasktrain('submit', '--gpus', '0', '--name', 'planted', '--',
                  '--model', 'tiny', '--epochs', '1', '--batch-size', '50',
                  '--train-size', '200', '--test-size', '100',
                  '--data-dir', str(data_dir))
        job, = list_jobs(tmp_path / 'jobs')
        assert job.result(timeout=180)['final']['epoch'] == 1
    finally:
        with child([str(CONSOLE), 'cluster', 'stop'], env=env,
                   cwd=shared) as stop:
            stop.wait(120)
    assert sorted(p.name for p in markers.iterdir()) == []


def test_job_folders_are_whole_private_and_the_users_own(
        cluster, data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv('USER', 'alice')  # anyone can set it
    monkeypatch.setenv('LOGNAME', 'alice')
    jobs = tmp_path / 'jobs'
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        job = submit(job_config(data_dir, epochs=1), gpus=1, client=client,
                     path=jobs)
    assert job.spec().user == pwd.getpwuid(os.getuid()).pw_name \
        == current_user()
    assert job.spec().host == socket.gethostname()
    # Only its owner reads its logs and weights.
    assert stat.S_IMODE(job.folder.stat().st_mode) == 0o700
    assert job.result(timeout=180)['final']['epoch'] == 1
    assert [p.name for p in jobs.iterdir()] == [job.id]  # no temp folder
    # A folder still being made (or half a job) is not listed.
    (jobs / f'.{job.id}x.tmp').mkdir()
    (jobs / f'.{job.id}x.tmp' / 'job.json').write_text('{}')
    assert [j.id for j in list_jobs(jobs)] == [job.id]


def test_a_job_that_cannot_be_written_leaves_nothing(cluster, data_dir,
                                                      tmp_path):
    (tmp_path / 'a-file').write_text('')
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        with pytest.raises(JobError, match='cannot write the job to'):
            submit(job_config(data_dir), gpus=1, client=client,
                   path=tmp_path / 'a-file' / 'jobs')
        # A full disk: a 32 KiB tmpfs where that works (root, Linux).
        full = tmp_path / 'full'
        full.mkdir()
        mounted = subprocess.run(
            ['mount', '-t', 'tmpfs', '-o', 'size=32k', 'tmpfs', str(full)],
            capture_output=True).returncode == 0
        if not mounted:
            pytest.skip('cannot mount a small tmpfs here (needs root) to '
                        'fill a disk')
        try:
            _fill(full)
            with pytest.raises(JobError, match='No space left'):
                submit(job_config(data_dir), gpus=1, client=client,
                       path=full / 'jobs')
            assert list((full / 'jobs').iterdir()) == []
        finally:
            subprocess.run(['umount', '-l', str(full)], check=False)


def _fill(folder):
    """Fill ``folder``'s file system to the last block."""
    try:
        with open(folder / 'filler', 'wb') as f:
            while True:
                f.write(b'\0' * 1024)
                f.flush()
    except OSError:
        pass  # full


def test_only_the_submitter_cancels_a_job(cluster, data_dir, tmp_path,
                                          capsys):
    jobs = tmp_path / 'jobs'
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        job = submit(job_config(data_dir, epochs=50), gpus=1, client=client,
                     path=jobs)
    spec = json.loads((job.folder / 'job.json').read_text())
    mine = spec['user']
    spec['user'] = 'someone-else'
    (job.folder / 'job.json').write_text(json.dumps(spec))
    assert main(['cancel', job.id, '--jobs-dir', str(jobs)]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f'dasktrain cancel: error: job {job.id} was submitted by '
        f'someone-else; '
        f'only someone-else can cancel it (you are {mine})']
    assert not (job.folder / 'cancel').exists()
    spec['user'] = mine
    (job.folder / 'job.json').write_text(json.dumps(spec))
    assert main(['cancel', job.id, '--jobs-dir', str(jobs)]) == 0
    assert job.status()['state'] == 'cancelled'


def test_a_cluster_refuses_a_job_it_could_not_write(cluster):
    nobody = pwd.getpwnam('nobody').pw_uid
    with Client(cluster.address, set_as_default=False) as client:
        with pytest.raises(JobError) as e:
            check_owner(client, uid=nobody)
        check_owner(client)  # its owner: fine
    me = current_user()
    assert str(e.value) == (
        f"this cluster runs its jobs as {me}, not as you (nobody): it could "
        f"not write your job's private folder. Start a cluster of your own "
        f"(`dasktrain cluster start --port 0`), or ask {me} to submit it")


# Run as root, then as the second user: everything the submit needs is
# loaded first (the interpreter may live where that user cannot read).
SECOND_USER = """
import os, sys
from dasktrain.cli import main
from dasktrain.cluster.local import connect
import dasktrain.commands.jobs, dasktrain.jobs.client.submit
import dasktrain.jobs.job, dasktrain.jobs.request, dasktrain.data.datasets
address, uid, gid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with connect(address) as client:
    client.run_on_scheduler(os.getuid)
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
sys.exit(main(['submit', '--scheduler', address, '--gpus', '1', '--',
               '--model', 'tiny']))
"""


def test_a_second_unix_user_is_refused_in_one_line(cluster, tmp_path):
    if os.getuid() != 0:
        pytest.skip('only root can become a second Unix user here')
    nobody = pwd.getpwnam('nobody')
    home = tmp_path / 'nobody-home'
    home.mkdir()
    os.chown(home, nobody.pw_uid, nobody.pw_gid)
    env = dict(os.environ, HOME=str(home), DASKTRAIN_HOME=str(home / 'dt'),
               DASKTRAIN_JOBS_DIR=str(home / 'jobs'))
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
    with child([sys.executable, '-c', SECOND_USER, cluster.address,
                str(nobody.pw_uid), str(nobody.pw_gid)], env=env,
               cwd=home) as c:
        assert c.wait(120) == 1, c.stderr()
        lines = c.stderr().strip().splitlines()
    me = current_user()
    assert lines == [
        f'dasktrain submit: error: this cluster runs its jobs as {me}, not '
        f"as you (nobody): it could not write your job's private folder. "
        f'Start a cluster of your own (`dasktrain cluster start --port 0`), '
        f'or ask {me} to submit it']
    assert not (home / 'jobs').exists()  # nothing written
