"""What one user of a shared queue can do to the others, tried: a root-
started shared cluster, ordinary Unix users (bob and eve; ann started
it with sudo), real processes, loopback only. Each numbered finding of
a review of the queue, replayed, now holds:

1. a job's own file poisoned (nested 100,000 deep, a log without its
   keys) halts nothing: the queue plans the others, ``jobs`` and
   ``/metrics`` answer everyone, ``cluster stop``/``start`` complete;
2. no job outlives its cancel or ``cluster stop``: its grace is the
   cluster's at most (``--max-grace``), then SIGKILL;
3. a process that leaves its session and forks and exits in a loop is
   ended with its job: on a cancel and at its normal end;
4. no user reads another's job's error or output (the front door, the
   jobs page and its API, ``/metrics``);
5. no user exhausts the scheduler: connections, request sizes, queued
   jobs and bytes per user are bounded, ended jobs are purged;
6. no user draws on another's terminal: control characters escaped;
7. no user makes the queue POST to a loopback address;

and: a job gets nothing of root's environment, its submitter's resource
limits, a log that says what really ended it, a poisoned file in the
log once. Every hostile form of every file a user (or a damaged disk)
could leave is written into a running cluster's job folders."""
import contextlib
import json
import os
import pwd
import re
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
from test_cluster import wait_until
from test_notify import Hook
from test_shared import CONSOLE, as_user, started_lab

from dasktrain.sweep import marked

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope='module')
def lab():
    # Started from a root shell holding secrets of its own.
    with started_lab('--max-grace', '4', '--max-queued-per-user', '40',
                     '--max-bytes-per-user', '2M', '--keep-finished',
                     '30s', AWS_SECRET_ACCESS_KEY='root-secret-key',
                     SSH_AUTH_SOCK='/tmp/root-agent.sock') as lab:
        # A job that ends at once: purged while the tests below run
        # (test_5_ended_jobs_are_purged_and_jobs_all_is_the_history).
        lab.early = lab.submit('bob', '--', 'true')
        yield lab


# ------------------------------------------------------------- helpers

def _ask(path, requests, timeout):
    answers = []
    for request in requests:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(request if isinstance(request, bytes) else
                      json.dumps(request).encode() + b'\n')
            s.shutdown(socket.SHUT_WR)
            data = b''
            while chunk := s.recv(1 << 16):
                data += chunk
        answers.append(json.loads(data) if data else None)
    return answers


def raw(lab, who, *requests, timeout=60):
    """Each request (a dict, or bytes sent as they are) on a connection
    of its own to the queue's socket, as ``who`` (a child of this process
    that became them); the answers, decoded (None: none)."""
    return as_user(lab, who, _ask, str(lab.where.socket), requests, timeout)


def program(command, **request):
    """A submit of ``command`` (argv) as a client sends it."""
    return {'op': 'submit', 'request': dict({'gpus': 0, 'program': {
        'command': command, 'cwd': '/tmp', 'env': {'PATH': '/usr/bin:/bin'},
        'grace': 1.0, 'requeue': False}}, **request)}


def as_(lab, who, *argv, check=True):
    return subprocess.run(['runuser', '-u', lab.names[who], '--', *argv],
                          capture_output=True, text=True, check=check)


def get(url):
    """(status, body) of a GET, as anyone who reaches the port."""
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def base(lab):
    return lab.state['dashboard'].rsplit('/', 1)[0]


def scheduler_log(lab):
    return (lab.where.private / 'logs' / 'scheduler.log').read_text(
        errors='replace')


def job_processes(lab, job_id):
    """The live processes that carry the job's marker."""
    return marked(f"{lab.state['tag']}/{job_id}/")


def users_processes(lab, who):
    uid = lab.uid(who)
    found = []
    for p in psutil.process_iter(['uids', 'status']):
        with contextlib.suppress(psutil.Error):
            if p.info['uids'].real == uid and \
                    p.info['status'] != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
    return found


def none_left(lab, job_id, who):
    """Nothing of the job left, several looks in a row."""
    for _ in range(5):
        if job_processes(lab, job_id) or users_processes(lab, who):
            return False
        time.sleep(0.1)
    return True


def blocker(lab):
    """A job of ann's that runs until cancelled: jobs ``--after`` it
    (with ``--after-any``) stay queued meanwhile."""
    job_id = lab.submit('ann', '--name', 'blocker', '--', 'sleep', '600')
    lab.wait_for(job_id, ('running',))
    return job_id


# -------------------------------------------------------------- 1, and
# every hostile form of every file

def test_1_a_poisoned_log_halts_nothing(lab):
    block = blocker(lab)
    # eve's queued job, its out/log (hers) nested 100,000 deep
    poisoned = lab.submit('eve', '--name', 'poisoned', '--after', block,
                          '--after-any', '--', 'sleep', '600')
    log = lab.where.jobs / poisoned / 'out' / 'log'
    as_(lab, 'eve', 'sh', '-c', f"printf '%100000s' '' | tr ' ' '[' > {log}")
    assert log.stat().st_size == 100000
    time.sleep(3)  # ticks of the dispatcher go by
    # The queue plans the others: bob's job runs and ends.
    other = lab.submit('bob', '--', 'sh', '-c', 'echo fine')
    assert lab.wait_for(other)['state'] == 'finished'
    for who in ('ann', 'bob', 'eve'):
        code, out, err = lab.run(who, 'jobs')
        assert code == 0, err
        assert sum(line.startswith(poisoned) for line in out.splitlines()) \
            == 1
    # A running job's log without the keys /metrics reads: it answers.
    running = lab.submit('bob', '--', 'sleep', '600')
    lab.wait_for(running, ('running',))
    job = lab.job(running)
    as_(lab, 'bob', 'sh', '-c', 'echo \'[{"epoch": 1, "elapsed_time": '
        f'1.0}}]\' > {job.folder}/out/log')
    wait_until(lambda: job.log_rows(), 30, 'its log')
    time.sleep(3)  # announced
    code, text = get(base(lab) + '/metrics')
    assert code == 200 and 'dasktrain_jobs{state="running"}' in text
    code, text = get(base(lab) + '/dasktrain/api/jobs')
    assert code == 200
    assert [j['id'] for j in json.loads(text)['jobs']].count(poisoned) == 1
    log_text = scheduler_log(lab)
    assert 'Traceback' not in log_text and 'planning failed' not in log_text
    assert lab.run('bob', 'cancel', running)[0] == 0
    assert lab.run('ann', 'cancel', block)[0] == 0
    # The poisoned job ran after its blocker, poisoned log and all.
    assert lab.wait_for(poisoned, ('running',))['state'] == 'running'
    assert lab.run('eve', 'cancel', poisoned)[0] == 0


HOSTILE = {  # name -> what the file holds (bytes), or a kind of file
    'deep': b'[' * 100000,
    'big': 100 * 2 ** 20,  # bytes of a (sparse) file
    'binary': bytes(range(256)) * 64,
    'types': b'{"submitted": "yesterday", "gpus": "all", "state": 7}',
    'empty-object': b'{}',
    'symlink': '/etc/shadow',
    'fifo': None,
}


def _plant(path, form, owner):
    """The hostile ``form`` of :data:`HOSTILE` at ``path``, ``owner``'s."""
    path.unlink(missing_ok=True)
    what = HOSTILE[form]
    if form == 'symlink':
        path.symlink_to(what)
    elif form == 'fifo':
        os.mkfifo(path)
    elif isinstance(what, int):
        with open(path, 'wb') as f:
            f.truncate(what)
    else:
        path.write_bytes(what)
    os.chown(path, owner, owner, follow_symlinks=False)


def test_every_hostile_form_of_every_file_halts_nothing(lab):
    block = blocker(lab)
    eve = lab.uid('eve')
    planted = {}  # job id -> (file, form)
    # (the env.json ones before the logs': they fail at their start, so
    # the logs' sleeping jobs, which hold the 3 slots, never block them)
    kinds = [(name, form) for name in ('job.json', 'status.json',
                                       'env.json', 'out/log')
             for form in HOSTILE]
    # eve's jobs, all through one client (no interpreter per submit)
    answers = raw(lab, 'eve', *[program(
        ['sleep', '600'], name=f'{name}-{form}', after=[block],
        after_any=True) for name, form in kinds])
    assert all(a['ok'] for a in answers), answers
    for (name, form), answer in zip(kinds, answers):
        job_id = answer['id']
        path = lab.where.jobs / job_id / name
        # root's files damaged (a disk, an admin's editor); out/ is the
        # user's own
        _plant(path, form, eve if name == 'out/log' else 0)
        planted[job_id] = (name, form)
    time.sleep(4)  # ticks go by
    # The queue plans the others.
    other = lab.submit('bob', '--', 'sh', '-c', 'echo fine')
    assert lab.wait_for(other)['state'] == 'finished'
    code, text = get(base(lab) + '/metrics')
    assert code == 200
    # `jobs`, the page's API: each job once; damaged ones unreadable.
    code, out, err = lab.run('eve', 'jobs', '--all')
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()]
    code, text = get(base(lab) + '/dasktrain/api/jobs')
    assert code == 200
    api = {j['id']: j for j in json.loads(text)['jobs']}
    for job_id, (name, form) in planted.items():
        mine = [r for r in rows if r and r[0] == job_id]
        assert len(mine) == 1, (job_id, name, form)
        assert job_id in api
        if name in ('job.json', 'status.json'):
            assert mine[0][3] == 'unreadable', (name, form, mine)
            assert api[job_id]['state'] == 'unreadable'
        else:  # its user's log or its environment: the job as it is
            assert mine[0][3] == 'queued', (name, form, mine)
    # Said once in the scheduler's log, not at each tick.
    time.sleep(3)
    log_text = scheduler_log(lab)
    assert 'Traceback' not in log_text
    for job_id, (name, _) in planted.items():
        if name in ('job.json', 'status.json'):
            assert log_text.count(f'{job_id}: left out of the plan') == 1
    # Its owners cancel a damaged job; eve may not (nothing says it is
    # hers any more).
    damaged = next(i for i, (n, f) in planted.items()
                   if (n, f) == ('job.json', 'deep'))
    code, _, err = lab.run('eve', 'cancel', damaged)
    assert code == 1 and 'nobody known' in err, err
    assert lab.run('ann', 'cancel', damaged)[0] == 0
    # The blocker ends: the jobs with a damaged env.json fail in one line,
    # those with a damaged log run (and one with an empty environment:
    # {} is one).
    assert lab.run('ann', 'cancel', block)[0] == 0
    empty = ('env.json', 'empty-object')
    for job_id, (name, form) in planted.items():
        if name == 'env.json' and (name, form) != empty:
            status = lab.wait_for(job_id, ('failed',), timeout=60)
            assert 'env.json' in status['error'], (form, status)
            assert '\n' not in status['error']
    started = [i for i, kind in planted.items()
               if kind[0] == 'out/log' or kind == empty]
    wait_until(lambda: all(lab.job(i).status()['state'] in
                           ('running', 'queued') for i in started), 30,
               'the logs\' jobs')
    raw(lab, 'root', *[{'op': 'cancel', 'id': i} for i in planted])


# ------------------------------------------------------------------- 2

TRAP = "trap '' TERM; echo pid $$; while :; do sleep 1; done"


def test_2_no_job_outlives_its_cancel_whatever_grace_it_asked(lab):
    code, _, err = lab.run('bob', 'submit', '--gpus', '0', '--grace',
                           '1e300', '--', 'sh', '-c', TRAP)
    assert code == 1
    assert err == ('dasktrain submit: error: --grace 1e+300: this cluster '
                   'stops a job within 4 s of its SIGTERM (cluster start '
                   '--max-grace)\n')
    # One asked before the cluster's rule (its job.json says so) gets
    # the cluster's grace all the same.
    block = blocker(lab)
    job_id = lab.submit('bob', '--grace', '4', '--after', block,
                        '--after-any', '--', 'sh', '-c', TRAP)
    path = lab.where.jobs / job_id / 'job.json'
    spec = json.loads(path.read_text())
    path.write_text(json.dumps(dict(spec, grace=1e300)))
    assert lab.run('ann', 'cancel', block)[0] == 0
    lab.wait_for(job_id, ('running',))
    wait_until(lambda: 'pid ' in lab.job(job_id).logs(), 30, 'its pid')
    began = time.monotonic()
    code, out, err = lab.run('bob', 'cancel', job_id)
    assert (code, out) == (0, f'{job_id}: cancelled\n'), err
    assert time.monotonic() - began < 20
    status = lab.job(job_id).status()
    assert status['error'] == 'SIGTERM ignored for 4 s: killed by SIGKILL'
    assert none_left(lab, job_id, 'bob')
    log = lab.job(job_id).logs()
    assert '=== grace 1e+300 s asked; this cluster stops a job within 4 s' \
        in log


# ------------------------------------------------------------------- 3

LOOP = 'trap "" TERM; sh "$0" & exit 0\n'  # forks itself, exits: for ever


def test_3_a_fork_loop_ends_with_its_job(lab):
    home = lab.homes['bob']
    loop = home / 'loop.sh'
    loop.write_text(LOOP)
    os.chown(loop, lab.uid('bob'), pwd.getpwnam(lab.names['bob']).pw_gid)
    # Cancelled: nothing of it is left.
    job_id = lab.submit('bob', '--grace', '1', '--', 'sh', '-c',
                        f'setsid sh {loop} & echo started; sleep 600',
                        cwd=home)
    lab.wait_for(job_id, ('running',))
    wait_until(lambda: 'started' in lab.job(job_id).logs(), 30, 'its loop')
    # (a scan may miss a loop between two of its pids; its sleep stays)
    for _ in range(50):
        if job_processes(lab, job_id):
            break
        time.sleep(0.1)
    assert job_processes(lab, job_id), (lab.job(job_id).status(),
                                        lab.job(job_id).logs())
    assert lab.run('bob', 'cancel', job_id)[:2] == (0, f'{job_id}: '
                                                       'cancelled\n')
    assert none_left(lab, job_id, 'bob')
    # Its normal end: finished once what it left is gone, and said so.
    job_id = lab.submit('bob', '--grace', '1', '--', 'sh', '-c',
                        f'setsid sh {loop} & sleep 2; echo done', cwd=home)
    status = lab.wait_for(job_id, timeout=60)
    assert status['state'] == 'finished'
    assert none_left(lab, job_id, 'bob')
    log = lab.job(job_id).logs()
    assert re.search(r'it ended; the \d+ process(es)? it left running '
                     'were killed by SIGKILL', log), log
    # `cluster status` says how jobs are kept.
    code, out, err = lab.run('eve', 'cluster', 'status')
    assert code == 0, err
    kept = [line for line in out.splitlines()
            if line.startswith('jobs kept in: ')]
    assert len(kept) == 1 and ('a cgroup per job under' in kept[0] or
                               'a sweep of its processes' in kept[0])
    assert 'a stopped job gets SIGKILL 4 s after its SIGTERM at most' in out


# ------------------------------------------------------------------- 4

NET = """import os, chainer, chainer.links as L
if os.environ.get('DASKTRAIN_JOB_MARK'):  # in the job, not at submit
    print('environment:', ' '.join(sorted(os.environ)), flush=True)
class Net(chainer.Chain):
    def __init__(self, n_classes=10):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(None, n_classes)
    def forward(self, x):
        raise RuntimeError('s3cret-token-42')
"""


def test_4_nobody_reads_anothers_output(lab):
    # root's training job fails with a line of its output as its error.
    net = lab.root / 'leaky.py'
    net.write_text(NET)
    data = lab.data('leaky-data', seed=7)
    failed = lab.submit('root', '--', '--model', f'{net}:Net', '--epochs',
                        '1', '--batch-size', '40', '--train-size', '200',
                        '--test-size', '40', '--devices', 'cpu',
                        '--data-dir', str(data), preload='chainer,'
                        'dasktrain.training.models')
    status = lab.wait_for(failed, timeout=180)
    assert status['state'] == 'failed'
    assert 's3cret-token-42' in status['error']
    # bob's command job logs an accuracy.
    scored = lab.submit('bob', '--', 'sleep', '600')
    lab.wait_for(scored, ('running',))
    as_(lab, 'bob', 'sh', '-c', 'echo \'[{"epoch": 1, "validation/main/'
        f'accuracy": 0.4242}}]\' > {lab.job(scored).folder}/out/log')
    wait_until(lambda: lab.job(scored).log_rows(), 30, 'its log')
    time.sleep(3)  # its epoch announced
    # eve: the job's state, never its error nor its output.
    answer = raw(lab, 'eve', {'op': 'status', 'id': failed})[0]
    assert answer['ok'] and answer['status']['state'] == 'failed'
    assert 'error' not in answer['status'] and \
        's3cret' not in json.dumps(answer)
    code, out, err = lab.run('eve', 'jobs')
    assert code == 0 and 's3cret' not in out and '0.4242' not in out, err
    for verb in ('logs', 'result'):
        code, _, err = lab.run('eve', verb, failed)
        assert code == 1 and 'belongs to root' in err
    # Its owners: the error, the accuracy.
    answer = raw(lab, 'ann', {'op': 'status', 'id': failed})[0]
    assert 's3cret-token-42' in answer['status']['error']
    code, out, err = lab.run('bob', 'jobs')
    assert code == 0 and '0.4242' in out, err
    code, out, err = lab.run('ann', 'jobs')
    assert code == 0 and '0.4242' in out, err
    # The unauthenticated page, its API and /metrics: nothing of either.
    code, text = get(base(lab) + '/dasktrain/api/jobs')
    assert code == 200 and json.loads(text)['private'] is True
    assert 's3cret' not in text and '0.4242' not in text
    assert not any('error' in j or 'row' in j
                   for j in json.loads(text)['jobs'])
    assert get(base(lab) + f'/dasktrain/api/jobs/{scored}/log')[0] == 404
    code, text = get(base(lab) + '/metrics')
    assert code == 200 and '0.4242' not in text and 's3cret' not in text
    assert 'dasktrain_job_accuracy_ratio{' not in text
    assert f'dasktrain_job_state{{job_id="{scored}"' in text
    # And the training job got nothing of root's shell.
    log = lab.job(failed).logs()
    names = next(line for line in log.splitlines()
                 if line.startswith('environment:')).split()[1:]
    assert 'AWS_SECRET_ACCESS_KEY' not in names
    assert 'SSH_AUTH_SOCK' not in names
    assert lab.run('bob', 'cancel', scored)[0] == 0


# ------------------------------------------------------------------- 5

def test_5_connections_and_requests_are_bounded_per_user(lab):
    process = psutil.Process(lab.state['pids'][0])
    scheduler = next(p for p in process.children(recursive=True)
                     if 'scheduler' in ' '.join(p.cmdline()))
    fds, rss = scheduler.num_fds(), scheduler.memory_info().rss
    # eve holds 200 connections open without a word; 16 are hers, the
    # others are answered at once; 30 more each send 4 MiB less a byte
    # and stop.
    code = f"""
import os, pwd, socket, sys, time, json
e = pwd.getpwnam({lab.names['eve']!r})
os.setgroups([]); os.setgid(e.pw_gid); os.setuid(e.pw_uid)
held, refused = [], 0
for i in range(230):
    s = socket.socket(socket.AF_UNIX)
    s.connect({str(lab.where.socket)!r})
    if i >= 200:
        s.setblocking(False)
        try:
            s.send(b'x' * (4 * 2 ** 20 - 1))
        except OSError:
            pass
    held.append(s)
time.sleep(2)
for s in held:
    s.setblocking(True)
    s.settimeout(0.2)
    try:
        refused += b'at most 16 per user' in s.recv(4096)
    except OSError:
        pass
print(refused, flush=True)
time.sleep(30)
"""
    with subprocess.Popen([sys.executable, '-c', code],
                          stdout=subprocess.PIPE, text=True) as eve:
        try:
            refused = int(eve.stdout.readline())
            assert refused >= 230 - 16
            # bob is answered meanwhile, at once.
            began = time.monotonic()
            assert raw(lab, 'bob', {'op': 'ping'})[0]['ok']
            assert time.monotonic() - began < 5
            assert scheduler.num_fds() < fds + 40
            assert scheduler.memory_info().rss < rss + 200 * 2 ** 20
        finally:
            eve.kill()
    # A request that holds an environment of 1 MiB: refused.
    big = program(['true'])
    big['request']['program']['env'] = {'HUGE': 'x' * 2 ** 20}
    answer = raw(lab, 'eve', big)[0]
    assert not answer['ok'] and answer['error'].startswith(
        'env is 1024 KiB; a job keeps at most 256 KiB of your environment')


def test_5_queued_jobs_and_bytes_per_user_are_bounded(lab):
    block = blocker(lab)
    after = {'after': [block], 'after_any': True}
    answers = raw(lab, 'eve', *[program(['sleep', '1'], **after)
                                for _ in range(41)])
    assert all(a['ok'] for a in answers[:40])
    assert answers[40] == {'ok': False, 'error': (
        'you have 40 jobs queued or running, the most this cluster takes '
        'from one user (cluster start --max-queued-per-user); submit more '
        'once some have ended')}
    ids = [a['id'] for a in answers[:40]]
    # bob is not eve: his job queues and runs.
    assert lab.wait_for(lab.submit('bob', '--', 'true'))['state'] == \
        'finished'
    # A page of the table, as any client asks for it.
    answer = raw(lab, 'bob', {'op': 'jobs', 'per_page': 10, 'page': 2})[0]
    assert answer['ok'] and len(answer['rows']) == 10
    assert answer['counts']['page'] == 2 and answer['counts']['total'] >= 41
    raw(lab, 'eve', *[{'op': 'cancel', 'id': i} for i in ids])
    # Bytes: 100 KB commands, until the 2 MiB eve's files may take.
    fat = program(['true', 'x' * 100_000], **after)
    answers = raw(lab, 'eve', *[fat] * 25)
    refused = [a for a in answers if not a['ok']]
    assert refused and refused[0]['error'].startswith("your jobs' files take")
    assert '(cluster start --max-bytes-per-user)' in refused[0]['error']
    raw(lab, 'eve', *[{'op': 'cancel', 'id': a['id']} for a in answers
                      if a['ok']])
    assert lab.run('ann', 'cancel', block)[0] == 0


def test_5_ended_jobs_are_purged_and_jobs_all_is_the_history(lab):
    job_id = lab.submit('bob', '--', 'true')
    assert lab.wait_for(job_id)['state'] == 'finished'
    # 30 s after its end (--keep-finished 30s), the lab's first job is
    # gone, outputs and all; one that just ended is history.
    wait_until(lambda: not (lab.where.jobs / lab.early).exists(), 90,
               f'{lab.early} purged')
    code, out, _ = lab.run('bob', 'jobs', '--all')
    assert code == 0 and job_id in out and lab.early not in out
    assert 'dasktrain queue: purged ' in scheduler_log(lab)  # (20 ids)


# ------------------------------------------------------------------- 6

NAME = 'x\x1b]0;TITLE\x07\x1b[2J'


def test_6_nothing_draws_on_anothers_terminal(lab):
    job_id = lab.submit('bob', '--name', NAME, '--', 'sh', '-c',
                        "printf 'red\\033[31m\\n'; exit 3")
    lab.wait_for(job_id)
    for who, argv in (('eve', ['jobs']), ('eve', ['gpus']),
                      ('bob', ['logs', job_id]), ('eve', ['logs', job_id]),
                      ('bob', ['cancel', job_id])):
        code, out, err = lab.run(who, *argv)
        assert '\x1b' not in out + err and '\x07' not in out + err, argv
    code, out, _ = lab.run('eve', 'jobs')
    assert 'x\\x1b]0;TITLE\\x07\\x1b[2J' in out
    code, out, _ = lab.run('bob', 'logs', job_id)
    assert 'red\\x1b[31m' in out
    code, out, _ = lab.run('bob', 'logs', '--raw', job_id)
    assert 'red\x1b[31m' in out  # his own, as written, when he asks
    # The page writes it as text, escaped (its script: printable()).
    code, text = get(base(lab) + '/dasktrain/jobs')
    assert code == 200 and 'function printable' in text


# ------------------------------------------------------------------- 7

def test_7_no_webhook_to_the_machines_own_addresses(lab, caplog):
    hook = Hook()
    port = hook.server.server_port
    try:
        for url in (f'http://127.0.0.1:{port}/internal',
                    f'http://localhost:{port}/internal',
                    f'http://[::1]:{port}/internal'):
            code, _, err = lab.run('eve', 'submit', '--gpus', '0',
                                   '--notify', url, '--', 'true')
            assert code == 1 and 'is a loopback address; this cluster ' \
                'sends to public addresses only (cluster start ' \
                '--notify-allow)' in err, err
        # A name that resolves to it (127.1: inet_aton's 127.0.0.1) is
        # checked when it is sent, on the address it resolves to.
        job_id = lab.submit('eve', '--notify',
                            f'http://127.1:{port}/internal', '--', 'true')
        assert lab.wait_for(job_id)['state'] == 'finished'
        wait_until(lambda: 'notification not sent' in (
            lab.where.private / 'logs' / 'worker.log').read_text(), 30,
            'the refusal logged')
        time.sleep(1)
        assert hook.posts == []
    finally:
        hook.close()


# ---------------------------------------------------------------- and

def test_a_job_gets_its_submitters_limits_and_not_roots_environment(lab):
    job_id = lab.submit('bob', '--', 'sh', '-c',
                        'ulimit -Sn; ulimit -Hn; env',
                        RLIMITS='nofile:777:888')
    assert lab.wait_for(job_id)['state'] == 'finished'
    lines = lab.job(job_id).logs().splitlines()[1:]
    assert lines[:2] == ['777', '888']
    env = dict(line.split('=', 1) for line in lines[2:] if '=' in line)
    assert 'AWS_SECRET_ACCESS_KEY' not in env and 'SSH_AUTH_SOCK' not in env
    assert env['DASKTRAIN_JOB_MARK'].startswith(
        f"{lab.state['tag']}/{job_id}/")


def test_a_job_that_ended_by_itself_is_logged_so(lab):
    # It takes 2 s to end after the SIGTERM, within its grace (4 s).
    job_id = lab.submit('bob', '--grace', '4', '--', 'sh', '-c',
                        "trap 'sleep 2; exit 0' TERM; echo ready; "
                        'while :; do sleep 1; done')
    lab.wait_for(job_id, ('running',))
    wait_until(lambda: 'ready' in lab.job(job_id).logs(), 30, 'ready')
    assert lab.run('bob', 'cancel', job_id)[0] == 0
    error = lab.job(job_id).status()['error']
    assert error.startswith('ended by itself (exit 0) ') and \
        error.endswith(' s after SIGTERM'), error
    assert 'stopped by SIGTERM' not in lab.job(job_id).logs()


# -------------------------------------- 1 and 2: stop and start (last)

def test_stop_and_start_complete_whatever_the_jobs_hold(lab):
    # A queued job with a poisoned log, and a running one that ignores
    # SIGTERM: `cluster stop --requeue` and `cluster start` complete, in
    # one line each, and leave nothing of the running job behind.
    block = blocker(lab)
    poisoned = lab.submit('eve', '--after', block, '--after-any', '--',
                          'sleep', '600')
    log = lab.where.jobs / poisoned / 'out' / 'log'
    as_(lab, 'eve', 'sh', '-c', f"printf '%100000s' '' | tr ' ' '[' > {log}")
    stubborn = lab.submit('bob', '--', 'sh', '-c', TRAP)
    lab.wait_for(stubborn, ('running',))
    shared = ['--shared', '--shared-dir', str(lab.where.root)]
    began = time.monotonic()
    done = subprocess.run([str(CONSOLE), 'cluster', 'stop', '--requeue',
                           *shared], env=lab.env(), capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0 and 'Traceback' not in done.stderr, done
    assert f'job {poisoned}: queued' in done.stdout
    assert time.monotonic() - began < 60
    assert none_left(lab, stubborn, 'bob')
    assert not marked(f"{lab.state['tag']}/")  # nothing of any job
    done = subprocess.run([str(CONSOLE), 'cluster', 'start', *shared,
                           *lab.flags], env=lab.env(
                               SUDO_UID=str(lab.uid('ann'))),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and 'Traceback' not in done.stderr, done
    assert f'requeued job {poisoned} (its cluster had gone)' in done.stdout
    lab.state = json.loads((lab.where.private / 'cluster.json')
                           .read_text())
    lab.wait_for(block, ('running',))
    assert lab.job(poisoned).status()['state'] == 'queued'
    assert lab.run('ann', 'cancel', block)[0] == 0
    assert lab.wait_for(poisoned, ('running',))['state'] == 'running'
    # And a plain stop (the fixture's) ends it, in SIGKILL if need be.
