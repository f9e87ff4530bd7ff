"""Told when a job ends (`--notify URL`): the target checked first (one
line naming the flag), Slack-compatible JSON POSTed to a real HTTP server
on 127.0.0.1, a 500 retried, a webhook that never answers given up on
without touching the job's end, and the end of a real command job on a
real local cluster."""
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from distributed import Client
from test_cluster import Processes, wait_until

from dasktrain import notify
from dasktrain.cli import main
from dasktrain.cluster.settings import environment, settings
from dasktrain.errors import UserError
from dasktrain.files import write_json
from dasktrain.jobs.client.submit import submit_command
from dasktrain.jobs.end_notice import message, target
from dasktrain.jobs.job import current_user, update_status
from dasktrain.notify import check_target, send, wait_pending


class Hook:
    """A webhook on 127.0.0.1: answers each POST with the next of
    ``codes`` (the last one thereafter), or never (``hang``)."""

    def __init__(self, codes=(200,), hang=False):
        self.codes, self.hang = list(codes), hang
        self.posts, self.released = [], threading.Event()
        self.posters = []  # the uid of each POST's process, where known
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers['Content-Length']))
                hook.posters.append(poster(self.client_address))
                hook.posts.append((self.headers['Content-Type'],
                                   json.loads(body)))
                if hook.hang:
                    hook.released.wait(30)
                    return
                code = hook.codes.pop(0) if len(hook.codes) > 1 \
                    else hook.codes[0]
                self.send_response(code)
                self.send_header('Content-Length', '2')
                self.end_headers()
                self.wfile.write(b'ok')

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.server.daemon_threads = True
        self.url = f'http://127.0.0.1:{self.server.server_port}/hooks/T0/s3'
        threading.Thread(target=self.server.serve_forever,
                         daemon=True).start()

    def close(self):
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


def poster(address):
    """The uid of the process at the other end of a connection to a
    server here from ``address`` (psutil: all of them as root), or None."""
    import psutil
    try:
        for c in psutil.net_connections('tcp'):
            if c.laddr and tuple(c.laddr)[:2] == tuple(address)[:2] and \
                    c.pid:
                return psutil.Process(c.pid).uids().real
    except (psutil.Error, OSError):
        pass
    return None


@pytest.fixture
def hook():
    hooks = []

    def make(*args, **kwargs):
        hooks.append(Hook(*args, **kwargs))
        return hooks[-1]
    yield make
    for h in hooks:
        h.close()


def test_targets_are_checked_in_one_line_naming_the_argument():
    assert check_target(None) is None
    assert check_target('https://hooks.slack.com/x') == \
        'https://hooks.slack.com/x'
    for bad in ('hooks.slack.com/x', 'ftp://h/x', 'http://', 3):
        with pytest.raises(UserError, match='^notify '):
            check_target(bad)
    with pytest.raises(UserError, match='mailto:'):
        check_target('mailto:not an address')
    with pytest.raises(UserError, match='^busy_mib must be MiB >= 0'):
        settings(busy_mib=-1)
    assert environment({'DASKTRAIN_BUSY_MIB': '9'},
                       settings('http://h/x')) == \
        {'DASKTRAIN_NOTIFY': 'http://h/x'}


def test_the_message_says_job_user_state_time_and_result():
    spec = {'id': 'j-1', 'name': 'resnet', 'user': 'ann'}
    text = message(spec, {'state': 'finished', 'started': 100.0,
                          'ended': 100.0 + 3 * 3600 + 61},
                   [{'epoch': 30, 'validation/main/accuracy': 0.93456}])
    assert text == ('job j-1 (resnet) of ann finished after 3 h 01 min: '
                    'epoch 30, test accuracy 0.9346')
    # a stop command's end says so, as the jobs table and page do
    assert message(spec, {'state': 'finished', 'started': 100.0,
                          'ended': 160.0, 'ending': 'stopped by request'},
                   [{'epoch': 3, 'validation/main/accuracy': 0.5}]) == (
        'job j-1 (resnet) of ann finished (stopped by request) after 1 min: '
        'epoch 3, test accuracy 0.5000')
    program = dict(spec, kind='program')
    assert message(program, {'state': 'failed', 'started': 0, 'ended': 5,
                             'exit_code': -9, 'error': 'killed by SIGKILL'}
                   ).endswith('failed after 5 s: killed by SIGKILL')
    assert message(program, {'state': 'lost', 'started': 0, 'ended': 120,
                             'error': 'its worker died'}) == \
        'job j-1 (resnet) of ann lost after 2 min: its worker died'
    # the job's own target, else the cluster's (its processes' env, or
    # the recorded cluster it was queued on)
    assert target({'notify': 'http://a/x'}, env={'DASKTRAIN_NOTIFY':
                                                'http://b/y'}) == 'http://a/x'
    assert target({}, env={'DASKTRAIN_NOTIFY': 'http://b/y'}) == 'http://b/y'
    assert target({'scheduler': 's'}, env={}, state={}) is None


def test_a_webhook_gets_json_and_a_500_is_retried(hook):
    h = hook(codes=(500, 200))
    assert send(h.url, 'hello', backoff=0.05)
    assert [p[1] for p in h.posts] == [{'text': 'hello'}] * 2
    assert h.posts[0][0] == 'application/json'
    refused = hook(codes=(404,))
    assert not send(refused.url, 'x', backoff=0.05)  # no use retrying
    assert len(refused.posts) == 1


def test_a_webhook_that_never_answers_is_given_up_in_bounded_time(hook,
                                                                   caplog):
    h = hook(hang=True)
    start = time.monotonic()
    assert not send(h.url, 'x', attempts=2, timeout=0.5, backoff=0.05)
    assert time.monotonic() - start < 5
    assert len(h.posts) == 2
    assert 'failed 2 times' in caplog.text
    assert '/hooks' not in caplog.text  # the URL's secret is not logged


def test_an_end_is_told_once_without_waiting_for_the_webhook(
        tmp_path, hook, monkeypatch):
    monkeypatch.setattr(notify, 'ATTEMPTS', 1)
    monkeypatch.setattr(notify, 'TIMEOUT', 1.0)
    h, slow = hook(), hook(hang=True)
    for name, url in (('told', h.url), ('slow', slow.url)):
        folder = tmp_path / name
        folder.mkdir()
        write_json(folder / 'job.json', {
            'id': name, 'name': 'x', 'user': 'ann', 'notify': url,
            'kind': 'program', 'submitted': 0})
        write_json(folder / 'status.json', {'state': 'queued',
                                            'started': None})
        start = time.monotonic()
        update_status(folder, state='cancelled', ended=time.time())
        assert time.monotonic() - start < 1  # never waits for the POST
        update_status(folder, error='again')  # no second message
    wait_until(lambda: h.posts, 10, 'the POST')
    wait_pending(2)
    assert [p[1] for p in h.posts] == [
        {'text': 'job told (x) of ann cancelled before it started'}]
    assert (tmp_path / 'slow' / 'status.json').exists()


def test_cli_refuses_a_bad_target_before_connecting(capsys):
    assert main(['submit', '--notify', 'slack', '--scheduler',
                 'tcp://127.0.0.1:9', '--', 'true']) == 1
    err = capsys.readouterr().err.strip()
    assert '\n' not in err and 'error: --notify takes an http' in err
    assert main(['cluster', 'start', '--busy-mib', '-5']) == 1
    assert '--busy-mib must be MiB >= 0' in capsys.readouterr().err
    assert main(['cluster', 'start', '--notify', 'mailto:x y']) == 1
    assert '--notify mailto:x y' in capsys.readouterr().err


def test_a_command_jobs_end_is_posted_and_a_hung_hook_delays_nothing(
        tmp_path, hook):
    told, hung = hook(), hook(hang=True)
    procs = Processes(tmp_path)
    try:
        procs.worker(gpus=0, resources='CPU=2', nthreads=2)
        with Client(procs.address) as client:
            client.wait_for_workers(1)
            failed = submit_command(
                [sys.executable, '-c', 'raise SystemExit(3)'], gpus=0,
                client=client, path=tmp_path / 'j', notify=told.url)
            # --notify beside the queue's options: after the failed one
            fine = submit_command(
                [sys.executable, '-c', 'pass'], gpus=0, client=client,
                path=tmp_path / 'j', notify=hung.url, name='quiet',
                after=[failed.id], after_any=True, time='1m')
            assert fine.spec().notify == hung.url and \
                fine.spec().after == [failed.id] and \
                fine.spec().time == 60
            wait_until(lambda: told.posts, 120, 'the POST')
            text = told.posts[0][1]['text']
            assert text.startswith(f'job {failed.id} (python') and \
                f'of {current_user()} failed after' in text and \
                text.endswith(': exit code 3')
            # the hung webhook: the job ended all the same, and stays so
            wait_until(lambda: fine.status()['state'] == 'finished', 60,
                       'the job ends')
            wait_until(lambda: hung.posts, 30, 'the hung POST')
            assert fine.status()['state'] == 'finished'
            assert len(told.posts) == 1
    finally:
        procs.close()


def test_the_clusters_default_is_recorded_and_told(tmp_path, monkeypatch,
                                                   hook, capsys):
    from dasktrain.cluster.local import connect
    from dasktrain.jobs.scheduler.outside_use import cluster_use
    h = hook()
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path / 'home'))
    assert main(['cluster', 'start', '--port', '0', '--dashboard-port', '0',
                 '--gpus', '0', '--cpu-slots', '1', '--notify', h.url,
                 '--busy-mib', '1000']) == 0
    try:
        state = json.loads((tmp_path / 'home' / 'cluster.json').read_text())
        assert state['notify'] == h.url and state['busy_mib'] == 1000
        assert '/hooks' not in capsys.readouterr().out  # its secret
        with connect() as client:
            # the scheduler's planner reads the same threshold
            assert client.run_on_scheduler(cluster_use)['busy_mib'] == 1000
            job = submit_command([sys.executable, '-c', 'pass'],
                                 client=client, path=tmp_path / 'jobs')
        wait_until(lambda: h.posts, 120, 'the POST')
        assert h.posts[0][1]['text'].startswith(f'job {job.id} ')
        assert 'finished after' in h.posts[0][1]['text']
    finally:
        assert main(['cluster', 'stop']) == 0
