"""What another user of the machine can do to your own runs, tried: eve,
a real Unix user the test creates, against runs, launches and a
ChainerUI server of the test's own user (root here: the victim), real
processes, loopback only. Each numbered finding of the review, replayed,
now holds:

2. ChainerUI's server answers its owner alone: eve neither reads a run
   through it nor steers one (a stop written into its commands file);
3. ``launch`` and ``train`` refuse an output folder eve could change
   (hers, or one she may write), in one line; the ranks' ``import
   chainermn`` folder is private and outside it; no log is written
   through a symlink;
4. ``launch``'s ranks on one machine meet over Unix sockets eve cannot
   reach, and a run's throwaway workers serve ``/health`` alone (Dask's
   pages show a failed task's arguments);
6. eve holds no lock that hangs a run's answers or ``ctl``, and a
   commands file nested 100,000 deep is said, not fatal.

The shared queue's doors: ``tests/jobs/test_shared_doors.py``."""
import json
import os
import pwd
import signal
import subprocess
import sys
import threading
import time

import pytest
from children import child
from test_chainerui import chainerui_env, serving  # noqa: F401 (fixture)
from test_cluster import wait_until
from test_shared import Lab, as_user, running_as
from test_shared_doors import listening, probe

from dasktrain.cli import main

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope='module')
def lab():
    """eve, a Unix user of this machine, and a folder every user may
    traverse; removed (her processes killed) at the end."""
    if os.geteuid() != 0:
        pytest.skip('only root can create a second Unix user')
    lab = Lab()
    try:
        lab.add_user('eve')
        yield lab
    finally:
        lab.close()


def as_eve(lab, *argv):
    return subprocess.run(['runuser', '-u', lab.names['eve'], '--', *argv],
                          capture_output=True, text=True)


def eve_owns(lab, path):
    entry = pwd.getpwnam(lab.names['eve'])
    os.chown(path, entry.pw_uid, entry.pw_gid)


# ------------------------------------------------------------------- 2

def try_chainerui(api, out):
    """eve, at the owner's ChainerUI: its projects, a run's curves, a
    stop sent to that run; what each answered."""
    import requests
    got = {'projects': requests.get(f'{api}/projects', timeout=30)}
    got['results'] = requests.get(f'{api}/projects/1/results', timeout=30)
    got['stop'] = requests.post(f'{api}/projects/1/results/1/commands',
                                json={'name': 'stop'}, timeout=30)
    got['rebound'] = requests.get(f'{api}/projects', timeout=30, headers={
        'Host': 'evil.example:' + api.split(':')[2].split('/')[0]})
    got['token'] = requests.get(api.replace('/api/v1', '/?token=guess'),
                                timeout=30, allow_redirects=False)
    return {what: [r.status_code, r.text[:300]] for what, r in got.items()}


def test_2_chainerui_answers_its_owner_alone(lab, chainerui_env):  # noqa: F811
    runs = lab.root / 'runs'
    out = runs / 'mine'
    out.mkdir(parents=True)
    (out / 'log').write_text(json.dumps([{'epoch': 1, 'iteration': 10,
                                          'main/loss': 0.4242}]))
    (out / '.chainerui_commands').write_text('{"job_status": "running"}')
    with serving(runs, lab.root / 'home') as (api, http):
        # Its owner, with the token the server printed on their terminal.
        results = http.get(f'{api}/projects/1/results', timeout=30).json()
        assert results['results'][0]['pathName'] == str(out)
        # eve, without it: nothing answers, nothing is written.
        seen = as_user(lab, 'eve', try_chainerui, api, str(out))
        assert {what: code for what, (code, _) in seen.items()} == {
            'projects': 403, 'results': 403, 'stop': 403, 'rebound': 403,
            'token': 403}, seen
        assert '0.4242' not in json.dumps(seen)
        assert not (out / 'commands').exists()
        # The token in the address becomes the page's cookie.
        base = api.replace('/api/v1', '/')
        token = http.headers['Authorization'].split()[1]
        import requests
        page = requests.Session()
        first = page.get(f'{base}?token={token}', timeout=30,
                         allow_redirects=False)
        assert first.status_code == 303 and first.headers['Location'] == '/'
        assert 'HttpOnly' in first.headers['Set-Cookie'] and \
            'SameSite=Strict' in first.headers['Set-Cookie']
        assert '<title>ChainerUI</title>' in page.get(base, timeout=30).text


# ------------------------------------------------------------------- 3

RANK = ('import os, stat; p = os.environ["PYTHONPATH"].split(os.pathsep)[0];'
        ' s = os.stat(p); print("shim", p, oct(stat.S_IMODE(s.st_mode)), '
        's.st_uid)')


def test_3_a_run_refuses_a_folder_another_user_can_change(lab, tmp_path):
    victim = lab.root / 'victim.txt'
    victim.write_text('precious\n')
    scratch = lab.root / 'scratch'  # a shared scratch space
    scratch.mkdir(mode=0o1777)
    os.chmod(scratch, 0o1777)
    # eve makes the folder bob will name, and plants links in it.
    theirs = scratch / 'run'
    assert as_eve(lab, 'mkdir', '-m', '777', str(theirs)).returncode == 0
    for name in ('rank0.log', 'run.lock'):
        assert as_eve(lab, 'ln', '-s', str(victim),
                      str(theirs / name)).returncode == 0
    ours = lab.root / 'group'  # root's, but eve's group may write it
    ours.mkdir()
    os.chown(ours, 0, pwd.getpwnam(lab.names['eve']).pw_gid)
    os.chmod(ours, 0o775)
    eve = lab.names['eve']
    for folder, why in ((theirs, f'(drwxrwxrwx, owner {eve}, group {eve}) '
                                 f'is owned by {eve}'),
                        (ours, f'(drwxrwxr-x, owner root, group {eve}) is '
                               f'writable by the group {eve}')):
        for argv in (['launch', '-n', '1', '--out', str(folder), '--',
                      'true'],
                     ['train', '--dataset', 'sample', '--model', 'tiny',
                      '--epochs', '1', '--devices', 'cpu', '--out',
                      str(folder)]):
            with child(*argv, cwd=tmp_path) as c:
                assert c.wait(120) == 1, (argv, c.stderr())
                err = c.stderr()
            assert err.count('\n') == 1, err
            assert f'--out {folder}: {folder} {why}, so another user ' \
                'could plant files in it or swap it' in err, err
    assert victim.read_text() == 'precious\n'
    # A folder of one's own: the ranks' `import chainermn` folder is a
    # private one outside it; a log planted as a link is not followed.
    mine = tmp_path / 'mine'
    mine.mkdir()
    with child('launch', '-n', '1', '--out', str(mine), '--',
               sys.executable, '-c', RANK, cwd=tmp_path) as c:
        assert c.wait(120) == 0, c.stderr()
        said = [line for line in c.stdout().splitlines()
                if line.startswith('shim ')]
    _, shim, mode, uid = said[0].split()
    assert (mode, uid) == ('0o700', '0') and not shim.startswith(str(mine))
    assert not os.path.exists(shim)  # gone with the launch
    (mine / 'rank0.log').unlink()
    (mine / 'rank0.log').symlink_to(victim)
    with child('launch', '-n', '1', '--out', str(mine), '--', 'true',
               cwd=tmp_path) as c:
        assert c.wait(120) == 1
        assert 'rank0.log (Too many levels of symbolic links)' in \
            c.stderr(), c.stderr()
    assert victim.read_text() == 'precious\n'


# ------------------------------------------------------------------- 4

JOINED = ('import time; from dasktrain.parallel.comm.rendezvous import '
          'join; join(); print("joined", flush=True); time.sleep(60)')


def tree_listening(pid):
    """``[(ip, port)]`` that ``pid`` or any process under it listens on."""
    import psutil
    found = []
    for p in [psutil.Process(pid), *psutil.Process(pid).children(True)]:
        try:
            found += listening(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def unix_listening(pids):
    """The paths of the Unix sockets the processes ``pids`` listen on."""
    import psutil
    found = set()
    for pid in pids:
        for c in psutil.Process(pid).net_connections(kind='unix'):
            if c.status == psutil.CONN_LISTEN or (c.laddr and not c.raddr):
                found.add(c.laddr)
    return sorted(p for p in found if p and not p.startswith('\0'))


def dial_unix(paths):
    """{path: what connecting to it did} (eve's try)."""
    import socket
    said = {}
    for path in paths:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            said[path] = 'connected'
        except OSError as e:
            said[path] = type(e).__name__
        finally:
            s.close()
    return said


def test_4_a_launchs_rendezvous_and_a_runs_workers_serve_health_alone(
        lab, tmp_path):
    """A launch on one machine: its ranks meet through rank 0 over Unix
    sockets in the launch's 0700 folder, which eve cannot enter (nor
    connect to a socket there, nor read rank 0's address file); nothing
    listens on any IP port and no web server runs. A run's throwaway
    workers serve ``/health`` alone."""
    import psutil

    from dasktrain.cluster.workers import local_workers
    with child('launch', '-n', '2', '--out', str(tmp_path / 'l'), '--',
               sys.executable, '-c', JOINED, cwd=tmp_path) as c:
        wait_until(lambda: c.lines.count('joined\n') == 1, 60,
                   'the ranks to meet')
        where = tree_listening(c.proc.pid)
        ranks = [p for p in psutil.Process(c.proc.pid).children(True)
                 if 'DASKTRAIN_RANK0' in p.environ()]
        told = ranks[0].environ()['DASKTRAIN_RANK0']
        sockets = unix_listening([p.pid for p in ranks])
        with open(told) as f:
            address = f.read()
        eve_reads = as_user(lab, 'eve', os.access, told, os.R_OK)
        eve_dials = as_user(lab, 'eve', dial_unix, sockets)
        folder = os.stat(os.path.dirname(told))
        # a Ctrl-C, not the SIGKILL leaving the block would send: the
        # launch stops its ranks and removes its private folders
        c.signal(signal.SIGINT)
        assert c.wait(60) == 130, c.stderr()
    assert not os.path.exists(os.path.dirname(told))
    assert len(ranks) == 2 and where == [], (ranks, where)
    assert address.startswith('unix://' + os.path.dirname(told) + '/')
    assert len(sockets) >= 2 and all(
        os.path.dirname(p) == os.path.dirname(told) for p in sockets), sockets
    assert set(eve_dials.values()) == {'PermissionError'}, eve_dials
    assert folder.st_mode & 0o777 == 0o700 and not eve_reads
    with local_workers(1) as client:
        ports = [client.cluster.scheduler.http_server.port] + [
            w['services']['dashboard'] for w in
            client.scheduler_info()['workers'].values()]
        seen = as_user(lab, 'eve', probe, ports)
    for port, pages in seen.items():
        shown = {page: code for page, code in pages.items() if code != 404}
        assert set(shown) <= {'/health'}, (port, shown)


def dial_and_hello(path):
    """eve: connect to ``path``, say a rank's hello, read the answer."""
    import socket

    from dasktrain.parallel.comm.transports import frame, pack
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(path)
        parts = pack({'rank': 1, 'address': 'unix:///tmp/x/m1'})
        s.sendall(frame(parts) + b''.join(bytes(p) for p in parts))
        return repr(s.recv(100))
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()


def test_4_a_rank_accepts_no_other_users_connection(lab):
    """Behind the folder, the second wall: a rank's Unix listener hangs up
    on a process of another user (``SO_PEERCRED``) before reading a byte,
    even where the folder and the socket let eve in."""
    import asyncio

    from dasktrain.parallel.comm.transports import UnixTransport
    folder = lab.root / f'open-{os.getpid()}'
    folder.mkdir()
    os.chmod(folder, 0o777)
    heard, loop = [], asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def handler(comm):
        heard.append(await comm.read())
        comm.abort()
    try:
        listener = asyncio.run_coroutine_threadsafe(
            UnixTransport(folder).listen(handler), loop).result(10)
        path = listener.contact_address.removeprefix('unix://')
        os.chmod(path, 0o777)
        said = as_user(lab, 'eve', dial_and_hello, path)
        mine = dial_and_hello(path)  # and the owner's own is heard
        deadline = time.monotonic() + 10
        while not heard and time.monotonic() < deadline:
            time.sleep(0.05)
        loop.call_soon_threadsafe(listener.stop)
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert said in ("b''", 'ConnectionResetError', 'BrokenPipeError'), said
    assert mine in ("b''", 'ConnectionResetError'), mine
    assert heard == [{'rank': 1, 'address': 'unix:///tmp/x/m1'}], heard



# ------------------------------------------------------------------- 6

def hold_lock(report, folder):
    """eve: the lock the run's writers took before (a flock on the run's
    folder), and theirs now if she can open it; held."""
    import fcntl
    held = []
    for path, flags in ((folder, os.O_RDONLY | os.O_DIRECTORY),
                        (os.path.join(folder, '.commands.lock'),
                         os.O_RDONLY)):
        try:
            fd = os.open(path, flags)
            fcntl.flock(fd, fcntl.LOCK_EX)
            held.append(path)
        except OSError as e:
            report({'refused': path, 'why': e.strerror})
    report({'held': held})
    time.sleep(600)


def test_6_no_lock_nor_file_of_eves_hangs_or_ends_a_run(lab, tmp_path,
                                                        make_cifar_dir):
    # The run in a process of its own: this one forks eve's, which must
    # not happen while a BLAS call runs in one of its threads.
    out = lab.root / 'steered'  # root's, 0755: eve may open the folder
    log = out / 'log'
    with child('train', '--model', 'tiny', '--epochs', '1000',
               '--batch-size', '10', '--devices', 'cpu', '--data-dir',
               str(make_cifar_dir(20, 20, 11)), '--out', str(out),
               cwd=tmp_path) as run:
        wait_until(lambda: log.exists() and 'epoch' in log.read_text(),
                   120, 'its first epoch')
        # A commands file nested 100,000 deep (what ChainerUI's server
        # writes for whoever asks it): said, not fatal.
        (out / 'commands').write_text('[' * 100000)
        time.sleep(3)  # the run polls it
        assert run.proc.poll() is None, run.stderr()
        (out / 'commands').unlink()
        with running_as(lab, 'eve', hold_lock, str(out)) as eve:
            wait_until(lambda: any('held' in r for r in eve()), 30,
                       "eve's locks")
            ctl = {}
            steer = threading.Thread(target=lambda: ctl.update(
                code=main(['ctl', str(out), 'stop', '--timeout', '60'])),
                daemon=True)
            steer.start()
            steer.join(30)
            assert not steer.is_alive(), 'ctl hangs on eve\'s lock'
            assert ctl['code'] == 0
            assert run.wait(60) == 0, run.stderr()
            held = next(r for r in eve() if 'held' in r)['held']
        assert str(out / '.commands.lock') not in held
    assert 'stopping by request' in ''.join(run.lines) + run.stderr()
    assert 'nests more than 16 deep' in run.stderr()
