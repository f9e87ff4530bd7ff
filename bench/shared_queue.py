"""Another user's wait on a shared queue that one user loads:
``sudo .venv/bin/python bench/shared_queue.py`` (as root).

For two versions of dasktrain, in the same run on the same machine
(``--before REF``, default ``main``: ``git archive`` of that commit, run
with ``PYTHONPATH``; and this checkout), it starts a shared cluster
(root, a place of its own, free ports, one CPU slot, the version's
defaults beside ``--max-queued-per-user`` where it has one), creates two
Unix users (the loader and the other), and:

1. queues ``--jobs`` command jobs as the loader through the front door
   (``sleep``: one runs, the others wait);
2. measures the other user's ``ping`` and ``jobs`` requests (a connection
   each, as the client makes them), quiet;
3. the same under load, all of it the loader's: ``--loops`` loops asking
   for ``jobs`` without a pause, and ``--idle`` connections held open
   (each opened again, at most once a second, when the server closes it);
   the scheduler process's CPU meanwhile.

The clients are this process forked, then the user (no interpreter to
find): the wait measured is the server's, from connect to the last byte
of the answer. Prints one markdown table, with the machine.
"""
import argparse
import contextlib
import json
import os
import pwd
import resource
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ask(path, message, timeout=300.0):
    """One request, its answer (a dict); as the client does."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(json.dumps(message).encode() + b'\n')
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(1 << 16):
            chunks.append(chunk)
    return json.loads(b''.join(chunks) or b'{}')


def as_user(name, work, *args):
    """Fork: the child becomes ``name`` and runs ``work(*args)``, whose
    return value (JSON) comes back through a pipe; (pid, read end)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))
            entry = pwd.getpwnam(name)
            os.setgroups([])
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            result = work(*args)
            with os.fdopen(write, 'w') as f:
                json.dump(result, f)
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    return pid, read


def result_of(pid, read):
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return json.loads(text) if text else None


def submit_many(path, count):
    request = {'op': 'submit', 'request': {'gpus': 0, 'name': 'load',
               'program': {'command': ['sleep', '3600'], 'cwd': '/tmp',
                           'env': {'PATH': '/usr/bin:/bin'},
                           'grace': 1.0, 'requeue': False}}}
    refused = []
    for _ in range(count):
        answer = ask(path, request)
        if not answer.get('ok'):
            refused.append(answer.get('error'))
    return {'refused': len(refused), 'why': refused[:1]}


def measure(path, samples):
    """The other user: ``samples`` pings and jobs requests, each timed."""
    found = {'ping': [], 'jobs': [], 'rows': 0, 'errors': 0}
    for _ in range(samples):
        for op in ('ping', 'jobs'):
            began = time.perf_counter()
            try:
                answer = ask(path, {'op': op})
            except OSError:
                found['errors'] += 1
                continue
            found[op].append(time.perf_counter() - began)
            if op == 'jobs':
                found['rows'] = len(answer.get('rows') or ())
            if not answer.get('ok'):
                found['errors'] += 1
        time.sleep(0.05)
    return found


def jobs_loop(path):
    while True:
        with contextlib.suppress(OSError, ValueError):
            ask(path, {'op': 'jobs'})


def idle(path, count):
    """Hold ``count`` connections open, sending nothing; one the server
    closes is opened again a second later."""
    slots, opened = [None] * count, [0.0] * count
    while True:
        now = time.monotonic()
        for i in range(count):
            if slots[i] is None and now - opened[i] >= 1.0:
                s = socket.socket(socket.AF_UNIX)
                s.setblocking(False)
                with contextlib.suppress(OSError):
                    s.connect(path)
                slots[i], opened[i] = s, now
        live = [s for s in slots if s is not None]
        ready, _, _ = select.select(live, [], [], 0.05) if live and \
            len(live) < 1024 else (_polled(live), None, None)
        for s in ready:
            with contextlib.suppress(OSError):
                if s.recv(1 << 16):
                    continue
            i = slots.index(s)
            s.close()
            slots[i] = None


def _polled(sockets):
    poll = select.poll()
    by_fd = {s.fileno(): s for s in sockets}
    for fd in by_fd:
        poll.register(fd, select.POLLIN | select.POLLHUP)
    return [by_fd[fd] for fd, _ in poll.poll(50)]


def cpu_of(pid, seconds):
    import psutil
    process = psutil.Process(pid)
    process.cpu_percent(None)
    time.sleep(seconds)
    return process.cpu_percent(None)


def scheduler_pid(place):
    import psutil
    state = json.loads((place / 'private' / 'cluster.json').read_text())
    keeper = psutil.Process(state['pids'][0])
    return next(p.pid for p in keeper.children(recursive=True)
                if 'scheduler' in ' '.join(p.cmdline()))


def run(version, pythonpath, users, args, work):
    """One version's measurements: {phase: measurements}."""
    place = work / f'{version}-place'
    env = dict(os.environ, DASKTRAIN_SHARED_PRIVATE_PYTHON='1',
               DASKTRAIN_HOME=str(work / f'{version}-home'))
    env.pop('PYTHONPATH', None)
    if pythonpath:
        env['PYTHONPATH'] = str(pythonpath)
    cli = [sys.executable, '-m', 'dasktrain.cli']
    more = [] if pythonpath else ['--max-queued-per-user',
                                  str(args.jobs + 10)]
    subprocess.run(cli + ['cluster', 'start', '--shared', '--shared-dir',
                          str(place), '--port', '0', '--dashboard-port', '0',
                          '--gpus', '0', '--cpu-slots', '1', *more],
                   env=env, check=True, capture_output=True, cwd=work)
    path = str(place / 'queue.sock')
    os.chmod(place, 0o755)
    found = {}
    try:
        began = time.monotonic()
        found['submit'] = result_of(*as_user(users[0], submit_many, path,
                                             args.jobs))
        found['submit']['seconds'] = time.monotonic() - began
        time.sleep(5)  # the queue takes them in
        pid = scheduler_pid(place)
        found['quiet'] = result_of(*as_user(users[1], measure, path,
                                            args.samples))
        load = [as_user(users[0], jobs_loop, path)
                for _ in range(args.loops)]
        load.append(as_user(users[0], idle, path, args.idle))
        try:
            time.sleep(3)
            other = as_user(users[1], measure, path, args.samples)
            found['cpu'] = cpu_of(pid, 5)
            found['loaded'] = result_of(*other)
        finally:
            for child, read in load:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
                os.close(read)
    finally:
        subprocess.run(cli + ['cluster', 'stop', '--shared',
                              '--shared-dir', str(place)],
                       env=env, capture_output=True, cwd=work)
    return found


def quantile(values, q):
    if not values:
        return float('nan')
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 \
        else values[0]


def table(results, args):
    sys.path.insert(0, str(ROOT))
    from dasktrain.bench.benchmarks import machine
    lines = [f'Another user\'s wait on a shared queue holding {args.jobs:,} '
             f'queued jobs of one user, quiet and under that user\'s '
             f'{args.loops} loops of `jobs` and {args.idle:,} idle '
             'connections', '', f'Machine: {machine()}', '',
             '| version | load | ping p50 | ping p95 | jobs p50 | jobs p95 '
             '| rows per `jobs` | scheduler CPU | submits refused |',
             '|---|---|---:|---:|---:|---:|---:|---:|---:|']
    for version, found in results.items():
        for phase in ('quiet', 'loaded'):
            m = found[phase]
            cpu = f"{found['cpu']:.0f} %" if phase == 'loaded' else '-'
            lines.append(
                f"| {version} | {phase} | "
                f"{1000 * quantile(m['ping'], 50):.1f} ms | "
                f"{1000 * quantile(m['ping'], 95):.1f} ms | "
                f"{1000 * quantile(m['jobs'], 50):.1f} ms | "
                f"{1000 * quantile(m['jobs'], 95):.1f} ms | {m['rows']:,} | "
                f"{cpu} | {found['submit']['refused']} |")
    return '\n'.join(lines)


def make_users(count):
    names = []
    for i in range(count):
        name = f'dtbench{i}{uuid.uuid4().hex[:5]}'
        subprocess.run(['useradd', '--system', '--no-create-home', name],
                       check=True, capture_output=True)
        names.append(name)
    return names


def remove_users(names):
    import psutil
    uids = {pwd.getpwnam(n).pw_uid for n in names}
    for process in psutil.process_iter(['uids']):
        with contextlib.suppress(psutil.Error):
            if process.info['uids'].real in uids:
                process.kill()
    for name in names:
        subprocess.run(['userdel', name], capture_output=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--before', default='main', metavar='REF',
                        help='the version to compare with (a git ref of '
                             'this checkout; default: %(default)s)')
    parser.add_argument('--jobs', type=int, default=2000)
    parser.add_argument('--loops', type=int, default=4)
    parser.add_argument('--idle', type=int, default=1000)
    parser.add_argument('--samples', type=int, default=40)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error('needs root: it starts a shared cluster and creates '
                     'two Unix users')
    work = Path(tempfile.mkdtemp(prefix='dasktrain-bench-queue-'))
    os.chmod(work, 0o755)
    before = work / 'before'
    before.mkdir()
    archive = subprocess.run(['git', '-C', str(ROOT), 'archive', args.before,
                              'dasktrain'], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=__import__('io').BytesIO(archive)) as tar:
        tar.extractall(before, filter='data')
    users = make_users(2)
    results = {}
    try:
        results[f'before ({args.before})'] = run('before', before, users,
                                                 args, work)
        results['after (this checkout)'] = run('after', None, users, args,
                                               work)
    finally:
        remove_users(users)
        shutil.rmtree(work, ignore_errors=True)
    print(table(results, args))
    return 0


if __name__ == '__main__':
    sys.exit(main())
