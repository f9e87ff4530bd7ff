"""ChainerUI, in the environment of its own that `make chainerui-env`
builds, serves a real run's log (`make chainerui`: register, then serve on
127.0.0.1)."""
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

from dasktrain.config import TrainConfig
from dasktrain.run.train import train

ROOT = Path(__file__).resolve().parents[2]
CHAINERUI = ROOT / '.venv-chainerui' / 'bin' / 'chainerui'

pytestmark = pytest.mark.skipif(
    not CHAINERUI.exists() or shutil.which('make') is None,
    reason='`make chainerui-env` builds ChainerUI\'s environment (from PyPI)')


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def test_make_chainerui_serves_the_log_of_a_run(make_cifar_dir, tmp_path):
    summary = train(TrainConfig(
        model='tiny', epochs=2, batch_size=25, devices=('@numpy',), lr=0.01,
        data_dir=str(make_cifar_dir(100, 100, 3)), progress=False,
        out=str(tmp_path / 'runs' / 'tiny')))
    port = free_port()
    # ChainerUI keeps its database in ~/.chainerui: a HOME of the test's.
    env = {k: v for k, v in os.environ.items() if not k.startswith('MAKE')}
    env['HOME'] = str(tmp_path / 'home')
    server = subprocess.Popen(
        ['make', '-s', 'chainerui', f'RUNS={tmp_path / "runs"}',
         f'CHAINERUI_PORT={port}'], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        api = f'http://127.0.0.1:{port}/api/v1'
        deadline = time.monotonic() + 120
        while True:
            try:
                projects = requests.get(f'{api}/projects', timeout=5).json()
                break
            except requests.ConnectionError:
                assert server.poll() is None, server.stdout.read().decode()
                assert time.monotonic() < deadline, 'ChainerUI did not start'
                time.sleep(0.5)
        project, = projects['projects']
        assert project['pathName'] == str(tmp_path / 'runs')
        results = requests.get(f"{api}/projects/{project['id']}/results",
                               timeout=30).json()['results']
        result, = results
        assert result['pathName'] == str(tmp_path / 'runs' / 'tiny')
        rows = [log['logDict'] for log in result['logs']]
        assert [r['epoch'] for r in rows] == [1, 2]
        assert [r['validation/main/accuracy'] for r in rows] == [
            r['validation/main/accuracy'] for r in summary['log']]
        assert {a['key']: a['value'] for a in result['args']}['model'] == \
            'tiny'  # OUT/args
        page = requests.get(f'http://127.0.0.1:{port}/', timeout=30)
        assert '<title>ChainerUI</title>' in page.text
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
