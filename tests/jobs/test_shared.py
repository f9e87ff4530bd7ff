"""One queue for a lab of Unix users: a shared cluster started as root
(`dasktrain cluster start --shared`), each job run as its submitter, every
user talking to its front door (a Unix socket: who asks is the kernel's
SO_PEERCRED). The rules as pure functions; then a real shared cluster
with real processes and Unix users the test creates (skipped, with the
reason, where the test is not root or cannot create users).

A user's client runs as that user: a Python process started by root that
loads dasktrain, then drops to the user (setgroups, setgid, setuid)
before it runs the command, so the kernel names that user at the socket.
(The venv's interpreter may live where another user cannot exec it, as
under /root here: `runuser` could not start it.)"""
import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from children import child
from cifar_fixture import make_batches, write_archive
from test_cluster import wait_until
from test_notify import Hook
from test_programs import alive

from dasktrain.as_user import popen_options
from dasktrain.cluster.processes import kill
from dasktrain.cluster.shared import NEEDS_ROOT, check_root, layout
from dasktrain.data import extract_archive
from dasktrain.files import read_regular
from dasktrain.jobs.client.route import route, shared_queue
from dasktrain.jobs.client.socket_client import SocketClient
from dasktrain.jobs.job import Job
from dasktrain.jobs.wire import (
    ProtocolError,
    RequestError,
    check_request,
    decode,
    encode,
    may_act,
    peer_credentials,
    refusal,
)
from dasktrain.jobs.worker.environment import job_environment, job_threads
from dasktrain.jobs.worker.runas import User

CONSOLE = Path(sys.executable).parent / 'dasktrain'
ENDS = ('finished', 'failed', 'cancelled', 'lost')
# A user's client: loaded as root, then that user (see the module).
AS_USER = """
import importlib, os, pkgutil, pwd, sys
import dasktrain.cli, dasktrain.notify, dasktrain.data.datasets
import dasktrain.userspec, dasktrain.config
import dasktrain.training.commandfile, dasktrain.training.outdir
# Every command's modules, imported as root: a checkout only root may
# read (a clone in a 0700 folder) serves the users all the same.
for package in ('dasktrain.commands', 'dasktrain.cluster', 'dasktrain.jobs'):
    for found in pkgutil.walk_packages(
            importlib.import_module(package).__path__, package + '.'):
        importlib.import_module(found.name)
for module in filter(None, os.environ.pop('PRELOAD', '').split(',')):
    __import__(module)
import resource
for spec in filter(None, os.environ.pop('RLIMITS', '').split(',')):
    what, soft, hard = spec.split(':')  # the user's shell's `ulimit`s
    resource.setrlimit(getattr(resource, 'RLIMIT_' + what.upper()),
                       (int(soft), int(hard)))
name = sys.argv[1]
if name != 'root':
    entry = pwd.getpwnam(name)
    os.setgroups(os.getgrouplist(name, entry.pw_gid))
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)
sys.exit(dasktrain.cli.main(sys.argv[2:]))
"""


# ------------------------------------ another user, in a child

def become(lab, who):
    """This process becomes ``who`` (a lab user, or any user's name)."""
    entry = pwd.getpwnam(lab.names.get(who, who))
    os.setgroups([])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)


def as_user(lab, who, function, *args):
    """``function(*args)`` in a child of this process that became
    ``who``; what it returned (JSON)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            become(lab, who)
            os.write(write, json.dumps(function(*args)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    try:
        with os.fdopen(read) as f:
            text = f.read()
    finally:
        os.waitpid(pid, 0)
    return json.loads(text)


@contextlib.contextmanager
def running_as(lab, who, function, *args):
    """``function(report, *args)`` in a child of this process that became
    ``who``, in a session of its own, until the block ends (then its
    whole session is killed); ``report(obj)`` sends a JSON line back.
    Yields a callable: the lines reported so far."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.setsid()
            become(lab, who)
            out = os.fdopen(write, 'w', buffering=1)
            function(lambda obj: print(json.dumps(obj), file=out), *args)
        finally:
            os._exit(0)
    os.close(write)
    os.set_blocking(read, False)
    lines, buffer = [], [b'']

    def reported():
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(read, 65536):
                buffer[0] += chunk
        *done, buffer[0] = buffer[0].split(b'\n')
        lines.extend(json.loads(line) for line in done if line)
        return lines
    try:
        yield reported
    finally:
        for kill in (os.killpg, os.kill):  # (before its setsid: itself)
            with contextlib.suppress(ProcessLookupError):
                kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)


# ----------------------------------------------------------- the rules

def test_who_may_act_on_a_job_and_the_line_everyone_else_gets():
    owners = {0, 1000}  # root, and alice who ran `sudo ... --shared`
    assert may_act(1001, 1001, owners)        # ann, her own job
    assert may_act(1000, 1001, owners)        # alice, the cluster's owner
    assert may_act(0, 1001, owners)           # root
    assert not may_act(1002, 1001, owners)    # bob
    assert not may_act(1002, None, owners)    # a job of nobody known
    assert refusal('r20-1', 'ann', ['root', 'alice']) == (
        "job r20-1 belongs to ann; only ann or the cluster's owner (root, "
        'alice) can cancel it')


def test_the_caller_is_the_kernels_word_never_the_requests():
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        raw = a.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        assert peer_credentials(raw) == (os.getpid(), os.getuid(),
                                         os.getgid())
    for raw in (b'', b'\0' * 8, None, struct.pack('3i', 1, -1, 0)):
        with pytest.raises(ProtocolError):
            peer_credentials(raw)
    # A request naming who it is, or whose job it is, is refused.
    for field in ('uid', 'user', 'gid', 'pid'):
        with pytest.raises(ProtocolError, match=f'takes no {field}'):
            check_request(dict(_program(), **{field: 0}))


def _program(request=None, **fields):
    """A submit of a program, with ``fields`` of its program changed (and
    of its ``request``)."""
    program = dict({'command': ['true'], 'cwd': '/tmp', 'env': {'A': '1'}},
                   **fields)
    return {'op': 'submit',
            'request': dict({'gpus': 0, 'program': program}, **request or {})}


def _training(**fields):
    return {'op': 'submit', 'request': {'gpus': 0, 'training': dict(
        {'config': {}, 'env': {}}, **fields)}}


def test_every_field_of_a_request_is_checked():
    request = check_request(_program())['request']
    assert request.program.grace is None and request.gpus == 0
    assert request.program.env == {'A': '1'}
    train = check_request(_training(files={'model': {
        'name': 'net.py', 'data': 'eCA9IDE='}}))['request']
    assert train.program.files == {'model': ('net.py', b'x = 1')}
    assert train.program.module == 'dasktrain.jobs.worker.train_job'
    bad = [
        ({'op': 'eval'}, 'op must be one of'),
        ({'op': 'cancel', 'id': '../../etc'}, 'not a job id'),
        ({'op': 'cancel', 'id': '.hidden'}, 'not a job id'),
        ({'op': 'logs', 'id': 'a', 'offset': -1}, 'offset must be'),
        ({'op': 'jobs', 'cli': 'yes'}, 'cli must be'),
        ({'op': 'submit', 'request': []}, 'request must be a JSON object'),
        (_program({'gpus': True}), 'gpus must be an int'),
        (_program(cwd='lab'), 'cwd must be an absolute path'),
        (_program(command=[]), 'command must be a non-empty list'),
        (_program(command=['a\0b']), 'command must be a string'),
        (_program(env={'1A': 'x'}), 'not a variable name'),
        (_program(env={'A': 3}), 'env A must be a string'),
        (_program(grace=float('nan')), 'grace must be seconds'),
        (_program({'after': ['a/b']}), 'not a job id'),
        (_program({'time': -5}), 'time must be seconds'),
        (_program({'training': {}}), 'a program or a training, one'),
        (_program({'uid': 0}), 'submit takes no uid'),
        (_training(files={'model': {'name': '../x.py', 'data': ''}}),
         'files.model must be'),
        (_training(files={'model': {'name': 'x.py', 'data': '!!'}}),
         'files.model.data is not base64'),
        (_training(files={'shadow': {}}), 'files takes model and dataset'),
        (_training(module='os'), "module must be one of dasktrain's"),
        (_training(extra={'uid': 0}), 'extra takes trial only'),
        (_training(env={'A': None}), 'env A must be a string'),
    ]
    for message, match in bad:
        with pytest.raises(RequestError, match=match):
            check_request(message)
    for line, match in [(b'{"op": ', 'not a JSON request'),
                        (b'[1]', 'a JSON object'),
                        (b'\xff', 'not a JSON request'),
                        (b' ' * (4 * 2 ** 20 + 1), 'at most 4 MiB')]:
        with pytest.raises(ProtocolError, match=match):
            decode(line)
    assert decode(encode({'op': 'ping'})) == {'op': 'ping'}


def test_which_queue_a_client_uses(tmp_path, monkeypatch):
    sock = '/var/lib/dasktrain/queue.sock'
    assert route(False, {}, False, sock) == sock       # the lab's
    assert route(False, {}, True, sock) is None        # your own first
    assert route(False, {'DASKTRAIN_QUEUE': '/q'}, True, sock) == '/q'
    assert route(True, {'DASKTRAIN_QUEUE': '/q'}, True, sock) is None
    assert route(False, {}, False, None) is None       # none: as before
    # The same from the files a client finds.
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path / 'home'))
    where = layout(tmp_path / 'shared')
    env = {'DASKTRAIN_SHARED_DIR': str(where.root)}
    assert shared_queue(env=env) is None                 # no record yet
    where.root.mkdir()
    where.record.write_text(json.dumps({'socket': str(where.socket)}))
    assert shared_queue(env=env).path == where.socket
    assert shared_queue(scheduler='tls://a:1', env=env) is None
    assert shared_queue(jobs_dir='/nas/jobs', env=env) is None
    (tmp_path / 'home').mkdir()
    (tmp_path / 'home' / 'cluster.json').write_text('{}')
    assert shared_queue(env=env) is None                 # your own
    assert shared_queue(env=dict(env, DASKTRAIN_QUEUE='/q')).path == Path('/q')


def test_a_shared_queue_that_is_not_there_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path / 'home'))
    monkeypatch.setenv('DASKTRAIN_QUEUE', str(tmp_path / 'none.sock'))
    with child([str(CONSOLE), 'jobs']) as c:
        assert c.wait(60) == 1
        lines = c.stderr().strip().splitlines()
    assert lines == [f'dasktrain jobs: error: the shared queue at '
                     f'{tmp_path / "none.sock"} is not there (No such file '
                     'or directory); is the shared cluster running? (`sudo '
                     'dasktrain cluster start --shared` starts it)']
    # A socket nobody answers on: refused at once, one line.
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(tmp_path / 'dead.sock'))
    dead.close()
    with pytest.raises(Exception, match='is not answering .Connection '
                       'refused.; is the shared cluster running'):
        SocketClient(tmp_path / 'dead.sock').ask('ping')


def test_a_shared_cluster_needs_root():
    with pytest.raises(Exception) as e:
        check_root(euid=1000)
    assert str(e.value) == NEEDS_ROOT == (
        'a shared cluster runs each job as its submitter, which needs root: '
        'start it with sudo, or leave out --shared for a cluster of your '
        'own')
    check_root(euid=0)


def test_root_reads_no_symlink_no_fifo_and_no_strangers_file(tmp_path):
    (tmp_path / 'log').write_text('[]')
    assert read_regular(tmp_path / 'log', owner=os.getuid()) == b'[]'
    assert read_regular(tmp_path / 'log', offset=1, limit=1) == b']'
    (tmp_path / 'planted').symlink_to(tmp_path / 'log')
    with pytest.raises(OSError, match='symbolic links'):
        read_regular(tmp_path / 'planted')
    os.mkfifo(tmp_path / 'fifo')
    began = time.monotonic()
    with pytest.raises(OSError, match='not a regular file'):
        read_regular(tmp_path / 'fifo')  # and no wait for a writer
    assert time.monotonic() - began < 5
    with pytest.raises(OSError, match='owned by uid'):
        read_regular(tmp_path / 'log', owner=os.getuid() + 1)


def test_a_users_job_gets_their_identity_not_the_clusters():
    # Only what the submitter sent, the queue's variables and, in a
    # shared cluster, their identity: nothing of the worker's process
    # (its DASKTRAIN_NOTIFY, DASK_*, SUDO_USER, root's HOME).
    ann = User(1001, 1001, 'ann', '/home/ann', '/bin/sh', [1001, 27])
    recorded = {'PATH': '/opt/venv/bin', 'WANDB_MODE': 'offline',
                'USER': 'ann-at-submit'}
    queue = {'PYTHONUNBUFFERED': '1', 'CUDA_VISIBLE_DEVICES': '',
             'OMP_NUM_THREADS': '2', 'OPENBLAS_NUM_THREADS': '2',
             'MKL_NUM_THREADS': '2', 'LANG': 'C.UTF-8'}  # LANG: allowed
    assert job_environment(recorded, [], 2, ann) == dict(
        recorded, USER='ann', HOME='/home/ann', LOGNAME='ann', **queue)
    assert job_environment(recorded, [], 2) == dict(recorded, **queue)
    options = popen_options(ann, '/home/ann/lab')
    assert (options['user'], options['group'], options['extra_groups'],
            options['umask']) == (1001, 1001, [1001, 27], 0o077)
    assert 'cwd' not in options  # entered as ann, after the uid changed
    assert popen_options(None, '/lab')['cwd'] == '/lab'


# ---------------------------------------------- a real shared cluster

class Lab:
    """A shared cluster in a folder every user may traverse, and Unix
    users: ``ann`` (who started it with sudo: its owner), ``bob`` and
    ``eve``; :meth:`run` runs a dasktrain command as one of them."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix='dasktrain-lab-'))
        os.chmod(self.root, 0o755)
        self.where = layout(self.root / 'shared')
        self.names, self.homes = {}, {}
        self.state = None

    def add_user(self, who):
        name = f'dt{who}{uuid.uuid4().hex[:6]}'
        done = subprocess.run(['useradd', '--system', '--no-create-home',
                               name], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f'cannot create a second Unix user here (useradd: '
                        f'{done.stderr.strip()})')
        self.names[who] = name
        home = self.root / who
        home.mkdir(mode=0o700)
        os.chown(home, self.uid(who), pwd.getpwnam(name).pw_gid)
        self.homes[who] = home

    def uid(self, who):
        return 0 if who == 'root' else pwd.getpwnam(self.names[who]).pw_uid

    def env(self, **more):
        """The clients' environment: this lab's shared place, no cluster
        of one's own; ``more`` on top."""
        env = {k: v for k, v in os.environ.items() if k not in (
            'DASKTRAIN_JOBS_DIR', 'DASKTRAIN_QUEUE', 'SUDO_UID')}
        # The test's venv may live where only root can run it (under
        # /root): started anyway, as for a queue of command jobs that
        # bring their own Python (test_shared_install.py installs one
        # every user can run).
        return dict(env, DASKTRAIN_SHARED_DIR=str(self.where.root),
                    DASKTRAIN_HOME=str(self.root / 'no-cluster-of-ones-own'),
                    DASKTRAIN_SHARED_PRIVATE_PYTHON='1', **more)

    def run(self, who, *args, cwd=None, timeout=90, preload='', **env):
        """``dasktrain ARGS`` as ``who``: (exit code, stdout, stderr)."""
        name = 'root' if who == 'root' else self.names[who]
        with child([sys.executable, '-c', AS_USER, name, *args],
                   env=self.env(PRELOAD=preload, **env),
                   cwd=cwd or self.homes.get(who, self.root)) as c:
            code = c.wait(timeout)
            out, err = ''.join(c.lines), c.stderr()
        if "scheduler's log" in err:  # the queue's own failure: its why
            log = self.where.private / 'logs' / 'scheduler.log'
            err += '\n--- the scheduler log ends:\n' + '\n'.join(
                log.read_text(errors='replace').splitlines()[-60:])
        return code, out, err

    def submit(self, who, *args, **kw):
        code, out, err = self.run(who, 'submit', '--gpus', '0', *args, **kw)
        assert code == 0, err
        return out.strip()

    def job(self, job_id):
        return Job(job_id, self.where.jobs / job_id)

    def data(self, name, seed):
        """A small CIFAR data dir where every user may read it."""
        data = self.root / name
        data.mkdir()
        write_archive(data / 'a.tar.gz', make_batches(n_train=(40,) * 5,
                                                      n_test=40, seed=seed))
        extract_archive(data / 'a.tar.gz', data)
        return data

    def wait_for(self, job_id, states=ENDS, timeout=60):
        job = self.job(job_id)
        wait_until(lambda: job.status()['state'] in states, timeout,
                   f'{job_id} to be {"/".join(states)}')
        return job.status()

    def close(self):
        try:
            if self.where.private.exists():
                with child([str(CONSOLE), 'cluster', 'stop', '--shared',
                            '--shared-dir', str(self.where.root)],
                           env=self.env()) as c:
                    c.wait(120)
        finally:
            state = self.state or {}
            for pid, created in zip(state.get('pids', ()),
                                    state.get('created', ())):
                kill(pid, created)  # only if still the ones recorded
            self.kill_users_processes()
            for name in self.names.values():
                subprocess.run(['userdel', name], capture_output=True)
            shutil.rmtree(self.root, ignore_errors=True)

    def kill_users_processes(self):
        """What a failed test left running as this lab's users (a
        program's grandchild outlives its worker: only the job's own
        child dies with it): userdel refuses a user in use. By process
        group as well as by pid, until several scans in a row find none:
        a fork loop's next pid is born after any one scan."""
        import psutil
        uids = {self.uid(who) for who in self.names}
        clean, deadline = 0, time.monotonic() + 30
        while clean < 3 and time.monotonic() < deadline:
            found = []
            for process in psutil.process_iter(['uids', 'status']):
                with contextlib.suppress(psutil.Error, OSError):
                    if process.info['uids'].real in uids and \
                            process.info['status'] != psutil.STATUS_ZOMBIE:
                        found.append(process.pid)
                        process.kill()
                        group = os.getpgid(process.pid)
                        # a group the users lead (never this test's own)
                        if group != os.getpgid(0) and psutil.Process(
                                group).uids().real in uids:
                            os.killpg(group, signal.SIGKILL)
            clean = 0 if found else clean + 1
            time.sleep(0.05)


@contextlib.contextmanager
def started_lab(*flags, **env):
    """A :class:`Lab` whose cluster root started (``cluster start --shared
    FLAGS``, ``env`` added to root's shell), its owner ann (she ran sudo);
    stopped, its users removed, when the block is left."""
    if os.geteuid() != 0:
        pytest.skip('only root can start a shared cluster and create Unix '
                    'users')
    if not (shutil.which('useradd') and shutil.which('userdel')):
        pytest.skip('no useradd/userdel here to create a second Unix user')
    lab = Lab()
    try:
        for who in ('ann', 'bob', 'eve'):
            lab.add_user(who)
        # ann ran `sudo dasktrain cluster start --shared`: its owner.
        lab.flags = ['--port', '0', '--dashboard-port', '0', '--gpus', '0',
                     '--cpu-slots', '3', *flags]
        with child([str(CONSOLE), 'cluster', 'start', '--shared',
                    '--shared-dir', str(lab.where.root), *lab.flags],
                   env=lab.env(SUDO_UID=str(lab.uid('ann')),
                               OWNER_MARK='root-shell', **env)) as c:
            assert c.wait(120) == 0, c.stderr()
        lab.state = json.loads((lab.where.private / 'cluster.json')
                               .read_text())
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope='module')
def lab():
    # The webhooks of these tests listen on 127.0.0.1: allowed here.
    with started_lab('--notify-allow', 'public', '--notify-allow',
                     '127.0.0.0/8') as lab:
        yield lab


def test_the_shared_place_keeps_every_user_to_their_own(lab):
    modes = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in lab.where}
    assert modes == {lab.where.root: 0o755, lab.where.record: 0o644,
                     lab.where.socket: 0o666, lab.where.jobs: 0o711,
                     lab.where.private: 0o700}
    record = json.loads(lab.where.record.read_text())
    assert record['owner'] == lab.uid('ann')
    assert 'tls' not in record and 'notify' not in record
    tls = lab.where.private / 'tls'
    assert {stat.S_IMODE(p.stat().st_mode) for p in tls.iterdir()} == {0o600}
    # No user reaches the keys, nor lists the jobs.
    for path in (tls / 'node-key.pem', lab.where.jobs):
        done = subprocess.run(['runuser', '-u', lab.names['eve'], '--',
                               'ls', str(path)], capture_output=True,
                              text=True)
        assert 'Permission denied' in done.stderr
    # Only root starts one: ann without sudo gets one line.
    code, _, err = lab.run('ann', 'cluster', 'start', '--shared',
                           '--shared-dir', str(lab.root / 'other'))
    assert (code, err) == (1, f'dasktrain cluster: error: {NEEDS_ROOT}\n')
    code, out, err = lab.run('eve', 'cluster', 'status')
    assert code == 0, err
    assert f"scheduler: {lab.state['scheduler']}" in out
    assert f'owners root, {lab.names["ann"]}; you are {lab.names["eve"]}' \
        in out


def test_a_users_command_runs_as_them_where_and_how_they_said(lab):
    bob, home = lab.names['bob'], lab.homes['bob']
    (home / 'sub').mkdir()
    os.chown(home / 'sub', lab.uid('bob'), pwd.getpwnam(bob).pw_gid)
    job_id = lab.submit('bob', '--name', 'who', '--env', 'FOO=bar', '--',
                        'sh', '-c', 'id -u; id -g; pwd; echo "$FOO $USER '
                        '$LAB_TOKEN"; umask; echo hi > mine.txt',
                        cwd=home / 'sub', LAB_TOKEN='s3cret')
    status = lab.wait_for(job_id)
    job = lab.job(job_id)
    assert status['state'] == 'finished', job.logs()
    lines = job.logs().splitlines()[1:]
    assert lines == [str(lab.uid('bob')), str(pwd.getpwnam(bob).pw_gid),
                     str(home / 'sub'), f'bar {bob} s3cret', '0077']
    assert (home / 'sub' / 'mine.txt').stat().st_uid == lab.uid('bob')
    spec = job.spec()
    assert (spec.user, spec.uid) == (bob, lab.uid('bob'))
    assert spec.host == socket.gethostname()
    # Everyone's `jobs` shows whose it is.
    code, out, err = lab.run('eve', 'jobs')
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith(job_id))
    assert row.split()[1:4] == ['who', bob, 'finished']


def test_a_jobs_files_are_its_submitters_and_nobody_elses(lab):
    job_id = lab.submit('bob', '--', 'sh', '-c', 'echo secret-output')
    lab.wait_for(job_id)
    folder = lab.where.jobs / job_id
    owners = {p.name: (p.stat().st_uid, stat.S_IMODE(p.stat().st_mode))
              for p in folder.iterdir()}
    bob = lab.uid('bob')
    assert owners == {'job.json': (0, 0o600), 'status.json': (0, 0o600),
                      'env.json': (0, 0o600), 'output.log': (bob, 0o600),
                      'out': (bob, 0o700)}
    assert stat.S_IMODE(folder.stat().st_mode) == 0o711

    def as_(who, *argv):
        return subprocess.run(['runuser', '-u', lab.names[who], '--',
                               *argv], capture_output=True, text=True)
    assert 'secret-output' in as_('bob', 'cat', str(folder / 'output.log'))\
        .stdout
    assert as_('bob', 'ls', str(folder / 'out')).returncode == 0
    for path in ('output.log', 'out', 'job.json', 'env.json'):
        assert 'Permission denied' in as_('eve', 'cat',
                                          str(folder / path)).stderr
    assert 'Permission denied' in as_('bob', 'cat',
                                      str(folder / 'job.json')).stderr
    # Through the front door: bob reads his logs, eve cannot.
    code, out, _ = lab.run('bob', 'logs', job_id)
    assert code == 0 and 'secret-output' in out
    code, out, err = lab.run('eve', 'logs', job_id)
    assert (code, out) == (1, '')
    assert err == (f'dasktrain logs: error: job {job_id} belongs to '
                   f"{lab.names['bob']}; only {lab.names['bob']} or the "
                   f"cluster's owner (root, {lab.names['ann']}) can read "
                   'it\n')


def test_only_the_submitter_or_the_clusters_owner_cancels(lab):
    jobs = [lab.submit(who, '--grace', '2', '--', 'sh', '-c',
                       'echo pid $$; sleep 300')
            for who in ('bob', 'bob', 'eve')]
    for job_id in jobs:
        lab.wait_for(job_id, ('running',))
    bob, eve = lab.names['bob'], lab.names['eve']
    code, _, err = lab.run('eve', 'cancel', jobs[0])
    assert code == 1
    assert err == (f'dasktrain cancel: error: job {jobs[0]} belongs to '
                   f"{bob}; only {bob} or the cluster's owner (root, "
                   f"{lab.names['ann']}) can cancel it\n")
    code, _, err = lab.run('bob', 'cancel', jobs[2])  # eve's
    assert code == 1 and f'belongs to {eve}' in err
    assert lab.job(jobs[0]).status()['state'] == 'running'
    assert not (lab.where.jobs / jobs[0] / 'cancel').exists()
    # root, and ann (the cluster's owner), and eve her own.
    for who, job_id in (('root', jobs[0]), ('ann', jobs[1]),
                        ('eve', jobs[2])):
        pid = _pid(lab.job(job_id))
        code, out, err = lab.run(who, 'cancel', job_id)
        assert (code, out) == (0, f'{job_id}: cancelled\n'), err
        wait_until(lambda pid=pid: not alive(pid), 10, f'{pid} gone')


def _pid(job):
    """The pid a job's program printed (``echo pid $$``)."""
    def printed():
        return [line for line in job.logs().splitlines()
                if line.startswith('pid ')]
    wait_until(printed, 30, f'{job.id} to print its pid')
    return int(printed()[0].split()[1])


def test_a_forged_request_does_not_change_whose_job_it_is(lab):
    forge = """
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(json.dumps(json.loads(sys.argv[2])).encode() + b'\\n')
s.shutdown(socket.SHUT_WR)
print(s.makefile().read())
"""
    bob = lab.uid('bob')

    def send(who, request):
        name = lab.names[who]
        code = (f'import json, os, pwd, socket, sys\n'
                f'e = pwd.getpwnam({name!r})\n'
                'os.setgroups([]); os.setgid(e.pw_gid); os.setuid(e.pw_uid)'
                f'\n{forge}')
        with child([sys.executable, '-c', code, str(lab.where.socket),
                    json.dumps(request)], cwd=lab.homes[who]) as c:
            assert c.wait(30) == 0, c.stderr()
            return json.loads(c.stdout())
    claim = dict(_program(cwd=str(lab.homes['eve'])), uid=bob,
                 user=lab.names['bob'])
    answer = send('eve', claim)
    assert answer == {'ok': False, 'error': 'submit takes no uid'}
    answer = send('eve', _program(cwd=str(lab.homes['eve']),
                                  name=lab.names['bob']))
    assert answer['ok'], answer
    spec = lab.job(answer['id']).spec()
    assert (spec.uid, spec.user) == (lab.uid('eve'), lab.names['eve'])
    assert send('eve', {'op': 'cancel', 'id': '../private'}) == {
        'ok': False, 'error': "not a job id: '../private'"}
    assert lab.wait_for(answer['id'])['state'] == 'finished'


def test_root_reads_no_file_a_user_planted_in_their_outputs(lab):
    secret = lab.root / 'root-only.json'
    secret.write_text(json.dumps([{'epoch': 7, 'elapsed_time': 1.0,
                                   'validation/main/accuracy': 0.4242}]))
    os.chmod(secret, 0o600)
    job_id = lab.submit('bob', '--', 'sh', '-c', 'sleep 300')
    lab.wait_for(job_id, ('running',))
    out = lab.where.jobs / job_id / 'out'
    subprocess.run(['runuser', '-u', lab.names['bob'], '--', 'ln', '-s',
                    str(secret), str(out / 'log')], check=True)
    job = lab.job(job_id)
    assert job.log_rows() == [] and job.status()['accuracy'] is None
    code, out_text, err = lab.run('bob', 'jobs')
    assert code == 0 and '0.4242' not in out_text and '7/' not in out_text
    # A FIFO in its place: nothing waits on it.
    (out / 'log').unlink()
    subprocess.run(['runuser', '-u', lab.names['bob'], '--', 'mkfifo',
                    str(out / 'log')], check=True)
    began = time.monotonic()
    code, _, err = lab.run('eve', 'jobs')
    assert code == 0, err
    assert time.monotonic() - began < 30
    assert lab.run('bob', 'cancel', job_id)[0] == 0


@contextlib.contextmanager
def second_worker(lab, slots=2):
    """A worker joined to the lab's cluster by hand, as root, as on a
    second machine (security.md): the cluster's keys, its preload."""
    tls = lab.state['tls']
    env = dict(os.environ, DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION='1')
    with child([sys.executable, '-m', 'distributed.cli.dask_worker',
                lab.state['scheduler'], '--preload',
                'dasktrain.jobs.worker.preload', '--nthreads',
                str(slots + 1), '--resources', f'CPU={slots}', '--host',
                '127.0.0.1', '--dashboard-address', '127.0.0.1:0',
                '--local-directory', str(lab.root / 'second-worker'),
                '--tls-ca-file', tls['tls_ca_file'], '--tls-cert',
                tls['tls_cert'], '--tls-key', tls['tls_key']],
               env=env) as worker:
        from dasktrain.cluster.local import connect, security_from
        with connect(lab.state['scheduler'], security_from(**tls)) as c:
            c.wait_for_workers(2, timeout=60)
        yield worker


def test_a_job_across_workers_runs_its_ranks_as_its_submitter(
        lab, tmp_path, float64):
    # Scale-out on a shared cluster: the ranks are the job's program, as
    # its submitter, on two workers (the second joined by hand), joined
    # through a rendezvous of their own; the results of the same two
    # replicas in one process.
    import psutil

    from dasktrain.config import TrainConfig
    from dasktrain.run.train import train
    who = 'bob' if python_runs_as(lab, 'bob') else 'root'
    data = lab.data('gang-data', seed=8)
    args = ['--model', 'tiny', '--epochs', '2', '--batch-size', '4',
            '--lr', '0.01', '--train-size', '40', '--test-size', '16',
            '--mode', 'ipm', '--mix-every', '3', '--data-dir', str(data)]
    here = train(TrainConfig(model='tiny', epochs=2, batch_size=4, lr=0.01,
                             train_size=40, test_size=16, mode='ipm',
                             mix_every=3, data_dir=str(data),
                             devices=('@numpy',) * 2, in_process=True,
                             out=str(tmp_path / 'here'), progress=False))
    with second_worker(lab):
        job_id = lab.submit(who, '--', *args, '--workers', '2',
                            '--devices', 'cpu', preload='chainer')
        status = lab.wait_for(job_id, timeout=240)
        # A long one, cancelled: every rank stops, on both workers.
        long = lab.submit(who, '--', *args[:2], '--epochs', '500',
                          *args[4:], '--workers', '2', '--devices', 'cpu',
                          preload='chainer')
        folder = lab.job(long).folder
        wait_until(lambda: 'epoch' in (folder / 'out' / 'log').read_text()
                   if (folder / 'out' / 'log').exists() else False, 120,
                   'its first epoch')
        assert lab.run(who, 'cancel', long)[0] == 0
        assert lab.wait_for(long, timeout=60)['state'] == 'cancelled'
        wait_until(lambda: not [p for p in psutil.process_iter(['cmdline'])
                                if str(folder) in ' '.join(
                                    p.info['cmdline'] or ())], 30,
                   'no rank left')
        # A rank's mistake fails the job with that rank's one line.
        bad = lab.submit(who, '--', *args[:8], '--train-size', '1',
                         *args[10:], '--workers', '2', '--devices', 'cpu',
                         preload='chainer')
        failed = lab.wait_for(bad, timeout=120)
        assert failed['state'] == 'failed'
        assert re.fullmatch(r'rank [01]: error: 2 replicas need at least as '
                            r'many training images, got train_size 1',
                            failed['error']), failed['error']
    job = lab.job(job_id)
    assert status['state'] == 'finished', job.logs()
    rows = json.loads((job.folder / 'out' / 'log').read_text())
    assert len(rows) == len(here['log']) == 2
    for mine, theirs in zip(here['log'], rows):
        for key in ('main/loss', 'validation/main/loss',
                    'validation/main/accuracy'):
            assert theirs[key] == pytest.approx(mine[key], rel=1e-9), key
    uid = lab.uid(who)
    assert (job.folder / 'out' / 'log').stat().st_uid == uid
    assert (job.folder / 'rank1.log').stat().st_uid == uid
    # Their rendezvous ran as the submitter too, never as root.
    assert (job.folder / 'rendezvous.log').stat().st_uid == uid
    assert 'rank 1 of 2' in (job.folder / 'rank1.log').read_text()
    assert '2 ranks on' in job.logs()


def python_runs_as(lab, who):
    """Whether this interpreter can run as ``who`` here (it may live
    where another user cannot exec it, as under /root)."""
    return subprocess.run(['runuser', '-u', lab.names[who], '--',
                           sys.executable, '-c', 'pass'],
                          capture_output=True).returncode == 0


def test_a_search_is_jobs_of_the_shared_queue(lab):
    # bob's study: each trial a job of the shared queue, his, in the
    # queue's order with everyone's; the study's own files in his jobs
    # dir, which his trials (run as him) write to.
    data = lab.data('tune-data', seed=6)
    mine = lab.homes['bob'] / 'jobs'
    space = lab.homes['bob'] / 'space.yaml'
    space.write_text('lr: {type: float, low: 0.001, high: 0.1}\n')
    code, out, err = lab.run(
        'bob', 'tune', '--space', str(space), '--trials', '2',
        '--parallel', '1', '--gpus', '0', '--', '--model', 'tiny',
        '--epochs', '1', '--batch-size', '40', '--train-size', '200',
        '--test-size', '40', '--devices', 'cpu', '--data-dir', str(data),
        timeout=300, DASKTRAIN_JOBS_DIR=str(mine),
        preload='chainer,dasktrain.training.models,optuna,'
                'optuna.storages.journal,yaml,dasktrain.tuning.study,'
                'dasktrain.commands.tune,dasktrain.results')
    assert code == 0, err
    ids = [line.split()[3] for line in out.splitlines()
           if line.startswith('trial ') and ': job ' in line]
    assert len(ids) == 2, out
    for job_id in ids:
        spec = lab.job(job_id).spec()  # root's file, in the shared queue
        assert (spec.user, spec.uid) == (lab.names['bob'],
                                               lab.uid('bob'))
        assert spec.module == 'dasktrain.tuning.trials'
        assert spec.trial['study'] == 'space'
    study = mine / 'studies' / 'space' / 'study.json'
    assert study.stat().st_uid == lab.uid('bob')
    states = {lab.job(i).status()['state'] for i in ids}
    if python_runs_as(lab, 'bob'):
        assert states == {'finished'} and 'best: trial ' in out, out
    else:  # the trials cannot start their program here: one line each
        assert states == {'failed'}
        assert all('cannot start' in (lab.job(i).status()['error'] or '')
                   for i in ids)
        assert 'best: none yet' in out


def test_a_users_files_are_read_by_their_client_never_by_root(lab):
    # root's file named as a model: the user's client cannot read it, and
    # nothing is queued or written.
    private = lab.root / 'private_net.py'
    private.write_text('raise SystemExit("root\'s code ran")\n')
    os.chmod(private, 0o600)
    before = sorted(os.listdir(lab.where.jobs))
    code, _, err = lab.run('bob', 'submit', '--gpus', '0', '--', '--model',
                           f'{private}:Net', preload='chainer,'
                           'dasktrain.training.models')
    assert code == 1 and err.startswith(
        f'dasktrain submit: error: --model {private}:Net: importing '), err
    assert 'Permission denied' in err and 'Traceback' not in err
    # A failed submit leaves nothing: a dependency that does not exist.
    code, _, err = lab.run('bob', 'submit', '--gpus', '0', '--after',
                           'no-such-job', '--', 'true')
    assert (code, err) == (1, "dasktrain submit: error: --after: no job "
                              f"'no-such-job' in {lab.where.jobs}; "
                              '`dasktrain jobs` lists them\n')
    assert sorted(os.listdir(lab.where.jobs)) == before


# A user's own model: one linear layer.
LINEAR = """import chainer, chainer.links as L
class Net(chainer.Chain):
    def __init__(self, n_classes=10):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(None, n_classes)
    def forward(self, x):
        return self.l(x)
"""


def test_a_training_job_through_the_shared_queue(lab):
    data = lab.data('data', seed=5)
    net = lab.root / 'net.py'
    net.write_text(LINEAR)
    train = ['--', '--model', f'{net}:Net', '--epochs', '1',
             '--batch-size', '40', '--train-size', '200', '--test-size',
             '40', '--devices', 'cpu', '--data-dir', str(data)]
    # root's own: its model copied whole into the job, its spec given on
    # stdin to a child that could not read job.json as its user.
    job_id = lab.submit('root', *train, preload='chainer,'
                        'dasktrain.training.models')
    net.write_text('raise SystemExit("edited after submit")\n')
    status = lab.wait_for(job_id, timeout=120)
    job = lab.job(job_id)
    assert status['state'] == 'finished', job.logs()
    assert (job.folder / 'model' / 'net.py').read_text().startswith('import')
    code, out, err = lab.run('root', 'result', job_id)
    assert code == 0 and 'validation/main/accuracy: ' in out, err
    # A user's, where this machine lets a second user run its Python.
    ok = subprocess.run(['runuser', '-u', lab.names['bob'], '--',
                         sys.executable, '-c', 'pass'], capture_output=True)
    if ok.returncode:
        pytest.skip(f'{sys.executable} cannot be run by a second user here '
                    f'(it lives under {Path(sys.executable).resolve()}): a '
                    "user's training job would fail to start, in one line")
    job_id = lab.submit('bob', *train[:2], 'tiny', *train[4:])
    assert lab.wait_for(job_id, timeout=120)['state'] == 'finished'
    assert lab.job(job_id).folder.joinpath('out', 'log').stat().st_uid == \
        lab.uid('bob')


def test_a_users_job_runs_in_their_environment_not_roots(lab):
    # What bob's client sent, the queue's variables and bob's identity:
    # nothing of root's shell that started the cluster, nor its sudo.
    job_id = lab.submit('bob', '--', 'sh', '-c', 'env',
                        SUBMITTER_MARK='bob-shell')
    assert lab.wait_for(job_id, timeout=120)['state'] == 'finished'
    env = dict(line.split('=', 1) for line in
               lab.job(job_id).logs().splitlines()
               if '=' in line and not line.startswith('==='))
    entry = pwd.getpwnam(lab.names['bob'])
    assert env['SUBMITTER_MARK'] == 'bob-shell'
    assert (env['USER'], env['LOGNAME'], env['HOME']) == (
        entry.pw_name, entry.pw_name, entry.pw_dir)
    assert 'OWNER_MARK' not in env and 'SUDO_UID' not in env
    share = job_threads(os.sched_getaffinity(0), 0, {'CPU': 3})
    assert env['OMP_NUM_THREADS'] == env['OPENBLAS_NUM_THREADS'] == \
        str(share) or 'OMP_NUM_THREADS' in lab.env()
    assert env['CUDA_VISIBLE_DEVICES'] == ''


def test_the_queue_works_for_every_user(lab):
    # bob's job, eve's after it; `jobs` shows both with their times to
    # anyone; eve is told when hers ends; logs --follow, result --wait,
    # gpus and requeue for a user.
    hook = Hook()  # posted by nobody, not root
    try:
        go = lab.homes['bob'] / 'go'  # it runs until the test says go
        first = lab.submit('bob', '--time', '1h', '--', 'sh', '-c',
                           f'echo started; while [ ! -e {go} ]; do sleep '
                           '0.2; done; echo done')
        second = lab.submit('eve', '--after', first, '--notify', hook.url,
                            '--', 'sh', '-c', 'exit 3')
        lab.wait_for(first, ('running',))
        code, out, err = lab.run('ann', 'jobs')
        assert code == 0, err
        rows = {line.split()[0]: line for line in out.splitlines()}
        assert 'end ~' in rows[first] and lab.names['bob'] in rows[first]
        assert f'after job {first}' in rows[second]
        assert '#1, start ~' in rows[second]
        code, out, err = lab.run('bob', 'gpus')
        assert code == 0, err
        assert f'{first} (sh)' in out and lab.names['bob'] in out
        go.touch()
        code, out, err = lab.run('bob', 'logs', '--follow', first)
        assert (code, out.splitlines()[1:]) == (0, ['started', 'done']), err
        code, _, err = lab.run('eve', 'result', '--wait', second)
        assert (code, err) == (1, f'dasktrain result: error: job {second} '
                                  'failed: exit 3\n')
        wait_until(lambda: hook.posts, 30, 'the webhook')
        assert hook.posters == [pwd.getpwnam('nobody').pw_uid]
        text = hook.posts[0][1]['text']
        assert text.startswith(f"job {second} (sh) of {lab.names['eve']} "
                               'failed after ')
        assert text.endswith(': exit code 3')
    finally:
        hook.close()
    code, out, err = lab.run('bob', 'requeue', second)
    assert code == 1 and f'belongs to {lab.names["eve"]}' in err
    code, out, err = lab.run('eve', 'requeue', second)
    assert (code, out) == (0, f"{second}: queued on {lab.state['scheduler']}"
                              '\n'), err
    assert lab.wait_for(second)['state'] == 'failed'


def test_a_users_program_dies_with_a_killed_worker(lab):
    # Last: it kills the worker (its nanny starts another).
    import psutil
    job_id = lab.submit('bob', '--', 'sh', '-c', 'echo pid $$; exec sleep '
                        '300')
    lab.wait_for(job_id, ('running',))
    pid = _pid(lab.job(job_id))
    program = psutil.Process(pid)
    assert program.uids().real == lab.uid('bob')
    keeper = program.parent()  # the job's keeper, root's
    assert 'dasktrain.keeper' in keeper.cmdline()
    assert keeper.uids().real == 0 and keeper.environ() == {}
    worker = keeper.parent()  # the worker process, root's
    assert worker.uids().real == 0
    with contextlib.suppress(psutil.NoSuchProcess):
        worker.kill()
    wait_until(lambda: not alive(pid), 15, "bob's program to die")
    assert lab.wait_for(job_id, timeout=120)['state'] == 'lost'


def test_a_stopped_shared_cluster_brings_back_every_users_jobs(lab):
    # Last: it stops and starts the cluster again.
    job_id = lab.submit('bob', '--', 'sh', '-c', 'exec sleep 300')
    lab.wait_for(job_id, ('running',))
    shared = ['--shared', '--shared-dir', str(lab.where.root)]
    with child([str(CONSOLE), 'cluster', 'stop', '--requeue', *shared],
               env=lab.env()) as c:
        assert c.wait(120) == 0, c.stderr()
        assert f'job {job_id}: queued' in c.stdout()
    code, _, err = lab.run('bob', 'jobs')
    assert (code, err) == (1, f'dasktrain jobs: error: the shared queue at '
                              f'{lab.where.socket} is not there (No such '
                              'file or directory); is the shared cluster '
                              'running? (`sudo dasktrain cluster start '
                              '--shared` starts it)\n')
    with child([str(CONSOLE), 'cluster', 'start', *shared, '--port', '0',
                '--dashboard-port', '0', '--gpus', '0', '--cpu-slots', '3'],
               env=lab.env(SUDO_UID=str(lab.uid('ann')))) as c:
        assert c.wait(120) == 0, c.stderr()
        assert f'requeued job {job_id} (its cluster had gone)' in \
            c.stdout()
    lab.state = json.loads((lab.where.private / 'cluster.json').read_text())
    lab.wait_for(job_id, ('running',))
    assert lab.run('ann', 'cancel', job_id)[:2] == (0, f'{job_id}: '
                                                       'cancelled\n')


def test_a_running_job_is_steered_by_its_submitter_only(lab):
    # root's training job (a user's needs a Python every user can run):
    # 2,000 epochs of 5 iterations, stopped by request long before.
    net = lab.root / 'steered.py'
    net.write_text(LINEAR)
    data = lab.data('steered-data', seed=5)
    job_id = lab.submit('root', '--', '--model', f'{net}:Net', '--epochs',
                        '2000', '--batch-size', '40', '--train-size', '200',
                        '--test-size', '40', '--devices', 'cpu',
                        '--optimizer', 'momentum-sgd', '--data-dir',
                        str(data), preload='chainer,'
                        'dasktrain.training.models')
    job = lab.job(job_id)
    wait_until(lambda: len(job.log_rows()) >= 1, 120, 'an epoch')
    code, out, err = lab.run('eve', 'ctl', job_id, 'stop')
    assert (code, out) == (1, ''), err
    assert err == f'dasktrain ctl: error: job {job_id} belongs to root; ' \
        "only root or the cluster's owner (root, " \
        f"{lab.names['ann']}) can read it\n"
    # The cluster's owner reads it and may cancel it, but steers only
    # jobs of her own: the job's owner alone changes how it trains.
    code, out, err = lab.run('ann', 'ctl', job_id, 'snapshot')
    assert (code, out) == (1, ''), err
    assert err == f'dasktrain ctl: error: job {job_id} was submitted by ' \
        f"root; only root can steer it (you are {lab.names['ann']})\n"
    code, out, err = lab.run('root', 'ctl', job_id, 'set', 'lr=0.02')
    assert code == 0 and out.startswith(f'{job_id}: lr 0.05 -> 0.02 '), err
    code, out, err = lab.run('root', 'ctl', job_id, 'stop')
    assert code == 0, err
    assert out.splitlines()[-1] == \
        f'job {job_id}: finished (stopped by request)'
    assert job.status()['epoch'] < 2000
    assert any(r.get('lr') == 0.02 for r in job.log_rows())
    code, out, err = lab.run('eve', 'jobs', '--all')
    line = next(x for x in out.splitlines() if x.startswith(job_id))
    assert 'finished (stopped by request)' in line, out
