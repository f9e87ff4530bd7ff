"""ChainerUI, in the environment of its own that `make chainerui-env`
builds (the first test here builds it, or skips saying why), serves a real
run's log (`make chainerui`: register, then serve on 127.0.0.1), and
steers a running run through its HTTP API, as its buttons do."""
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from dasktrain.config import TrainConfig
from dasktrain.run.train import train

ROOT = Path(__file__).resolve().parents[2]
CHAINERUI = ROOT / '.venv-chainerui' / 'bin' / 'chainerui'


@pytest.fixture(scope='session')
def chainerui_env():
    """ChainerUI's environment: built by `make chainerui-env` (from PyPI)
    where it is not yet; the test skips, with the build's last line, where
    that cannot be done here."""
    if shutil.which('make') is None:
        pytest.skip('no make to build ChainerUI\'s environment with')
    if not CHAINERUI.exists():
        env = {k: v for k, v in os.environ.items() if not k.startswith('MAKE')}
        try:
            built = subprocess.run(['make', '-s', 'chainerui-env'], cwd=ROOT,
                                   env=env, capture_output=True, text=True,
                                   timeout=900)
        except subprocess.TimeoutExpired:
            pytest.skip('`make chainerui-env` took over 15 minutes')
        if built.returncode != 0 or not CHAINERUI.exists():
            last = (built.stderr or built.stdout).strip().splitlines()
            pytest.skip('`make chainerui-env` could not build ChainerUI\'s '
                        f"environment: {last[-1] if last else '?'}")
    return CHAINERUI.parent.parent


@pytest.fixture
def chainerui_importable(chainerui_env, monkeypatch, tmp_path):
    """ChainerUI's package importable here (its extensions need Chainer
    only; its server's libraries stay in its own environment): a folder
    holding a link to it, on sys.path and PYTHONPATH (for children)."""
    package = next(chainerui_env.glob('lib/python*/site-packages/chainerui'))
    path = tmp_path / 'chainerui-path'
    path.mkdir()
    (path / 'chainerui').symlink_to(package)
    monkeypatch.syspath_prepend(str(path))
    monkeypatch.setenv('PYTHONPATH', os.pathsep.join(
        p for p in (str(path), os.environ.get('PYTHONPATH')) if p))
    return path


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(runs, home):
    """`make chainerui RUNS=runs` on a free port, ChainerUI's database in
    ``home``; yields its API's base URL and a requests session that
    carries the server's token (printed on its owner's terminal: the
    gate answers no one without it), once it answers. Stopped (its
    process group) on leaving."""
    port = free_port()
    # ChainerUI keeps its database in ~/.chainerui: a HOME of the test's.
    env = {k: v for k, v in os.environ.items() if not k.startswith('MAKE')}
    env['HOME'] = str(home)
    server = subprocess.Popen(
        ['make', '-s', 'chainerui', f'RUNS={runs}',
         f'CHAINERUI_PORT={port}'], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        printed = []  # make's lines, then the address to open
        threading.Thread(target=lambda: printed.extend(
            line.decode(errors='replace') for line in server.stdout),
            daemon=True).start()
        deadline = time.monotonic() + 120
        while not any('?token=' in line for line in printed):
            assert not any('Running on' in line for line in printed), \
                f'no token printed: {printed}'
            assert server.poll() is None, ''.join(printed)
            assert time.monotonic() < deadline, 'ChainerUI did not start'
            time.sleep(0.1)
        token = next(line for line in printed if '?token=' in line).split(
            '?token=')[1].strip()
        session = requests.Session()
        session.headers['Authorization'] = f'token {token}'
        api = f'http://127.0.0.1:{port}/api/v1'
        deadline = time.monotonic() + 120
        while True:
            try:
                session.get(f'{api}/projects', timeout=5).json()
                break
            except requests.ConnectionError:
                assert server.poll() is None, ''.join(printed)
                assert time.monotonic() < deadline, 'ChainerUI did not start'
                time.sleep(0.5)
        yield api, session
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


def test_make_chainerui_serves_the_log_of_a_run(make_cifar_dir, tmp_path,
                                                chainerui_env):
    summary = train(TrainConfig(
        model='tiny', epochs=2, batch_size=25, devices=('@numpy',), lr=0.01,
        data_dir=str(make_cifar_dir(100, 100, 3)), progress=False,
        out=str(tmp_path / 'runs' / 'tiny')))
    with serving(tmp_path / 'runs', tmp_path / 'home') as (api, http):
        projects = http.get(f'{api}/projects', timeout=30).json()
        project, = projects['projects']
        assert project['pathName'] == str(tmp_path / 'runs')
        results = http.get(f"{api}/projects/{project['id']}/results",
                               timeout=30).json()['results']
        result, = results
        assert result['pathName'] == str(tmp_path / 'runs' / 'tiny')
        rows = [log['logDict'] for log in result['logs']]
        assert [r['epoch'] for r in rows] == [1, 2]
        assert [r['validation/main/accuracy'] for r in rows] == [
            r['validation/main/accuracy'] for r in summary['log']]
        assert {a['key']: a['value'] for a in result['args']}['model'] == \
            'tiny'  # OUT/args
        page = http.get(api.replace('/api/v1', '/'), timeout=30)
        assert '<title>ChainerUI</title>' in page.text


def test_chainerui_steers_a_running_run_through_its_http_api(
        make_cifar_dir, tmp_path, chainerui_env):
    """What ChainerUI's buttons send (its own form's bodies), through its
    server, acts on a real run at the iterations asked; the server shows
    the answers, the lr it drew, and the snapshot."""
    runs = tmp_path / 'runs'
    out = runs / 'steered'
    reached, go = threading.Event(), threading.Event()

    def hold(row):  # epoch 1's end waits while ChainerUI sends commands
        if row['epoch'] == 1:
            reached.set()
            assert go.wait(300)
    done = {}
    runner = threading.Thread(target=lambda: done.update(train(TrainConfig(
        model='tiny', epochs=6, batch_size=25, devices=('@numpy',),
        lr=0.01, optimizer='momentum-sgd', progress=False,
        data_dir=str(make_cifar_dir(100, 100, 3)), out=str(out)),
        callbacks=[hold])), daemon=True)
    runner.start()
    try:
        assert reached.wait(120)
        with serving(runs, tmp_path / 'home') as (api, http):
            project, = http.get(f'{api}/projects',
                                    timeout=30).json()['projects']
            results = f"{api}/projects/{project['id']}/results"
            result, = http.get(results, timeout=30).json()['results']
            url = f"{results}/{result['id']}"
            for command in (
                    {'name': 'adjust_hyperparams',
                     'body': {'optimizer': 'MomentumSGD',
                              'hyperparam': {'lr': 0.02, 'momentum': None}}},
                    {'name': 'take_snapshot', 'body': None,
                     'schedule': {'key': 'iteration', 'value': 30}},
                    {'name': 'stop', 'body': None,
                     'schedule': {'key': 'epoch', 'value': 3}}):
                sent = http.post(f'{url}/commands', json=command,
                                     timeout=30)
                assert sent.status_code == 200, sent.text
            go.set()
            runner.join(300)
            assert not runner.is_alive()
            deadline = time.monotonic() + 60
            while True:  # ChainerUI crawls a result every 4 s at most
                result = http.get(url, timeout=30).json()['result']
                if all(c['response'] for c in result['commands']) and \
                        len(result['logs']) == 3:
                    break
                assert time.monotonic() < deadline, result['commands']
                time.sleep(1)
            answered = {c['name']: c['response'] for c in result['commands']}
            assert {name: (r['status'], r['epoch'], r['iteration'])
                    for name, r in answered.items()} == {
                'adjust_hyperparams': ('SUCCESS', 1, 20),
                'take_snapshot': ('SUCCESS', 1, 30),
                'stop': ('SUCCESS', 3, 60)}
            assert answered['adjust_hyperparams']['body']['hyperparam'] == \
                {'lr': 0.02, 'momentum': 0.9}  # its form's "last value"
            assert [log['logDict']['lr'] for log in result['logs']] == \
                [0.01, 0.02, 0.02]
            assert [s['name'] for s in result['snapshots']] == \
                ['snapshot_iter_30']
            # A stopped run takes no more: ChainerUI says so itself.
            refused = http.post(f'{url}/commands',
                                    json={'name': 'take_snapshot'},
                                    timeout=30)
            assert refused.status_code == 400
            assert 'already stopped' in refused.json()['message']
    finally:
        go.set()
        runner.join(120)
    assert done['stopped_by_request']['iteration'] == 60


# ------------------------------------------- ChainerUI's own extension

def test_chainerui_commands_extension_on_a_distributed_updater(
        chainerui_importable, tmp_path):
    """A Trainer script on replicas (DistributedUpdater, ipm) with
    ChainerUI's own CommandsExtension, unchanged: the lr reaches every
    replica's optimizer, the stop ends it at its iteration."""
    import chainer
    import chainer.links as L
    from chainer import training
    from chainerui.extensions import CommandsExtension

    from dasktrain import DistributedUpdater
    from dasktrain.training.commandfile import request
    np = pytest.importorskip('numpy')
    rng = np.random.RandomState(0)
    x = rng.randn(64, 8).astype(np.float32)
    data = chainer.datasets.TupleDataset(x, (x[:, 0] > 0).astype(np.int32))
    model = L.Classifier(L.Linear(8, 2))
    optimizer = chainer.optimizers.MomentumSGD(lr=0.1)
    optimizer.setup(model)
    updater = DistributedUpdater(
        chainer.iterators.SerialIterator(data, 16), optimizer,
        devices='cpu:2', mode='ipm', mix_every=2)
    trainer = training.Trainer(updater, (100, 'epoch'), out=str(tmp_path))
    trainer.extend(CommandsExtension())
    seen = []

    @training.make_extension(trigger=(1, 'iteration'), priority=0)
    def send_and_watch(trainer):  # what ChainerUI's server would write
        if trainer.updater.iteration == 2:
            request(tmp_path, 'adjust_hyperparams',
                    {'optimizer': 'MomentumSGD',
                     'hyperparam': {'lr': 0.01, 'momentum': None}},
                    {'key': 'iteration', 'value': 5})
            request(tmp_path, 'stop', None, {'key': 'iteration', 'value': 9})
        seen.append([o.hyperparam.lr for o in updater.model.optimizers])
    trainer.extend(send_and_watch)
    trainer.run()
    assert updater.iteration == 9
    # the extension sets the master's; every replica's follows at the
    # next update
    assert seen[4] == [0.01, 0.1] and seen[5] == [0.01, 0.01]
    got = json.loads((tmp_path / 'commands').read_text())
    assert [(c['name'], c['response']['status'], c['response']['iteration'])
            for c in got] == [('adjust_hyperparams', 'SUCCESS', 5),
                              ('stop', 'SUCCESS', 9)]


RANKS_SCRIPT = '''
"""Two ranks of a ChainerMN script steered by ChainerUI's extension."""
import json, os, sys, time
import chainer, chainer.links as L, numpy as np
from chainer import training
from chainerui.extensions import CommandsExtension
import dasktrain.chainermn as chainermn
from dasktrain.training import across_ranks

out = sys.argv[1]
comm = chainermn.create_communicator('naive')
rng = np.random.RandomState(0)
x = rng.randn(256, 8).astype(np.float32)
data = chainer.datasets.TupleDataset(x, (x[:, 0] > 0).astype(np.int32))
data = chainermn.scatter_dataset(data if comm.rank == 0 else None, comm)
model = L.Classifier(L.Linear(8, 2))
optimizer = chainermn.create_multi_node_optimizer(
    chainer.optimizers.MomentumSGD(lr=0.05), comm)
optimizer.setup(model)
updater = training.StandardUpdater(
    chainer.iterators.SerialIterator(data, 8), optimizer)
trainer = training.Trainer(updater, (1000, 'epoch'), out=out)
trainer.extend(across_ranks(CommandsExtension(), comm))
seen = []

@training.make_extension(trigger=(1, 'iteration'),
                         priority=training.PRIORITY_WRITER)
def gate(trainer):  # the test sends its commands while rank 0 waits here
    if trainer.updater.iteration == 1:
        while comm.rank == 0 and not os.path.exists(os.path.join(out, 'go')):
            time.sleep(0.05)
        comm.bcast_obj(None)

@training.make_extension(trigger=(1, 'iteration'), priority=0)
def watch(trainer):
    seen.append([trainer.updater.iteration, optimizer.lr])

trainer.extend(gate)
trainer.extend(watch)
trainer.run()
with open(os.path.join(out, f'seen{comm.rank}.json'), 'w') as f:
    json.dump(seen, f)
'''


def test_chainerui_commands_extension_across_the_ranks_of_a_launch(
        chainerui_importable, tmp_path):
    """ChainerUI's extension, wrapped by across_ranks, in a ChainerMN
    script under `dasktrain launch -n 2`: both ranks change the lr and stop
    at the iterations asked (ChainerUI's own receiver would not even see
    the optimizer inside ChainerMN's wrapper)."""
    from children import child

    from dasktrain.training.commandfile import request, run_status
    script = tmp_path / 'steered.py'
    script.write_text(RANKS_SCRIPT)
    out = tmp_path / 'result'
    out.mkdir()
    argv = [sys.executable, '-m', 'dasktrain.cli', 'launch', '-n', '2',
            '--out', str(tmp_path / 'ranks'), '--', sys.executable,
            str(script), str(out)]
    with child(argv, cwd=tmp_path) as proc:
        deadline = time.monotonic() + 120
        while run_status(out) != 'running':
            assert proc.proc.poll() is None, proc.stderr()
            assert time.monotonic() < deadline, 'the ranks did not start'
            time.sleep(0.1)
        request(out, 'adjust_hyperparams',
                {'optimizer': 'MomentumSGD',
                 'hyperparam': {'lr': 0.01, 'momentum': None}},
                {'key': 'iteration', 'value': 5})
        request(out, 'stop', None, {'key': 'iteration', 'value': 9})
        request(out, 'take_snapshot', None, {'key': 'iteration', 'value': 7})
        (out / 'go').touch()
        assert proc.wait(120) == 0, proc.stderr()
    for rank in (0, 1):
        seen = json.loads((out / f'seen{rank}.json').read_text())
        assert seen == [[i, 0.05 if i < 5 else 0.01] for i in range(1, 10)]
    got = json.loads((out / 'commands').read_text())
    assert [(c['name'], c['response']['status'], c['response']['iteration'])
            for c in got] == [('adjust_hyperparams', 'SUCCESS', 5),
                              ('stop', 'SUCCESS', 9),
                              ('take_snapshot', 'SUCCESS', 7)]
    assert got[0]['response']['body']['optimizer'] == 'MomentumSGD'
    assert (out / 'snapshot_iter_7').is_file()
    assert run_status(out) == 'stopped'
