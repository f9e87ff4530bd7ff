"""Real `dask scheduler` / `dask worker` processes on 127.0.0.1; CPU
workers labelled with fake GPU resources, jobs that train on the CPU."""
import json
import os
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time

import pytest
import requests
from distributed import Client

from dasktrain.cli import main
from dasktrain.config import TrainConfig
from dasktrain.errors import UserError
from dasktrain.cluster.jobs import Job, JobError, submit
from dasktrain.training import train

TIME_KEYS = {'elapsed_time', 'images_per_sec', 'data_wait_time',
             'comm_time'}


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(200, 100, 5)


def wait_until(predicate, timeout=120, what='condition'):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f'timed out waiting for {what}')


class Processes:
    """Scheduler and workers started by a test, killed at its end."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.procs = []
        info = tmp_path / 'scheduler.json'
        self.spawn('scheduler', '--host', '127.0.0.1', '--port', '0',
                   '--dashboard-address', '127.0.0.1:0',
                   '--scheduler-file', str(info))
        wait_until(info.exists, 60, 'the scheduler')
        wait_until(lambda: json.loads(info.read_text() or '{}'), 10,
                   'the scheduler file')
        self.address = json.loads(info.read_text())['address']

    def spawn(self, *args, cwd=None, env=None):
        proc = subprocess.Popen([sys.executable, '-m', 'dask', *args],
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, cwd=cwd, env=env,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def worker(self, gpus=2, resources=None, nthreads=None, visible=None):
        """A worker offering ``gpus`` GPUs (or ``resources``), in a working
        directory of its own: paths relative to the test's mean nothing
        there. ``visible``: its CUDA_VISIBLE_DEVICES (the GPU suite's)."""
        cwd = self.tmp_path / 'worker-cwd'
        cwd.mkdir(exist_ok=True)
        env = None if visible is None else \
            dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
        return self.spawn('worker', self.address, '--no-nanny', '--nthreads',
                          str(nthreads or gpus or 1), '--resources',
                          resources or f'GPU={gpus}', '--host', '127.0.0.1',
                          '--local-directory', str(self.tmp_path / 'space'),
                          cwd=cwd, env=env)

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def cluster(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.close()


def job_config(data_dir, **kw):
    base = dict(model='tiny', epochs=2, batch_size=50, devices=('@numpy',),
                data_dir=str(data_dir), lr=0.01, train_size=400,
                test_size=100)
    base.update(kw)
    return TrainConfig(**base)


def test_cluster_commands_start_status_and_stop(tmp_path, monkeypatch,
                                                capsys):
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path / 'home'))
    assert main(['cluster', 'start', '--port', '0', '--dashboard-port', '0',
                 '--gpus', '2']) == 0
    state = json.loads((tmp_path / 'home' / 'cluster.json').read_text())
    try:
        out = capsys.readouterr().out
        assert state['scheduler'].startswith('tls://127.0.0.1:')
        assert f"scheduler: {state['scheduler']}" in out
        assert 'dashboard: http://127.0.0.1:' in out
        page = requests.get(state['dashboard'], timeout=30)
        assert page.status_code == 200
        assert 'needs bokeh' not in page.text  # what Dask says without it
        assert '<title>Dask Diagnostic UI</title>' in page.text
        assert 'Bokeh.embed.embed_items' in page.text  # its plots
        assert main(['cluster', 'status']) == 0
        # GPU jobs, one CPU job beside them, and a scale-out driver's thread
        assert 'GPU=2, CPU=1, 4 threads' in capsys.readouterr().out
        assert main(['cluster', 'start', '--port', '0']) == 1
        assert 'already running' in capsys.readouterr().err
    finally:
        assert main(['cluster', 'stop']) == 0
    assert not (tmp_path / 'home' / 'cluster.json').exists()
    for pid in state['pids']:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert main(['cluster', 'status']) == 1
    assert 'no cluster is recorded' in capsys.readouterr().err


def test_three_one_gpu_jobs_share_a_two_gpu_worker(cluster, data_dir,
                                                   tmp_path):
    cluster.worker(gpus=2)
    with Client(cluster.address) as client:
        client.wait_for_workers(1)
        jobs = [submit(job_config(data_dir, epochs=3), gpus=1,
                       name=f'j{i}', client=client, path=tmp_path / 'jobs')
                for i in range(3)]
    # the submitting client is gone; the jobs go on
    results = [job.result(timeout=180) for job in jobs]
    assert all(r['final']['epoch'] == 3 for r in results)
    spans = [(s['started'], s['ended'], s['gpus'][0])
             for s in (job.status() for job in jobs)]
    for start, _, _ in spans:  # who runs at each moment a job starts
        running = [g for s, e, g in spans if s <= start < e]
        assert len(running) <= 2
        assert len(set(running)) == len(running)  # never the same GPU
    assert {g for _, _, g in spans} == {'0', '1'}
    for job, (_, _, gpu) in zip(jobs, spans):  # each saw its own GPU only
        assert f"CUDA_VISIBLE_DEVICES='{gpu}'" in job.logs()


def test_a_cpu_job_sees_no_gpu(cluster, data_dir, tmp_path):
    # A worker that offers GPUs and CPU slots, as `cluster start` makes on
    # a GPU server; the CPU job must not inherit the worker's GPUs.
    cluster.spawn('worker', cluster.address, '--no-nanny', '--nthreads',
                  '3', '--resources', 'GPU=2 CPU=1', '--host', '127.0.0.1',
                  '--local-directory', str(tmp_path / 'space'))
    with Client(cluster.address) as client:
        client.wait_for_workers(1)
        job = submit(job_config(data_dir, epochs=1, devices=None), gpus=0,
                     client=client, path=tmp_path / 'jobs')
    result = job.result(timeout=180)
    assert result['final']['epoch'] == 1
    assert "CUDA_VISIBLE_DEVICES=''" in job.logs()
    assert job.status()['gpus'] == []


def test_a_submitted_job_across_two_cpu_workers(cluster, data_dir,
                                                tmp_path):
    for _ in range(2):  # as `cluster start` makes them: 1 slot + 1 thread
        cluster.spawn('worker', cluster.address, '--no-nanny', '--nthreads',
                      '2', '--resources', 'CPU=1', '--host', '127.0.0.1',
                      '--local-directory', str(tmp_path / 'space'))
    with Client(cluster.address) as client:
        client.wait_for_workers(2)
        job = submit(job_config(data_dir, workers=2, mode='ipm',
                                mix_every=2), gpus=0, client=client,
                     path=tmp_path / 'jobs')
        with pytest.raises(JobError, match='--workers 3 needs as many Dask workers with a CPU slot'):
            submit(job_config(data_dir, workers=3), gpus=0, client=client,
                   path=tmp_path / 'jobs')
    result = job.result(timeout=180)
    assert result['final']['epoch'] == 2
    assert result['final']['iteration'] == 2 * 4  # 400 images / (2 x 50)
    assert 'drift' in result['final']
    assert 'done: epoch 2' in job.logs()


def test_a_killed_worker_resumes_the_job_from_its_checkpoint(
        cluster, data_dir, tmp_path, capsys):
    config = job_config(data_dir, epochs=6, train_size=1000)
    worker = cluster.worker(gpus=1)
    with Client(cluster.address) as client:
        client.wait_for_workers(1)
        job = submit(config, gpus=1, client=client, path=tmp_path / 'jobs')
    wait_until(lambda: len(job.log_rows()) >= 1, 120, 'the first epoch')
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    done_before = len(job.log_rows())
    assert done_before < 6, 'the job ended before the worker was killed'
    # No worker now: the file still says running, the scheduler knows why.
    wait_until(lambda: main(['jobs', '--jobs-dir', str(tmp_path / 'jobs')])
               == 0 and 'no-worker' in capsys.readouterr().out, 30,
               "the scheduler's view")
    cluster.worker(gpus=1)
    result = job.result(timeout=180)
    epochs = [row['epoch'] for row in result['log']]
    assert epochs == [1, 2, 3, 4, 5, 6]
    status = job.status()
    assert status['attempts'] == 2 and status['state'] == 'finished'
    text = job.logs()
    assert '=== attempt 2 on' in text
    resumed = int(text.split('resuming after epoch ')[1].split()[0])
    assert resumed >= done_before
    # It ends exactly where an uninterrupted run ends.
    reference = train(config.replace(out=str(tmp_path / 'ref'),
                                     progress=False))
    for ours, theirs in zip(result['log'], reference['log'], strict=True):
        for key in set(ours) - TIME_KEYS:
            assert ours[key] == theirs[key], key


def test_cancel_a_queued_and_a_running_job(cluster, data_dir, tmp_path,
                                           capsys):
    cluster.worker(gpus=1)
    with Client(cluster.address) as client:
        client.wait_for_workers(1)
        running = submit(job_config(data_dir, epochs=50, train_size=1000),
                         gpus=1, client=client, path=tmp_path / 'jobs')
        queued = submit(job_config(data_dir), gpus=1, client=client,
                        path=tmp_path / 'jobs')
    wait_until(lambda: running.status()['state'] == 'running', 60, 'start')
    assert queued.status()['state'] == 'queued'
    args = ['--jobs-dir', str(tmp_path / 'jobs')]
    assert main(['cancel', queued.id, *args]) == 0
    assert capsys.readouterr().out == f'{queued.id}: cancelled\n'
    assert queued.status()['state'] == 'cancelled'
    wait_until(lambda: len(running.log_rows()) >= 1, 120, 'an epoch')
    assert main(['cancel', running.id, *args]) == 0
    # The state after the cancel, not the 'running' from before it.
    assert capsys.readouterr().out == f'{running.id}: cancelled\n'
    assert running.status()['state'] == 'cancelled'
    assert running.status()['epoch'] < 50
    time.sleep(1)
    assert queued.status()['state'] == 'cancelled'
    assert not (queued.folder / 'out' / 'log').exists()
    with pytest.raises(JobError, match='cancelled'):
        running.result(timeout=1)


def test_a_failing_job_is_marked_failed_and_others_finish(
        cluster, data_dir, tmp_path, capsys):
    broken = tmp_path / 'broken'
    (broken / 'cifar-10-batches-py').mkdir(parents=True)
    cluster.worker(gpus=2)
    with Client(cluster.address) as client:
        client.wait_for_workers(1)
        bad = submit(job_config(broken), gpus=1, client=client,
                     path=tmp_path / 'jobs')
        good = submit(job_config(data_dir), gpus=1, client=client,
                      path=tmp_path / 'jobs')
    assert good.result(timeout=120)['final']['epoch'] == 2
    with pytest.raises(JobError, match='failed: error: missing batch file'):
        bad.result(timeout=60)
    assert bad.status()['attempts'] == 1  # a failure is not retried
    assert main(['logs', bad.id, '--jobs-dir', str(tmp_path / 'jobs')]) == 0
    assert 'missing batch file' in capsys.readouterr().out
    assert main(['jobs', '--jobs-dir', str(tmp_path / 'jobs')]) == 0
    listing = capsys.readouterr().out
    assert f'{bad.id}' in listing and 'failed' in listing
    assert 'finished' in listing and '2/2' in listing
    assert main(['result', good.id, '--jobs-dir',
                 str(tmp_path / 'jobs')]) == 0
    assert 'validation/main/accuracy: ' in capsys.readouterr().out
    # One damaged job folder hides no other and breaks nothing.
    jobs = tmp_path / 'jobs'
    shutil.copytree(good.folder, jobs / 'cut')
    text = (jobs / 'cut' / 'status.json').read_text()
    (jobs / 'cut' / 'status.json').write_text(text[:len(text) // 2])
    shutil.copytree(good.folder, jobs / 'blank')
    (jobs / 'blank' / 'job.json').write_text('{}')
    assert main(['jobs', '--jobs-dir', str(jobs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    states = {line.split()[0]: line.split()[1] for line in lines[1:]
              if not line.startswith('unreadable:')}
    assert states == {bad.id: 'failed', good.id: 'finished',
                      'cut': 'unreadable', 'blank': 'unreadable'}
    assert 'unreadable: job cut: status.json is not valid JSON' in \
        '\n'.join(lines)
    assert 'unreadable: job blank: job.json lacks submitted, config' in lines
    for command, job_id, reason in [
            ('result', 'cut', 'status.json is not valid JSON'),
            ('logs', 'blank', 'job.json lacks submitted'),
            ('cancel', 'blank', 'job.json lacks submitted')]:
        assert main([command, job_id, '--jobs-dir', str(jobs)]) == 1
        err = capsys.readouterr().err
        assert err.count('\n') == 1 and reason in err, err


def test_submit_time_errors(cluster, data_dir, tmp_path, monkeypatch,
                            capsys):
    cluster.worker(gpus=2)
    with Client(cluster.address) as client:
        client.wait_for_workers(1)
        with pytest.raises(JobError, match='no worker has 3 GPU'):
            submit(job_config(data_dir), gpus=3, client=client,
                   path=tmp_path / 'jobs')
    began = time.monotonic()
    assert main(['submit', '--scheduler', 'tcp://127.0.0.1:9', '--', '--model',
                 'tiny']) == 1
    assert 'cannot reach the scheduler at tcp://127.0.0.1:9' in \
        capsys.readouterr().err
    assert time.monotonic() - began < 30
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path / 'nohome'))
    assert main(['submit', '--', '--model', 'tiny']) == 1
    assert 'no cluster is recorded' in capsys.readouterr().err
    assert main(['submit', '--scheduler', cluster.address, '--',
                 '--batch-size', '0']) == 2
    assert capsys.readouterr().err.splitlines() == [
        'usage: dasktrain submit -- [options]',
        'dasktrain submit --: error: --batch-size must be an int >= 1, got 0',
        'see `dasktrain train --help`']
    # `cluster status` takes the --scheduler its error message suggests.
    assert main(['cluster', 'status', '--scheduler', cluster.address]) == 0
    assert 'GPU=2, 2 threads' in capsys.readouterr().out
    assert not (tmp_path / 'jobs').exists() or \
        not any((tmp_path / 'jobs').iterdir())


def test_without_gpus_submit_says_that_gpus_0_takes_a_cpu_slot(
        cluster, tmp_path, capsys):
    cluster.worker(gpus=0, resources='CPU=2')
    with Client(cluster.address) as client:
        client.wait_for_workers(1)
    assert main(['submit', '--scheduler', cluster.address, '--jobs-dir',
                 str(tmp_path / 'jobs'), '--', '--model', 'tiny']) == 1
    err = capsys.readouterr().err
    assert err.startswith('dasktrain submit: error: no worker has 1 GPU ')
    assert 'pass --gpus 0 to take one of the 2 CPU slots' in err
    assert main(['submit', '--help']) == 0
    assert '0 takes one CPU slot' in ' '.join(capsys.readouterr().out.split())


def test_submit_command_prints_an_id_at_once(cluster, data_dir, tmp_path,
                                             capsys, monkeypatch):
    cluster.worker(gpus=1)
    with Client(cluster.address) as client:
        client.wait_for_workers(1)
    # Relative paths mean the submitter's directory, not the worker's.
    monkeypatch.chdir(data_dir.parent)
    assert main(['submit', '--scheduler', cluster.address, '--gpus', '1',
                 '--name', 'sweep', '--jobs-dir', str(tmp_path / 'jobs'),
                 '--', '--model', 'tiny', '--epochs', '1', '--devices', 'cpu',
                 '--data-dir', data_dir.name, '--train-size', '200']) == 0
    job_id = capsys.readouterr().out.strip()
    assert job_id.startswith('sweep-')
    job = Job.find(job_id, tmp_path / 'jobs')
    assert job.spec()['config']['data_dir'] == str(data_dir)
    assert job.result(timeout=120)['final']['epoch'] == 1
    assert list((tmp_path / 'worker-cwd').iterdir()) == []
    assert main(['logs', job_id, '--follow', '--jobs-dir',
                 str(tmp_path / 'jobs')]) == 0
    assert 'done: epoch 1' in capsys.readouterr().out


def test_no_tls_warns_also_on_loopback():
    from dasktrain.cluster import exposure_warning
    assert exposure_warning('127.0.0.1', tls=True) is None
    assert exposure_warning('10.0.0.5', tls=True) is None
    for host in ('127.0.0.1', 'localhost'):
        assert 'every user of this machine can connect' in \
            exposure_warning(host, tls=False)
    assert 'without TLS' in exposure_warning('10.0.0.5', tls=False)
    assert 'without TLS' in exposure_warning('0.0.0.0', tls=False)


def _refused_without_a_client_certificate(address):
    """Whether the scheduler at ``address`` ends a TLS session whose client
    presents no certificate (and checks nothing itself, as an attacker's
    would not)."""
    host, port = address[len('tls://'):].rsplit(':', 1)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, int(port)), timeout=5) as raw, \
                context.wrap_socket(raw) as tls:
            tls.sendall(b'\0' * 8)
            return tls.recv(1) == b''  # TLS 1.3: refused after handshake
    except (ssl.SSLError, ConnectionError):
        return True


def test_the_default_cluster_requires_its_certificates_and_stays_local(
        tmp_path, monkeypatch, capsys, data_dir, listening):
    from distributed import Security
    home = tmp_path / 'home'
    monkeypatch.setenv('DASKTRAIN_HOME', str(home))
    assert main(['cluster', 'start', '--port', '0', '--dashboard-port', '0',
                 '--gpus', '1']) == 0
    state = json.loads((home / 'cluster.json').read_text())
    try:
        address = state['scheduler']
        assert address.startswith('tls://127.0.0.1:')
        assert 'warning' not in capsys.readouterr().err
        # the private CA and certificate: the owner's alone
        tls = home / 'tls'
        assert stat.S_IMODE(tls.stat().st_mode) == 0o700
        assert sorted(p.name for p in tls.iterdir()) == [
            'ca-key.pem', 'ca.pem', 'node-key.pem', 'node.pem']
        for path in tls.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        # every listener of its processes on 127.0.0.1, none on a wildcard
        sockets = listening(state['pids'])
        assert len(sockets) >= 5  # scheduler, dashboard, nanny, worker, http
        assert {ip for _, ip, _ in sockets} == {'127.0.0.1'}
        # refused: no client certificate, a foreign CA's, plain TCP
        assert _refused_without_a_client_certificate(address)
        with pytest.raises(OSError, match='TLS certificate does not match'):
            Client(address, timeout=3, security=Security.temporary())
        with pytest.raises(OSError):
            Client(address.replace('tls://', 'tcp://'), timeout=3)
        # with the files: Dask's own client, and dasktrain's without a flag
        own = Security(tls_ca_file=str(tls / 'ca.pem'),
                       tls_client_cert=str(tls / 'node.pem'),
                       tls_client_key=str(tls / 'node-key.pem'),
                       require_encryption=True)
        with Client(address, timeout=10, security=own) as client:
            assert len(client.scheduler_info()['workers']) == 1
        jobs = str(tmp_path / 'jobs')
        assert main(['submit', '--gpus', '1', '--jobs-dir', jobs, '--',
                     '--model', 'tiny', '--epochs', '1', '--devices', 'cpu',
                     '--data-dir', str(data_dir), '--train-size', '200',
                     '--test-size', '50']) == 0
        job = Job.find(capsys.readouterr().out.strip(), jobs)
        assert job.result(timeout=120)['final']['epoch'] == 1
        assert main(['jobs', '--jobs-dir', jobs]) == 0
        assert 'finished' in capsys.readouterr().out
    finally:
        assert main(['cluster', 'stop']) == 0
    assert 'stopped the cluster' in capsys.readouterr().out


def test_insecure_keeps_plain_tcp_and_says_so(tmp_path, monkeypatch,
                                               capsys):
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path / 'home'))
    assert main(['cluster', 'start', '--insecure', '--tls-cert', 'x.pem']) \
        == 1
    assert '--insecure and --tls-* contradict' in capsys.readouterr().err
    assert main(['cluster', 'start', '--insecure', '--port', '0',
                 '--dashboard-port', '0', '--gpus', '1']) == 0
    try:
        captured = capsys.readouterr()
        assert 'scheduler: tcp://127.0.0.1:' in captured.out
        assert 'TLS: none (--insecure)' in captured.out
        assert 'warning: --insecure: no TLS; every user of this machine ' \
            'can connect' in captured.err
        assert not (tmp_path / 'home' / 'tls').exists()
    finally:
        assert main(['cluster', 'stop']) == 0


def test_stop_never_signals_a_process_that_reuses_a_recorded_pid(
        tmp_path, monkeypatch, capsys):
    import psutil
    home = tmp_path / 'home'
    home.mkdir()
    monkeypatch.setenv('DASKTRAIN_HOME', str(home))
    # An unrelated process that leads its own process group, as a cluster
    # process did; the record says the pid, but not this process' start.
    sleeper = subprocess.Popen(['sleep', '60'], start_new_session=True)
    try:
        started = psutil.Process(sleeper.pid).create_time()
        (home / 'cluster.json').write_text(json.dumps({
            'scheduler': 'tcp://127.0.0.1:9', 'dashboard': None,
            'pids': [sleeper.pid], 'created': [started - 3600],
            'resources': 'CPU=1', 'host': '127.0.0.1', 'tls': None,
            'started': started - 3600}))
        assert main(['cluster', 'stop']) == 0
        time.sleep(0.5)
        assert sleeper.poll() is None  # it survives
        out = capsys.readouterr().out
        assert 'no cluster was running at tcp://127.0.0.1:9 (its processes ' \
            'are gone); removed the stale record' in out
        assert not (home / 'cluster.json').exists()
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.skipif(subprocess.run(['which', 'openssl'],
                                   capture_output=True).returncode,
                    reason='needs the openssl command to make certificates')
def test_tls_cluster(tmp_path, monkeypatch, data_dir):
    from dasktrain.cluster import (connect, start_cluster, stop_cluster,
                                   cluster_status)
    cert, key = tmp_path / 'cert.pem', tmp_path / 'key.pem'
    subprocess.run(['openssl', 'req', '-x509', '-newkey', 'rsa:2048',
                    '-nodes', '-keyout', str(key), '-out', str(cert),
                    '-days', '1', '-subj', '/CN=localhost', '-addext',
                    'subjectAltName=IP:127.0.0.1,DNS:localhost'],
                   check=True, capture_output=True)
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path / 'home'))
    state = start_cluster(port=0, dashboard_port=0, gpus=1,
                          tls_ca_file=str(cert), tls_cert=str(cert),
                          tls_key=str(key))
    try:
        assert state['scheduler'].startswith('tls://127.0.0.1:')
        assert len(cluster_status()['workers']) == 1
        # Without the certificates the scheduler cannot be reached.
        with pytest.raises(UserError, match='cannot reach the scheduler'):
            connect(state['scheduler'].replace('tls://', 'tcp://'),
                    timeout=3)
        job = submit(job_config(data_dir, epochs=1, train_size=200), gpus=1,
                     path=tmp_path / 'jobs')
        assert job.result(timeout=120)['final']['epoch'] == 1
    finally:
        stop_cluster()
