"""Real `dask scheduler` / `dask worker` processes on 127.0.0.1: the
cluster's commands and its TLS, and the throwaway local workers of one
run. The helpers here (:class:`Processes`, :func:`job_config`,
:func:`wait_until`) start the clusters of the other cluster tests too
(test_jobs.py, test_monitor.py, test_tune.py, tests/gpu)."""
import contextlib
import importlib.util
import json
import os
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from distributed import Client

from dasktrain.cli import main
from dasktrain.config import TrainConfig
from dasktrain.errors import UserError
from dasktrain.jobs.client.submit import submit
from dasktrain.jobs.job import Job


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
        # The scheduler unpickles the tasks' graph too (Dask 2025.4+): it
        # imports a test module whose function a test submits, as workers do
        self.spawn('scheduler', '--host', '127.0.0.1', '--port', '0',
                   '--dashboard-address', '127.0.0.1:0',
                   '--scheduler-file', str(info), env=self.environ())
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
        there. ``visible``: its CUDA_VISIBLE_DEVICES (the GPU suite's).

        The test folders are on its PYTHONPATH: a test's function submitted
        to it travels by reference (Dask pickles the task, not the
        function, so cloudpickle's by-value registry is not consulted) and
        the worker imports the test module, as workers that
        multiprocessing starts do with the parent's ``sys.path``."""
        cwd = self.tmp_path / 'worker-cwd'
        cwd.mkdir(exist_ok=True)
        env = self.environ()
        if visible is not None:
            env['CUDA_VISIBLE_DEVICES'] = visible
        return self.spawn('worker', self.address, '--no-nanny', '--nthreads',
                          str(nthreads or gpus or 1), '--resources',
                          resources or f'GPU={gpus}', '--host', '127.0.0.1',
                          '--local-directory', str(self.tmp_path / 'space'),
                          cwd=cwd, env=env)

    @staticmethod
    def environ():
        """This environment with the test folders on PYTHONPATH."""
        tests = Path(__file__).resolve().parents[1]
        folders = [tests] + sorted(p for p in tests.iterdir() if p.is_dir())
        return dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(p) for p in folders] +
            [p for p in (os.environ.get('PYTHONPATH'),) if p]))

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def job_config(data_dir, **kw):
    base = dict(model='tiny', epochs=2, batch_size=50, devices=('@numpy',),
                data_dir=str(data_dir), lr=0.01, train_size=400,
                test_size=100)
    base.update(kw)
    return TrainConfig(**base)


def test_cluster_commands_start_status_and_stop(tmp_path, monkeypatch,
                                                capsys):
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path / 'home'))
    with socket.socket() as taken:  # the dashboard's port is someone's
        taken.bind(('127.0.0.1', 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(['cluster', 'start', '--port', '0', '--dashboard-port',
                     str(port), '--gpus', '2']) == 0
    state = json.loads((tmp_path / 'home' / 'cluster.json').read_text())
    try:
        out = capsys.readouterr().out
        assert state['scheduler'].startswith('tls://127.0.0.1:')
        assert f"scheduler: {state['scheduler']}" in out
        # Dask moved it to a free port: said, with why
        assert f"dashboard: {state['dashboard']} (port {port} is in use, " \
            'by another cluster or program: --dashboard-port to choose)\n' \
            in out
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


def test_cluster_start_workers_shares_out_the_gpus_and_runs_a_gang(
        tmp_path, data_dir, capsys):
    # `cluster start --workers 2` (here with its output piped into a
    # reader that is gone, as `| head`): two workers, the GPUs shared out,
    # each its own; a job across both runs on this one machine; `cluster
    # stop` leaves no cgroup behind.
    home = tmp_path / 'home'
    env = dict(os.environ, DASKTRAIN_HOME=str(home))
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [str(Path(sys.executable).with_name('dasktrain')), 'cluster',
             'start', '--port', '0', '--dashboard-port', '0', '--workers',
             '2', '--gpus', '3', '--max-gpus-per-user', '2'],
            stdout=write, stderr=subprocess.PIPE, text=True, env=env,
            timeout=120)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, '')
    state = json.loads((home / 'cluster.json').read_text())
    assert (state['workers'], state['resources']) == (
        2, 'GPU=2 CPU=1, GPU=1 CPU=1')
    joined = None
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv('DASKTRAIN_HOME', str(home))
        try:
            from dasktrain.cluster import connect
            with connect() as client:
                seen = client.run(lambda dask_worker: (
                    os.environ.get('CUDA_VISIBLE_DEVICES'),
                    dask_worker.state.total_resources['GPU']))
            assert sorted(seen.values()) == [('0,1', 2), ('2', 1)]
            jobs = str(tmp_path / 'jobs')
            assert main(['submit', '--gpus', '0', '--jobs-dir', jobs, '--',
                         '--workers', '2', '--model', 'tiny', '--epochs',
                         '1', '--devices', 'cpu', '--data-dir',
                         str(data_dir), '--train-size', '200',
                         '--test-size', '50']) == 0
            job = Job.find(capsys.readouterr().out.strip(), jobs)
            result = job.result(timeout=180)
            assert result['final']['epoch'] == 1
            assert (job.folder / 'rank1.log').is_file()  # two ranks
            # a worker that joined by hand with one thread says so
            tls = home / 'tls'
            joined = subprocess.Popen(
                [sys.executable, '-m', 'dask', 'worker', state['scheduler'],
                 '--no-nanny', '--nthreads', '1', '--host', '127.0.0.1',
                 '--dashboard-address', '127.0.0.1:0', '--local-directory',
                 str(tmp_path / 'space'), '--tls-ca-file',
                 str(tls / 'ca.pem'), '--tls-cert', str(tls / 'node.pem'),
                 '--tls-key', str(tls / 'node-key.pem')],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
            with connect() as client:
                wait_until(lambda: len(client.scheduler_info(
                    n_workers=-1)['workers']) == 3, 60, 'the third worker')
            assert main(['cluster', 'status']) == 0
            lines = capsys.readouterr().out.splitlines()
            assert sorted(line.split('): ')[1] for line in lines
                          if line.startswith('worker ')) == [
                'GPU=1, CPU=1, 3 threads', 'GPU=2, CPU=1, 4 threads',
                'no resources, 1 thread']
        finally:
            if joined is not None:
                joined.kill()
                joined.wait()
            assert main(['cluster', 'stop']) == 0
    import psutil
    for pid in state['pids']:  # ended (orphans this process may reap)
        assert not psutil.pid_exists(pid) or \
            psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    contain = state['contain']
    if contain['kind'] == 'cgroup':  # where the machine gives cgroups
        assert not Path(contain['root']).exists()


@pytest.mark.skipif(importlib.util.find_spec('cupy') is not None,
                    reason='CuPy is installed here')
def test_cluster_start_on_gpus_cupy_cannot_use_says_so_once(
        tmp_path, monkeypatch, capsys, gpu_server):
    # A driver lists a GPU (fake nvidia-smi), CuPy is absent: the worker
    # offers CPU slots only, and `cluster start` says why, once.
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path / 'home'))
    assert main(['cluster', 'start', '--port', '0', '--dashboard-port',
                 '0']) == 0
    try:
        out, err = capsys.readouterr()
        assert 'worker resources: CPU=1\n' in out
        said = [line for line in err.splitlines() if 'nvidia-smi' in line]
        assert said == [
            "warning: nvidia-smi sees 1 GPU, but CuPy cannot use it (No "
            "module named 'cupy'): install CuPy with its CUDA libraries: "
            "`make install` in dasktrain's checkout (it picks them for the "
            "driver), or pip install 'dasktrain[cuda13]' for a CUDA 13 "
            "driver ('dasktrain[cuda12]' for CUDA 12; docs/install.md); "
            'until then the worker offers none of them, only CPU slots '
            '(--gpus N offers them anyway, to programs that need no CuPy)']
    finally:
        assert main(['cluster', 'stop']) == 0


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
            # glibc's allocator settings in the worker, not Dask's
            assert set(client.run(lambda: os.environ.get(
                'MALLOC_TRIM_THRESHOLD_')).values()) == {None}
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
    assert '--insecure and the TLS files contradict' in capsys.readouterr().err
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
    from dasktrain.cluster import (
        cluster_status,
        connect,
        start_cluster,
        stop_cluster,
    )
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


# ------------------------------------------- throwaway local workers

def test_local_workers_listen_on_loopback_only_and_require_tls(listening):
    from dasktrain.cluster.workers import local_workers
    me = os.getpid()
    before = listening([me])
    with local_workers(2) as client:
        address = client.scheduler.address
        new = listening([me]) - before
        workers = set(client.run(os.getpid).values())
        # nor do they spend CPU profiling themselves for no one, nor page
        # faults on NumPy's temporaries (Dask's allocator setting)
        assert set(client.run(lambda: __import__('dask').config.get(
            'distributed.worker.profile.enabled')).values()) == {False}
        assert set(client.run(lambda: os.environ.get(
            'MALLOC_TRIM_THRESHOLD_')).values()) == {None}
        assert address.startswith('tls://127.0.0.1:')
        with pytest.raises(TypeError, match='TLS expects'):
            Client(address, timeout=3)  # no certificates, no connection
    ports = {port for _, _, port in new}
    assert int(address.rsplit(':', 1)[1]) in ports
    assert workers <= {pid for pid, _, _ in new}  # each worker listens
    assert {ip for _, ip, _ in new} == {'127.0.0.1'}


def test_workers_start_with_glibcs_allocator_after_a_plain_dask_cluster(
        monkeypatch):
    # A plain Dask nanny in this process writes its pre-spawn environment
    # (MALLOC_TRIM_THRESHOLD_=65536) into os.environ, where every later
    # child process would inherit it; dasktrain's workers must not.
    from distributed import LocalCluster

    from dasktrain.cluster import malloc
    from dasktrain.cluster.workers import local_workers
    monkeypatch.delenv(malloc.VARIABLE, raising=False)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      host='127.0.0.1', dashboard_address=None) as cluster:
        # Not the default client: this test is about the nanny's
        # environment, not dask's default scheduler (which a default
        # client's close restores, at a time of its own).
        with Client(cluster, set_as_default=False) as client:
            assert set(client.run(lambda: os.environ.get(
                'MALLOC_TRIM_THRESHOLD_')).values()) == {'65536'}
    assert os.environ.get(malloc.VARIABLE) == '65536'  # Dask's leftover
    with local_workers(1) as client:
        assert set(client.run(lambda: os.environ.get(
            'MALLOC_TRIM_THRESHOLD_')).values()) == {None}
    assert malloc.VARIABLE not in os.environ
    # the same for the environment of `cluster start`'s processes, and a
    # value the user had set stays
    env = {malloc.VARIABLE: '65536', 'PATH': '/bin'}
    assert malloc.users_environ(env) == {'PATH': '/bin'}
    monkeypatch.setattr(malloc, '_USERS', '131072')
    assert malloc.users_environ(env) == {'PATH': '/bin',
                                         malloc.VARIABLE: '131072'}
