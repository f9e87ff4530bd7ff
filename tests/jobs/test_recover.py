"""Nothing stranded: jobs of a killed cluster are requeued at the next
`cluster start` and resume; `result --wait` and `logs --follow` end with
one line when a job can no longer finish; `cluster stop` records what
became of its jobs; damaged job files are one row, everything else stays
up. On real `dasktrain cluster start` processes in a home of their own."""
import json
import os
import signal
import time
import urllib.request

import pytest
from test_cluster import job_config, wait_until

from dasktrain.cli import main
from dasktrain.cluster.local import connect, read_state, stop_cluster
from dasktrain.jobs.client.submit import submit
from dasktrain.jobs.job import Job

START = ['cluster', 'start', '--port', '0', '--dashboard-port', '0',
         '--gpus', '0']


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(200, 100, 5)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A cluster home of the test's own, stopped (whatever is left) at the
    end."""
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path / 'home'))
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '')
    monkeypatch.delenv('DASKTRAIN_JOBS_DIR', raising=False)
    yield tmp_path / 'home'
    if read_state() is not None:
        stop_cluster()


# Long enough to be running when the cluster is killed or stopped (an
# epoch of 200 images takes about half a second here), short enough that
# waiting for its end is not most of the test.
EPOCHS = 15


def long_job(data_dir, name, epochs=EPOCHS):
    with connect() as client:
        return submit(job_config(data_dir, epochs=epochs, train_size=200),
                      gpus=0, name=name, client=client)


def kill_cluster():
    """SIGKILL the scheduler and the worker: a crash, not a stop."""
    for pid in read_state()['pids']:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_killed_cluster_s_job_ends_its_waiters_and_resumes_on_restart(
        home, data_dir, capsys):
    assert main(START) == 0
    job = long_job(data_dir, 'crash')
    wait_until(lambda: len(job.log_rows()) >= 1, 120, 'the first epoch')
    kill_cluster()
    capsys.readouterr()
    began = time.monotonic()
    assert main(['result', job.id, '--wait']) == 1
    assert main(['logs', job.id, '--follow']) == 1
    assert time.monotonic() - began < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(
        f'job {job.id} can no longer finish: its scheduler' in line and
        f'`dasktrain requeue {job.id}`' in line for line in err)
    done_before = len(job.log_rows())
    assert main(START) == 0  # the stale record is replaced
    assert f'requeued job {job.id} (its cluster had gone)' in \
        capsys.readouterr().out
    result = job.result(timeout=240)
    assert [r['epoch'] for r in result['log']] == list(range(1, EPOCHS + 1))
    assert job.status()['attempts'] == 2
    resumed = int(job.logs().split('resuming after epoch ')[1].split()[0])
    assert resumed >= done_before


def test_cluster_stop_records_its_jobs_and_requeue_runs_them_again(
        home, data_dir, capsys):
    assert main(START) == 0
    running = long_job(data_dir, 'running')
    queued = long_job(data_dir, 'queued')  # one CPU slot: it waits
    wait_until(lambda: running.status()['state'] == 'running', 120, 'start')
    assert main(['cluster', 'stop']) == 0
    out = capsys.readouterr().out
    assert f'job {running.id}: cancelled' in out
    assert f'job {queued.id}: cancelled' in out
    for job in (running, queued):
        status = job.status()
        assert status['state'] == 'cancelled'
        assert status['error'].startswith('the cluster was stopped')
    # --requeue: left queued, and the next start runs them
    assert main(START) == 0
    assert main(['requeue', queued.id]) == 0
    wait_until(lambda: queued.status()['state'] == 'running', 120, 'rerun')
    assert main(['cluster', 'stop', '--requeue']) == 0
    assert f'job {queued.id}: queued' in capsys.readouterr().out
    assert main(START) == 0
    assert f'requeued job {queued.id}' in capsys.readouterr().out
    assert queued.result(timeout=240)['final']['epoch'] == EPOCHS
    # a job that still runs on its scheduler is not requeued twice
    assert main(['requeue', queued.id]) == 1
    assert 'finished; nothing to requeue' in capsys.readouterr().err


def _write_job(folder, job_json, status=None):
    folder.mkdir(parents=True)
    (folder / 'job.json').write_text(job_json)
    (folder / 'status.json').write_text(json.dumps(status or {
        'state': 'finished', 'attempts': 1, 'gpus': [], 'worker': None,
        'started': 1.0, 'ended': 2.0, 'error': None}))


@pytest.mark.parametrize('policy', ['cancel', 'requeue'])
def test_a_stop_leaves_jobs_that_ended_or_went_meanwhile_as_they_are(
        tmp_path, policy):
    from dasktrain.jobs.scheduler.recovery import settle
    spec = json.dumps({'id': 'x', 'user': 'ann', 'scheduler': 'tcp://s'})
    running = {'state': 'running', 'attempts': 1, 'gpus': [],
               'worker': 'tcp://w', 'started': 1.0, 'ended': None,
               'error': None}
    jobs = {}
    for name, status in (('on', running), ('ended', running),
                         ('purged', running)):
        _write_job(tmp_path / name, spec, status)
        jobs[name] = Job(name, tmp_path / name)
    # listed live by the stop, then: one finishes, one is purged
    _write_job(tmp_path / 'ended2', spec)
    os.replace(tmp_path / 'ended2' / 'status.json',
               tmp_path / 'ended' / 'status.json')
    for f in (tmp_path / 'purged').iterdir():
        f.unlink()
    (tmp_path / 'purged').rmdir()
    told = settle(list(jobs.values()), policy)
    assert told == {'on': 'cancelled' if policy == 'cancel' else 'queued',
                    'ended': 'finished'}
    assert jobs['ended'].recorded()['ended'] == 2.0  # its own end kept
    assert not (tmp_path / 'purged').exists()  # nothing written back


def test_damaged_job_files_are_one_row_and_everything_else_stays_up(
        home, capsys):
    jobs = home / 'jobs'
    good = {'version': 1, 'id': 'good', 'name': 'good', 'user': 'me',
            'gpus': 0,
            'workers': None, 'config': {'epochs': 1}, 'scheduler': None,
            'submitted': 100.0}
    _write_job(jobs / 'good', json.dumps(good))
    (jobs / 'good' / 'out').mkdir()
    (jobs / 'good' / 'out' / 'log').write_text(json.dumps([
        {'epoch': 1, 'iteration': 4, 'elapsed_time': 3.0,
         'validation/main/accuracy': 0.25}]))
    _write_job(jobs / 'truncated', '{"id": "trunc')
    _write_job(jobs / 'yesterday', json.dumps(dict(good, id='yesterday',
                                                   submitted='yesterday')))
    assert main(START) == 0
    base = read_state()['dashboard'].rsplit('/', 1)[0]
    api = json.loads(urllib.request.urlopen(
        base + '/dasktrain/api/jobs', timeout=10).read())['jobs']
    states = {j['id']: (j['state'], j['error']) for j in api}
    assert states['good'] == ('finished', None)
    assert states['truncated'][0] == 'unreadable'
    assert 'job.json is not valid JSON' in states['truncated'][1]
    assert states['yesterday'] == (
        'unreadable', "job yesterday: job.json has submitted='yesterday', "
        'not a time in seconds')
    metrics = urllib.request.urlopen(base + '/metrics', timeout=10).read()
    assert b'dasktrain_jobs{state="finished"} 1.0' in metrics
    assert b'dasktrain_jobs{state="unreadable"} 2.0' in metrics
    capsys.readouterr()
    assert main(['jobs', '--all']) == 0  # their times: 1970's
    out = capsys.readouterr().out
    assert 'good' in out and out.count('unreadable: job ') == 2
    assert main(['result', 'good']) == 0
    assert 'validation/main/accuracy: 0.25' in capsys.readouterr().out


def test_result_of_a_job_whose_log_is_gone_is_one_line(home, capsys):
    spec = {'version': 1, 'id': 'nolog', 'name': 'nolog', 'user': 'me',
            'gpus': 0,
            'workers': None, 'config': {'epochs': 1}, 'scheduler': None,
            'submitted': 100.0}
    _write_job(home / 'jobs' / 'nolog', json.dumps(spec))
    assert main(['result', 'nolog']) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'its log' in err[0] and \
        'missing or damaged' in err[0]
    assert Job.find('nolog').status()['state'] == 'finished'
    # a log whose accuracy is no number: shown as it is, listed as none
    out = home / 'jobs' / 'nolog' / 'out'
    out.mkdir()
    (out / 'log').write_text(json.dumps([
        {'epoch': 1, 'elapsed_time': 1.0,
         'validation/main/accuracy': 'high'}]))
    assert main(['result', 'nolog']) == 0
    assert 'validation/main/accuracy: high' in capsys.readouterr().out
    assert main(['jobs', '--all']) == 0  # their times: 1970's
    row, = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith('nolog')]
    assert row.split()[5:7] == ['1/1', '-']  # PROGRESS, ACCURACY


def _ours(home):
    """Processes whose command line names ``home`` (its scheduler's and
    worker's)."""
    import psutil
    found = []
    for p in psutil.process_iter(['cmdline']):
        if any(str(home) in part for part in p.info['cmdline'] or ()):
            found.append(p)
    return found


def test_one_cluster_start_at_a_time_and_a_stopped_start_leaves_nothing(
        home, capsys):
    import sys

    from children import child
    lock = home / 'start.lock'
    argv = [sys.executable, '-m', 'dasktrain.cli', *START]
    with child(argv) as first:
        wait_until(lambda: lock.exists() and 'pid' in lock.read_text(), 60,
                   'the first start to take the lock')
        assert main(START) == 1
        err = capsys.readouterr().err
        assert err.count('\n') == 1 and \
            'another `dasktrain cluster start` (pid ' in err
        assert first.wait(120) == 0, first.stderr()
    assert read_state() is not None
    assert main(['cluster', 'stop']) == 0
    # SIGTERM once the scheduler is spawned: the start ends what it began
    wait_until(lambda: not _ours(home), 30, 'the stopped cluster to end')
    log = home / 'logs' / 'scheduler.log'
    log.unlink()
    with child(argv) as second:
        wait_until(log.exists, 60, 'the scheduler to be spawned')
        second.signal(signal.SIGTERM)
        assert second.wait(60) == 130
        assert 'interrupted' in second.stderr()
    wait_until(lambda: not _ours(home), 30, 'its processes to end')
    assert read_state() is None or not _ours(home)
