"""A real `dasktrain cluster start` (scheduler and worker preloading
dasktrain's) running real tiny CPU jobs: its /metrics parsed with
prometheus_client, the Grafana and Prometheus files checked against that
scrape, the jobs page loaded in a headless Chromium, `jobs --watch`."""
import getpass
import inspect
import json
import re
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml
from children import child
from prometheus_client.parser import text_string_to_metric_families
from test_cluster import job_config, wait_until

from dasktrain.cli import main
from dasktrain.cluster import connect, start_cluster, stop_cluster
from dasktrain.jobs.client.submit import submit
from dasktrain.jobs.worker.gpu_use import gpu_readings

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / 'docs' / 'grafana'
XSS = '<script>alert(1)</script>'
GPU_FAMILIES = ('dasktrain_gpu_utilization_ratio',
                'dasktrain_gpu_memory_used_bytes',
                'dasktrain_gpu_memory_total_bytes',
                'dasktrain_gpu_temperature_celsius',
                'dasktrain_gpu_power_watts')


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(200, 100, 5)


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
    """`cluster start` in a home of its own: no GPU (none visible to the
    worker, so every machine exports no GPU series), one CPU job at once."""
    home = tmp_path_factory.mktemp('home')
    with pytest.MonkeyPatch.context() as env:
        env.setenv('DASKTRAIN_HOME', str(home))
        env.setenv('CUDA_VISIBLE_DEVICES', '')
        state = start_cluster(port=0, dashboard_port=0, gpus=0)
        try:
            state['base'] = state['dashboard'].rsplit('/', 1)[0]
            state['home'] = home
            yield state
        finally:
            stop_cluster()


def scrape(base):
    """{sample name: [(labels, value)]} and the family names of /metrics."""
    text = urllib.request.urlopen(base + '/metrics', timeout=10).read()
    samples, families = defaultdict(list), set()
    for family in text_string_to_metric_families(text.decode()):
        families.add(family.name)
        for s in family.samples:
            samples[s.name].append((s.labels, s.value))
    return samples, families


def of_job(samples, name, job_id, **labels):
    return [v for have, v in samples[name]
            if have.get('job_id') == job_id and
            all(have.get(k) == w for k, w in labels.items())]


def submitted(config, name):
    with connect() as client:
        return submit(config, gpus=0, name=name, client=client)


def test_metrics_follow_a_training_job(cluster, data_dir):
    job = submitted(job_config(data_dir, epochs=4), 'metrics-run')
    labels = {'job_id': job.id, 'name': 'metrics-run',
              'user': getpass.getuser()}

    def expect(samples, row, previous):
        def one(name, **extra):
            values = [v for have, v in samples[name]
                      if have == dict(labels, **extra)]
            assert len(values) == 1, (name, samples[name])
            return values[0]
        assert one('dasktrain_job_epoch') == row['epoch']
        assert one('dasktrain_job_max_epochs') == 4
        assert one('dasktrain_job_iterations_total') == row['iteration']
        for split, prefix in (('train', ''), ('validation', 'validation/')):
            assert one('dasktrain_job_loss', split=split) == \
                pytest.approx(row[prefix + 'main/loss'], rel=1e-12)
            assert one('dasktrain_job_accuracy_ratio', split=split) == \
                pytest.approx(row[prefix + 'main/accuracy'], rel=1e-12)
        assert one('dasktrain_job_images_per_second') == \
            pytest.approx(row['images_per_sec'], rel=1e-12)
        epoch = row['elapsed_time'] - (previous['elapsed_time']
                                       if previous else 0.0)
        assert one('dasktrain_job_epoch_seconds') == \
            pytest.approx(epoch, rel=1e-9)
        assert one('dasktrain_job_data_wait_ratio') == \
            pytest.approx(row['data_wait_time'] / epoch, rel=1e-9)
        assert one('dasktrain_job_communication_ratio') == 0.0  # one replica
        assert one('dasktrain_job_gpus') == 0

    # While it trains: the epoch scraped is one of its log's, whole.
    running = {}

    def scraped_running():
        samples, _ = scrape(cluster['base'])
        if of_job(samples, 'dasktrain_job_state', job.id, state='running') \
                and of_job(samples, 'dasktrain_job_epoch', job.id) >= [1]:
            running['samples'] = samples
            return True
    wait_until(scraped_running, 120, 'a running epoch in /metrics')
    samples = running['samples']
    epoch = int(of_job(samples, 'dasktrain_job_epoch', job.id)[0])
    assert epoch < 4, 'the job ended before a scrape saw it running'
    rows = job.log_rows()
    expect(samples, rows[epoch - 1], rows[epoch - 2] if epoch > 1 else None)
    assert of_job(samples, 'dasktrain_jobs', None, state='running') == [1]

    job.result(timeout=180)
    wait_until(lambda: of_job(scrape(cluster['base'])[0],
                              'dasktrain_job_state', job.id,
                              state='finished'), 30, 'the end in /metrics')
    samples, families = scrape(cluster['base'])
    rows = job.log_rows()
    expect(samples, rows[-1], rows[-2])
    assert of_job(samples, 'dasktrain_job_end_timestamp_seconds', job.id) \
        == [pytest.approx(job.status()['ended'], rel=1e-12)]
    assert of_job(samples, 'dasktrain_jobs', None, state='finished') == [1]
    assert of_job(samples, 'dasktrain_jobs', None, state='pruned') == [0]


def test_workers_export_cpu_and_memory_and_no_gpu_series(cluster):
    samples, families = scrape(cluster['base'])
    with connect() as client:
        (worker,) = client.scheduler_info()['workers']
    memory = [v for have, v in samples['dasktrain_worker_memory_bytes']
              if have == {'worker': worker}]
    assert len(memory) == 1 and memory[0] > 10 * 2 ** 20  # a Python's RSS
    assert [labels for labels, _ in
            samples['dasktrain_worker_busy_cpu_cores']] == \
        [{'worker': worker}]
    assert samples['dasktrain_worker_gpus'] == [({'worker': worker}, 0.0)]
    # Declared for Grafana, but no series: the worker has no GPU to read.
    for name in GPU_FAMILIES:
        assert name in families and not samples[name], name
    assert gpu_readings(env={'CUDA_VISIBLE_DEVICES': ''}) == []
    logs = {log.name: log.read_text()
            for log in (cluster['home'] / 'logs').glob('*.log')}
    assert sorted(logs) == ['scheduler.log', 'worker.log']
    assert 'Run preload setup: dasktrain.jobs.scheduler.preload' in \
        logs['scheduler.log']
    assert 'Run preload setup: dasktrain.jobs.worker.preload' in \
        logs['worker.log']
    for text in logs.values():
        assert 'Traceback' not in text and ' - ERROR - ' not in text, text


def test_a_stray_event_on_the_jobs_topic_changes_nothing(cluster):
    before, _ = scrape(cluster['base'])
    with connect() as client:
        client.log_event('dasktrain-jobs', {'id': 'stray', 'state': 'x'})
        client.log_event('dasktrain-jobs', 'not a summary')
        wait_until(lambda: len(client.get_events('dasktrain-jobs')) >= 2,
                   10, 'the events')
    after, _ = scrape(cluster['base'])
    assert after['dasktrain_jobs'] == before['dasktrain_jobs']
    assert not of_job(after, 'dasktrain_job_state', 'stray')


def _names(expr):
    return set(re.findall(r'\b(?:dasktrain|dask)_[a-z0-9_]+\b', expr))


def _exprs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == 'expr':
                yield value
            else:
                yield from _exprs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _exprs(value)


def test_grafana_and_prometheus_files_query_scraped_metrics(cluster):
    samples, families = scrape(cluster['base'])
    scraped = families | set(samples)
    dashboard = json.loads((GRAFANA / 'dasktrain.json').read_text())
    exprs = list(_exprs(dashboard['panels']))
    assert len(exprs) >= 15
    for expr in exprs:
        assert _names(expr) and _names(expr) <= scraped, expr
    # every panel reads the data source picked at import
    assert dashboard['templating']['list'][0]['type'] == 'datasource'
    for panel in dashboard['panels']:
        if panel['type'] != 'row':
            assert panel['datasource']['uid'] == '${datasource}'

    config = yaml.safe_load((GRAFANA / 'prometheus.yml').read_text())
    (scrape_config,) = config['scrape_configs']
    assert scrape_config['metrics_path'] == '/metrics'
    port = inspect.signature(start_cluster).parameters['dashboard_port']
    assert scrape_config['static_configs'][0]['targets'] == \
        [f'127.0.0.1:{port.default}']
    assert config['rule_files'] == ['alerts.yml']

    rules = yaml.safe_load((GRAFANA / 'alerts.yml').read_text())
    (group,) = rules['groups']
    assert [r['alert'] for r in group['rules']] == [
        'DasktrainJobFailed', 'DasktrainGpuIdleWhileJobsQueue']
    for rule in group['rules']:
        assert _names(rule['expr']) <= scraped, rule['expr']
    promtool = shutil.which('promtool')
    if promtool:  # the rules' own unit tests, where Prometheus is installed
        subprocess.run([promtool, 'test', 'rules',
                        str(GRAFANA / 'alerts_test.yml')], check=True)


def test_jobs_page_routes_are_read_only_and_linked(cluster, capsys):
    base = cluster['base']
    assert main(['cluster', 'status']) == 0
    out = capsys.readouterr().out
    assert f'jobs page: {base}/dasktrain/jobs\n' in out
    assert f'metrics: {base}/metrics\n' in out
    page = urllib.request.urlopen(base + '/dasktrain/jobs', timeout=10)
    nonce = re.search(r"'nonce-([^']+)'",
                      page.headers['Content-Security-Policy']).group(1)
    assert f'<script nonce="{nonce}">' in page.read().decode()
    for path in ('/dasktrain/jobs', '/dasktrain/api/jobs'):
        for method in ('POST', 'PUT', 'DELETE'):
            request = urllib.request.Request(base + path, data=b'{}',
                                             method=method)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(request, timeout=10)
            assert e.value.code == 405, (method, path)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(base + '/dasktrain/api/jobs/../../log',
                               timeout=10)
    assert e.value.code == 404


def test_after_a_restart_the_jobs_page_reads_what_jobs_reads(
        cluster, data_dir, capsys):
    # A scheduler started after a job ended heard none of its events:
    # its board (as the scheduler's preload makes it, on the jobs dir)
    # reads the job's progress, accuracy and curves from its files, as
    # `dasktrain jobs` does.
    from dasktrain.jobs.scheduler.board import JobBoard
    job = submitted(job_config(data_dir, epochs=2), 'before-restart')
    job.result(timeout=120)
    status = job.status()
    base = _page_server(JobBoard(job.folder.parent), None)
    jobs = json.load(urllib.request.urlopen(base + '/dasktrain/api/jobs',
                                            timeout=10))['jobs']
    row = next(j for j in jobs if j['id'] == job.id)['row']
    assert row is not None
    assert (row['epoch'], row['validation/main/accuracy']) == \
        (status['epoch'], status['accuracy']) == (2, status['accuracy'])
    curves = json.load(urllib.request.urlopen(
        f'{base}/dasktrain/api/jobs/{job.id}/log', timeout=10))
    assert [r['epoch'] for r in curves] == [1, 2]
    assert main(['jobs', '--jobs-dir', str(job.folder.parent)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith(job.id))
    # ID NAME USER STATE GPUS PROGRESS ACCURACY ...
    assert line.split()[5:7] == ['2/2', f"{status['accuracy']:.4f}"]


def test_jobs_watch_refreshes_until_interrupted(cluster, data_dir, capsys):
    assert main(['jobs', '--watch', '--interval', '0']) == 2
    assert '--interval must be > 0, got 0' in capsys.readouterr().err
    with child('jobs', '--watch', '--interval', '0.3') as watch:
        lines = watch.lines
        wait_until(lambda: sum(line.startswith('ID ') for line in lines)
                   >= 1, 60, 'the first table')
        job = submitted(job_config(data_dir, epochs=1), 'watched')
        wait_until(lambda: any(line.startswith(job.id) and
                               ' finished ' in line for line in lines),
                   120, 'the job to finish')
        watch.signal(signal.SIGINT)
        assert watch.wait(10) == 0, watch.stderr()
    assert 'Traceback' not in watch.stderr()
    states = [line.split()[3] for line in lines if line.startswith(job.id)]
    assert states[0] in ('queued', 'running') and states[-1] == 'finished'
    assert sum(line.startswith('ID ') for line in lines) >= 3  # refreshed


def test_jobs_watch_ends_on_ctrl_c_while_the_scheduler_does_not_answer(
        tmp_path):
    """A scheduler that accepts connections and never answers (a stuck
    or firewalled one): the watch shows the job folders, and Ctrl-C ends
    it at once, at any moment of the connect."""
    server = socket.socket()
    server.bind(('127.0.0.1', 0))
    server.listen(16)
    held = []  # accepted, never answered
    threading.Thread(target=lambda: [held.append(server.accept())
                                     for _ in iter(int, 1)],
                     daemon=True).start()
    folder = tmp_path / 'jobs' / 'stuck-1'
    folder.mkdir(parents=True)
    (folder / 'job.json').write_text(json.dumps({
        'version': 1, 'id': 'stuck-1', 'name': 'stuck', 'user': 'u',
        'gpus': 0,
        'workers': None, 'config': {'epochs': 3}, 'submitted': 1.7e9,
        'scheduler': f'tcp://127.0.0.1:{server.getsockname()[1]}'}))
    (folder / 'status.json').write_text(json.dumps({
        'state': 'queued', 'attempts': 0, 'gpus': None, 'worker': None,
        'started': None, 'ended': None, 'error': None}))
    try:
        for tables in (1, 4):  # early in the connect, and well into it
            with child('jobs', '--watch', '--interval', '0.2',
                       '--jobs-dir', str(tmp_path / 'jobs')) as watch:
                wait_until(lambda tables=tables: sum(
                    line.startswith('stuck-1 ')
                    for line in watch.lines) >= tables,
                           60, f'{tables} tables')
                watch.signal(signal.SIGINT)
                started = time.monotonic()
                assert watch.wait(10) == 0, watch.stderr()
                assert time.monotonic() - started < 1.5
            assert 'Traceback' not in watch.stderr()
            row = [line for line in watch.lines
                   if line.startswith('stuck-1 ')][-1]
            assert row.split()[3] == 'queued'
    finally:
        server.close()


class _Dom(HTMLParser):
    """The text of each job's table row and card, and its curves' points
    (what the page's script wrote into the document)."""
    VOID = {'meta', 'br', 'img', 'input', 'link', 'hr'}

    def __init__(self, html):
        super().__init__()
        self.stack, self.scripts = [], 0
        self.text, self.points = defaultdict(list), defaultdict(list)
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.scripts += tag == 'script'
        where = self.stack[-1] if self.stack else None
        if 'data-job' in attrs:
            where = (tag, attrs['data-job'])
        if tag == 'svg' and where:
            self.points[where].append(int(attrs['data-points']))
        if tag not in self.VOID:
            self.stack.append(where)

    def handle_endtag(self, tag):
        if tag not in self.VOID:
            self.stack.pop()

    def handle_data(self, data):
        if self.stack and self.stack[-1]:
            self.text[self.stack[-1]].append(data)


def _chromium():
    return next(filter(None, map(shutil.which, (
        'chromium', 'chromium-browser', 'google-chrome'))), None)


@pytest.mark.skipif(_chromium() is None, reason=(
    'no chromium to load the jobs page in: apt-get install chromium (make '
    'test does, where it runs as root)'))
def test_jobs_page_in_a_headless_browser_while_a_job_trains(
        cluster, data_dir, tmp_path):
    xss = submitted(job_config(data_dir, epochs=1), XSS)
    job = submitted(job_config(data_dir, epochs=60), 'live-curves')
    page = cluster['base'] + '/dasktrain/jobs'
    browser = [_chromium(), '--headless', '--no-sandbox', '--disable-gpu',
               '--hide-scrollbars', '--window-size=1400,900',
               f'--user-data-dir={tmp_path / "profile"}',
               # time enough for the page's fetches to end
               '--virtual-time-budget=5000']
    try:
        wait_until(lambda: job.status()['state'] == 'running' and
                   len(job.log_rows()) >= 2, 180, 'two epochs of the job')
        dom = subprocess.run(browser + ['--dump-dom', page], check=True,
                             capture_output=True, text=True,
                             timeout=120).stdout
        subprocess.run(browser + [f'--screenshot={tmp_path / "page.png"}',
                                  page], check=True, capture_output=True,
                       timeout=120)
        assert job.status()['state'] == 'running'
    finally:
        job.cancel()
    found = _Dom(dom)
    row = ''.join(found.text[('tr', job.id)])
    assert job.id in row and 'live-curves' in row and 'running' in row
    # loss and accuracy, train and validation, at 2 epochs or more
    (loss, accuracy) = found.points[('div', job.id)]
    assert loss >= 4 and accuracy >= 4
    # The name is text in the document, not markup: no second script.
    assert ''.join(found.text[('tr', xss.id)]).startswith(xss.id + XSS)
    assert XSS not in dom and found.scripts == 1
    png = (tmp_path / 'page.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n'
    assert struct.unpack('>II', png[16:24]) == (1400, 900)


def test_cuda_devices_are_matched_to_nvml_by_uuid_not_by_index():
    from dasktrain.parallel.nvml import match_cuda_devices
    # NVML counts in PCI bus order; CUDA by default fastest first.
    a100 = dict(index=0, uuid='GPU-0a0a0a0a-0000-0000-0000-000000000000',
                name='A100', migs=['MIG-1b1b1b1b-0000-0000-0000-000000000000',
                                   'MIG-2c2c2c2c-0000-0000-0000-000000000000'])
    t4 = dict(index=1, uuid='GPU-3d3d3d3d-0000-0000-0000-000000000000',
              name='T4', migs=[])
    gpus = [a100, t4]

    def indices(**kw):
        return [g['index'] for g in match_cuda_devices(gpus, **kw)]
    # the driver's view (cuDeviceGetUuid: GPU- prefixed, MIG ones too)
    assert indices(uuids=['GPU-3d3d3d3d-0000-0000-0000-000000000000',
                          'GPU-1b1b1b1b-0000-0000-0000-000000000000',
                          'GPU-2c2c2c2c-0000-0000-0000-000000000000']) == \
        [1, 0]  # two MIG instances of one GPU read as that GPU, once
    # CUDA_VISIBLE_DEVICES: UUIDs and prefixes always; MIG instances
    assert indices(entries=['GPU-3d3d', 'MIG-2c2c2c2c']) == [1, 0]
    # ids: CUDA ordinals; on mixed models without PCI order: unknown
    assert indices(entries=['0']) == []
    assert indices(entries=['0'], pci_order=True) == [0]
    same = [dict(a100, migs=[]), dict(t4, name='A100')]
    assert [g['index'] for g in match_cuda_devices(
        same, entries=['1'])] == [1]  # one model: fastest first is PCI
    assert indices(entries=['GPU-ffff']) == []


def _page_server(board, queue):
    """The jobs page's routes on a tornado server of their own, in a
    daemon thread: its base URL."""
    import asyncio

    import tornado.web

    from dasktrain.jobs.scheduler.page import add_routes
    ready = []

    def serve():
        asyncio.set_event_loop(asyncio.new_event_loop())
        app = tornado.web.Application()
        add_routes(app, board, queue)
        server = app.listen(0, '127.0.0.1')
        ready.append(next(iter(server._sockets.values())).getsockname()[1])
        asyncio.get_event_loop().run_forever()
    threading.Thread(target=serve, daemon=True).start()
    wait_until(lambda: ready, 10, 'the page server')
    return f'http://127.0.0.1:{ready[0]}'


def _in_chromium(url, expression, profile, width=1400, height=900):
    """The value of ``expression`` in ``url`` loaded in a headless
    Chromium of ``width`` x ``height`` (DevTools protocol: the page's own
    CSP lets no other script run), once it is truthy."""
    import asyncio

    from tornado.websocket import websocket_connect

    async def measure():
        ws = await websocket_connect(next(
            p for p in json.load(urllib.request.urlopen(
                f'http://127.0.0.1:{port}/json/list', timeout=10))
            if p['type'] == 'page')['webSocketDebuggerUrl'])
        calls = iter(range(1, 10 ** 6))

        async def call(method, **params):
            n = next(calls)
            await ws.write_message(json.dumps(
                {'id': n, 'method': method, 'params': params}))
            while True:
                msg = json.loads(await ws.read_message())
                if msg.get('id') == n:
                    return msg['result']
        await call('Page.navigate', url=url)
        for _ in range(300):
            value = (await call('Runtime.evaluate', expression=expression,
                                returnByValue=True))['result'].get('value')
            if value:
                return value
            await asyncio.sleep(0.1)
        raise AssertionError(f'{expression} never held in {url}')
    browser = subprocess.Popen(
        [_chromium(), '--headless', '--no-sandbox', '--disable-gpu',
         '--hide-scrollbars', f'--window-size={width},{height}',
         f'--user-data-dir={profile}', '--remote-debugging-port=0',
         'about:blank'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        active = Path(profile) / 'DevToolsActivePort'
        wait_until(lambda: active.exists() and '\n' in active.read_text(),
                   30, 'Chromium')
        port = active.read_text().split()[0]
        return asyncio.run(asyncio.wait_for(measure(), 60))
    finally:
        browser.kill()
        browser.wait()


@pytest.mark.skipif(_chromium() is None, reason=(
    'no chromium to load the jobs page in: apt-get install chromium (make '
    'test does, where it runs as root)'))
def test_the_jobs_page_fits_a_1400_px_window_and_says_how_jobs_ended(
        tmp_path):
    import types

    from dasktrain.jobs.scheduler.board import JobBoard
    now = time.time()

    def job(name, spec, status):
        folder = tmp_path / 'jobs' / name
        (folder / 'out').mkdir(parents=True)
        (folder / 'job.json').write_text(json.dumps(
            {'version': 1, 'submitted': now - len(name),
             'user': 'alice-longname', 'name': name, **spec}))
        (folder / 'status.json').write_text(json.dumps(
            {'attempts': 1, **status}))
    worker = 'tcp://192.168.100.123:45678'
    job('train-resnet20-cifar10-sweep-lr-0.05',
        {'gpus': 2, 'config': {'epochs': 20}},
        {'state': 'running', 'gpus': ['0', '1'], 'worker': worker,
         'started': now - 50})
    job('command', {'gpus': 0, 'command': ['python', 'prep.py']},
        {'state': 'running', 'worker': worker, 'started': now - 20})
    job('stopped', {'gpus': 1, 'config': {'epochs': 500}},
        {'state': 'finished', 'ending': 'stopped by request',
         'started': now - 90, 'ended': now - 10})
    job('big', {'gpus': 4, 'config': {'epochs': 20}}, {'state': 'queued'})
    queue = types.SimpleNamespace(view={
        'big': {'position': 1, 'start': now + 3600,
                'reason': 'needs 4 GPUs on one worker; none has as many'},
        'command': {'end': now + 3000, 'overdue': False},
        'train-resnet20-cifar10-sweep-lr-0.05': {'end': now + 600,
                                                 'overdue': False}})
    base = _page_server(JobBoard(tmp_path / 'jobs'), queue)
    got = _in_chromium(base + '/dasktrain/jobs', """
        document.querySelectorAll('#queue tbody tr').length === 4 && (() => {
          const box = document.getElementById('table-box');
          const row = id => document.querySelector(`tr[data-job="${id}"]`);
          return {page: document.documentElement.scrollWidth,
                  window: innerWidth, table: box.scrollWidth,
                  box: box.clientWidth,
                  command: row('command').cells[5].textContent,
                  bars: row('command').querySelectorAll('.bar').length,
                  stopped: row('stopped').cells[3].textContent};
        })()""", tmp_path / 'profile')
    # Nothing wider than the window; the table fits its box (a wider
    # one would scroll inside it, not the page).
    assert got['page'] <= got['window'] == 1400, got
    assert got['table'] <= got['box'], got
    # A job of no epochs shows no epoch progress.
    assert (got['command'], got['bars']) == ('-', 0)
    assert got['stopped'] == 'finished (stopped by request)'
