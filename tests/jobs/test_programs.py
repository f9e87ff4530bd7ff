"""Command jobs on a real local cluster with real processes: any program
queued like a training run (`dasktrain submit -- PROGRAM ARGS`), in the
submitter's folder and environment, with exactly its GPUs visible; its
exit code, a cancel of its whole process tree (SIGTERM, then SIGKILL),
and a worker killed under it (lost)."""
import contextlib
import os
import signal
import socket
import sys
import time

import pytest
from distributed import Client
from test_cluster import Processes, wait_until

from dasktrain.cli import main
from dasktrain.jobs.client.submit import parse_env, submit_command
from dasktrain.jobs.job import Job, JobError
from dasktrain.keeper import exit_words


@pytest.fixture
def cluster(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.close()


def started(job, marker, timeout=60):
    wait_until(lambda: marker in job.logs(), timeout, f'{marker!r} logged')


def test_a_program_runs_where_and_as_its_submitter_said(
        cluster, tmp_path, monkeypatch, capsys):
    cluster.worker(gpus=2)
    lab = tmp_path / 'lab'
    lab.mkdir()
    (lab / 'show.py').write_text(
        'import os, sys\n'
        'print("cwd", os.getcwd())\n'
        'print("gpus", repr(os.environ["CUDA_VISIBLE_DEVICES"]))\n'
        'print("secret", os.environ.get("LAB_TOKEN"))\n'
        'print("added", os.environ.get("EXTRA"))\n'
        'sys.exit(int(sys.argv[1]))\n')
    monkeypatch.chdir(lab)
    monkeypatch.setenv('LAB_TOKEN', 'abc123')  # the submitter's env
    jobs = tmp_path / 'jobs'
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
    assert main(['submit', '--gpus', '1', '--scheduler', cluster.address,
                 '--jobs-dir', str(jobs), '--env', 'EXTRA=yes', '--',
                 sys.executable, 'show.py', '0']) == 0
    job_id = capsys.readouterr().out.strip()
    job = Job(job_id, jobs / job_id)
    status = wait_for_end(job)
    assert status['state'] == 'finished' and status['exit_code'] == 0
    log = job.logs()
    assert f'cwd {lab}' in log
    assert job.spec().host == socket.gethostname()  # and the user
    assert "gpus '0'" in log or "gpus '1'" in log  # exactly one GPU
    assert 'secret abc123' in log and 'added yes' in log
    # the environment is the submitter's only: the folder and the file
    assert os.stat(job.folder).st_mode & 0o077 == 0
    assert os.stat(job.folder / 'env.json').st_mode & 0o077 == 0


def wait_for_end(job, timeout=120):
    wait_until(lambda: job.status()['state'] in (
        'finished', 'failed', 'cancelled', 'lost'), timeout, 'the job ends')
    return job.status()


def test_exit_codes_and_signals_are_the_end_in_words(cluster, tmp_path):
    cluster.worker(gpus=0, resources='CPU=2', nthreads=2)
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        three = submit_command([sys.executable, '-c', 'raise SystemExit(3)'],
                               gpus=0, client=client, path=tmp_path / 'j')
        killed = submit_command(
            [sys.executable, '-c', 'import os, signal; '
             'os.kill(os.getpid(), signal.SIGKILL)'],
            gpus=0, client=client, path=tmp_path / 'j')
        missing = submit_command(['no-such-program-here'], gpus=0,
                                 client=client, path=tmp_path / 'j')
    assert wait_for_end(three)['error'] == 'exit 3'
    assert wait_for_end(killed)['error'] == 'killed by SIGKILL'
    status = wait_for_end(missing)
    assert status['state'] == 'failed'
    assert 'cannot start no-such-program-here' in status['error']
    with pytest.raises(JobError, match=r'failed: exit 3'):
        three.result()
    assert exit_words(-15) == 'killed by SIGTERM'
    with pytest.raises(JobError, match='takes KEY=VALUE'):
        parse_env(['1A=2'])


@pytest.mark.parametrize('trap', [False, True])
def test_cancel_stops_the_whole_process_tree(cluster, tmp_path, trap):
    # A shell that started a python that started a sleep: cancel stops
    # them all; a program ignoring SIGTERM is killed after the grace.
    cluster.worker(gpus=0, resources='CPU=1', nthreads=1)
    pids = tmp_path / 'pids'
    ignore = 'signal.signal(signal.SIGTERM, signal.SIG_IGN)' if trap else ''
    script = (f'import os, signal, subprocess, time\n'
              f'{ignore}\n'
              f'p = subprocess.Popen(["sleep", "300"])\n'
              f'open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{p.pid}}")\n'
              f'print("ready", flush=True)\n'
              f'time.sleep(300)\n')
    (tmp_path / 'tree.py').write_text(script)
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        job = submit_command(['sh', '-c', f'{sys.executable} tree.py'],
                             gpus=0, grace=2, cwd=tmp_path, client=client,
                             path=tmp_path / 'j')
        started(job, 'ready')
        children = [int(p) for p in pids.read_text().split()]
        began = time.monotonic()
        job.cancel(client)
    status = wait_for_end(job)
    took = time.monotonic() - began
    assert status['state'] == 'cancelled'
    if trap:
        assert status['error'] == ('SIGTERM ignored for 2 s: killed by '
                                   'SIGKILL')
        assert took >= 2
    else:
        assert status['error'] == 'stopped by SIGTERM'
    with killed_at_end(children):
        for pid in children:
            wait_until(lambda pid=pid: not alive(pid), 10, f'{pid} gone')


def alive(pid):
    """Whether ``pid`` runs (a zombie, not yet reaped by its dead
    parent's reaper, is gone too)."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().split(')')[-1].split()[0] != 'Z'
    except OSError:
        return False


@contextlib.contextmanager
def killed_at_end(pids):
    """Within: SIGKILL to those of ``pids`` still running at the end,
    whatever happened: a failing test leaves no process behind."""
    try:
        yield
    finally:
        for pid in pids:
            if alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def test_a_worker_killed_under_a_program_leaves_it_lost(cluster, tmp_path):
    # ... and takes every process of the job with it: the program's, its
    # shell's background child, and one that left the session (setsid).
    worker = cluster.worker(gpus=0, resources='CPU=1', nthreads=1)
    pids = tmp_path / 'pids'
    script = (f'sleep 300 & echo $! > {pids}.1; '
              f'setsid sh -c "echo \\$\\$ > {pids}.2; exec sleep 300" & '
              f'{sys.executable} -c "import os, time; '
              f"open('{pids}.3', 'w').write(str(os.getpid())); "
              f"print('up', flush=True); time.sleep(300)\"")
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        job = submit_command(['sh', '-c', script], gpus=0, client=client,
                             path=tmp_path / 'j')
        started(job, 'up')
        wait_until(lambda: all(os.path.exists(f'{pids}.{i}') and
                               open(f'{pids}.{i}').read().strip()
                               for i in (1, 2, 3)), 30, 'the pids written')
        children = [int(open(f'{pids}.{i}').read()) for i in (1, 2, 3)]
        with killed_at_end(children):
            assert all(alive(pid) for pid in children)
            os.killpg(worker.pid, signal.SIGKILL)
            for pid in children:
                wait_until(lambda pid=pid: not alive(pid), 30, f'{pid} gone')
        cluster.worker(gpus=0, resources='CPU=1', nthreads=1)  # Dask reruns
    status = wait_for_end(job)
    assert status['state'] == 'lost'
    assert 'died while it ran' in status['error']


def test_what_a_program_leaves_running_ends_with_it(cluster, tmp_path):
    # A job is over when its program is: a background process it left
    # (a shell's `cmd &`) does not hold the worker's GPUs on.
    cluster.worker(gpus=0, resources='CPU=1', nthreads=1)
    pid = tmp_path / 'pid'
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        job = submit_command(['sh', '-c', f'sleep 300 & echo $! > {pid}'],
                             gpus=0, grace=2, client=client,
                             path=tmp_path / 'j')
    status = wait_for_end(job)
    left = int(pid.read_text())
    with killed_at_end([left]):
        assert status['state'] == 'finished'
        wait_until(lambda: not alive(left), 10, 'the sleep gone')
