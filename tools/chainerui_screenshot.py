"""docs/figures/chainerui_steering.png: ChainerUI acting on a dasktrain run.

A small run (the `tiny` network on a synthetic CIFAR-format set, as the
tests make it) waits after its third epoch while ChainerUI's server, started
by `make chainerui`, takes three commands through its HTTP API, as its
buttons send them: the learning rate down now, a snapshot within epoch 5, a
stop once 6 epochs are done. The run goes on, acts on each, and headless
Chromium shows ChainerUI's page of the run.

    .venv/bin/python tools/chainerui_screenshot.py [PNG]

Needs `make chainerui-env` and chromium on PATH.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tests'))

from cifar_fixture import make_batches, write_archive  # noqa: E402

from dasktrain.config import TrainConfig  # noqa: E402
from dasktrain.data import extract_archive  # noqa: E402
from dasktrain.run.train import train  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


# In the page: the Args card (every TrainConfig field) hidden, so that
# the summary, the commands and the snapshots fit in one picture.
HIDE_ARGS = """
for (const card of document.querySelectorAll('.card')) {
  const head = card.querySelector('.card-header');
  if (head && head.textContent.trim() === 'Args') card.style.display = 'none';
}
document.body.scrollHeight
"""


def shoot(browser, page, png, profile, width=1400):
    """A PNG of ``page`` in headless ``browser``, driven through the
    DevTools protocol (a websocket: tornado's, which Dask brings)."""
    import base64
    import json

    from tornado.ioloop import IOLoop
    from tornado.websocket import websocket_connect
    port = free_port()
    chrome = subprocess.Popen(
        [browser, '--headless', '--no-sandbox', '--disable-gpu',
         '--hide-scrollbars', f'--remote-debugging-port={port}',
         '--remote-debugging-address=127.0.0.1', f'--user-data-dir={profile}',
         f'--window-size={width},900', 'about:blank'],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        while True:
            try:
                tabs = requests.get(f'http://127.0.0.1:{port}/json',
                                    timeout=5).json()
                target = next(t for t in tabs if t['type'] == 'page')
                break
            except (requests.ConnectionError, StopIteration):
                time.sleep(0.2)

        async def drive():
            ws = await websocket_connect(target['webSocketDebuggerUrl'],
                                         max_message_size=1 << 28)
            ids = iter(range(1, 1000))

            async def call(method, **params):
                sent = next(ids)
                ws.write_message(json.dumps({'id': sent, 'method': method,
                                             'params': params}))
                while True:
                    answer = json.loads(await ws.read_message())
                    if answer.get('id') == sent:
                        return answer['result']
            await call('Page.navigate', url=page)
            time.sleep(8)  # the page's fetches and charts
            height = (await call('Runtime.evaluate', expression=HIDE_ARGS,
                                 returnByValue=True))['result']['value']
            await call('Emulation.setDeviceMetricsOverride', width=width,
                       height=height, deviceScaleFactor=1, mobile=False)
            time.sleep(1)
            shot = await call('Page.captureScreenshot', format='png')
            ws.close()
            return base64.b64decode(shot['data'])
        Path(png).write_bytes(IOLoop.current().run_sync(drive))
    finally:
        os.killpg(chrome.pid, signal.SIGTERM)
        chrome.wait(30)


def main(png):
    browser = next(filter(None, map(shutil.which, (
        'chromium', 'chromium-browser', 'google-chrome'))), None)
    if browser is None:
        sys.exit('no chromium on PATH: apt-get install chromium')
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / 'data'
        data.mkdir()
        write_archive(data / 'a.tar.gz', make_batches(
            n_train=(200,) * 5, n_test=200, seed=3))
        extract_archive(data / 'a.tar.gz', data)
        runs, out = tmp / 'runs', tmp / 'runs' / 'tiny-momentum'
        reached, go = threading.Event(), threading.Event()

        def hold(row):
            if row['epoch'] == 3:
                reached.set()
                go.wait(300)
        runner = threading.Thread(target=train, daemon=True, args=(
            TrainConfig(model='tiny', epochs=10, batch_size=50, lr=0.05,
                        optimizer='momentum-sgd', devices=('@numpy',),
                        data_dir=str(data), out=str(out), progress=False),),
            kwargs={'callbacks': [hold]})
        runner.start()
        reached.wait(600)
        port = free_port()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith('MAKE')}
        env['HOME'] = str(tmp / 'home')
        server = subprocess.Popen(
            ['make', '-s', 'chainerui', f'RUNS={runs}',
             f'CHAINERUI_PORT={port}'], cwd=ROOT, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        try:
            api = f'http://127.0.0.1:{port}/api/v1'
            while True:
                try:
                    project, = requests.get(f'{api}/projects',
                                            timeout=5).json()['projects']
                    break
                except requests.ConnectionError:
                    time.sleep(0.5)
            results = f"{api}/projects/{project['id']}/results"
            result, = requests.get(results, timeout=30).json()['results']
            url = f"{results}/{result['id']}"
            for command in (
                    {'name': 'adjust_hyperparams',
                     'body': {'optimizer': 'MomentumSGD',
                              'hyperparam': {'lr': 0.01, 'momentum': None}}},
                    {'name': 'take_snapshot',
                     'schedule': {'key': 'iteration', 'value': 90}},
                    {'name': 'stop',
                     'schedule': {'key': 'epoch', 'value': 6}}):
                requests.post(f'{url}/commands', json=command,
                              timeout=30).raise_for_status()
            go.set()
            runner.join(600)
            time.sleep(5)  # ChainerUI crawls a run every 4 s at most
            requests.get(url, timeout=30)
            page = (f"http://127.0.0.1:{port}/projects/{project['id']}"
                    f"/results/{result['id']}")
            shoot(browser, page, png, tmp / 'profile')
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
    print(png)


if __name__ == '__main__':
    main(os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                         ROOT / 'docs' / 'figures' / 'chainerui_steering.png'))
