"""Every process of a job kept together and ended, whatever it does: a
program that leaves its session and forks and exits in a loop (its pid
always new), ignoring SIGTERM, run under its keeper in a cgroup of its
own (this machine's cgroup v2, where the test is root) and, where no
cgroup can be had, swept by its marker; on a cancel and on its normal
end, nothing of it is left, and the keeper says what ended it. Real
processes, real cgroups; nothing mocked."""
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from test_programs import alive

from dasktrain import keeper
from dasktrain.as_user import capped
from dasktrain.containment import (
    Cgroup,
    Containment,
    end_all,
    folder_of,
    mount_of,
    own_folder,
    path_of,
    prepare,
)
from dasktrain.keeper import ending_words
from dasktrain.sweep import job_processes, marked, process_table

# A program that starts a looper: a process in a session of its own that
# forks and exits without a pause, ignoring SIGTERM; the program then
# waits (or ends at once: `exit`), ignoring SIGTERM too.
LOOPER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    os.setsid()
    while True:
        if os.fork():
            os._exit(0)
print('ready', flush=True)
if sys.argv[1] == 'wait':
    time.sleep(300)
"""


def _cgroup_root():
    found = own_folder()
    if os.geteuid() != 0 or found is None:
        pytest.skip('needs root and a cgroup v2 mount')
    root = found / f'dasktrain-test-{uuid.uuid4().hex[:6]}'
    root.mkdir()
    return root


@pytest.fixture
def cgroups():
    root = _cgroup_root()
    try:
        yield root
    finally:
        for job in root.iterdir():
            if job.is_dir():
                Cgroup(job).end()
        root.rmdir()


def _started(tmp_path, how, contain, grace=1.0):
    script = tmp_path / 'looper.py'
    script.write_text(LOOPER)
    kept = keeper.start([sys.executable, str(script), how],
                        {'PATH': os.environ['PATH']}, grace,
                        stdout=subprocess.PIPE, contain=contain)
    assert kept.stdout.readline() == b'ready\n'
    return kept


def _none_left(mark):
    """No process carries ``mark``, several looks in a row."""
    for _ in range(5):
        found = marked(mark)
        if found:
            for pid in found:  # the test leaves nothing behind
                os.kill(pid, signal.SIGKILL)
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize('kind', ['cgroup', 'sweep'])
def test_a_cancel_ends_every_process_even_a_fork_loop(tmp_path, kind,
                                                      request):
    mark = f'test-{uuid.uuid4().hex[:8]}/job/1'
    contain = {'mark': mark}
    if kind == 'cgroup':
        root = request.getfixturevalue('cgroups')
        contain['cgroup'] = str(root / 'job-cancel-1')
    kept = _started(tmp_path, 'wait', contain)
    try:
        assert marked(mark)  # the looper and the program carry it
        if kind == 'cgroup':
            assert len(Cgroup(contain['cgroup']).pids()) >= 2
        began = time.monotonic()
        words = kept.stop(1.0)
        assert words == 'SIGTERM ignored for 1 s: killed by SIGKILL'
        assert time.monotonic() - began < 8
        assert kept.returncode == -signal.SIGKILL
        assert _none_left(mark)
        if kind == 'cgroup':  # removed, once empty
            assert not os.path.exists(contain['cgroup'])
    finally:
        kept.process.kill()
        _none_left(mark)


@pytest.mark.parametrize('kind', ['cgroup', 'sweep'])
def test_a_jobs_normal_end_waits_until_what_it_left_is_gone(tmp_path, kind,
                                                            request):
    # The program exits 0 at once; its looper is ended by the keeper
    # (SIGTERM, ignored; SIGKILL after the grace) before the keeper ends.
    mark = f'test-{uuid.uuid4().hex[:8]}/job/1'
    contain = {'mark': mark}
    if kind == 'cgroup':
        root = request.getfixturevalue('cgroups')
        contain['cgroup'] = str(root / 'job-end-1')
    kept = _started(tmp_path, 'exit', contain)
    try:
        assert kept.wait(30) == 0
        end = kept.ending()
        assert end['status'] == 0 and not end['stopped']
        assert end['left'] >= 1 and not end['killed']
        assert _none_left(mark)
    finally:
        kept.process.kill()
        _none_left(mark)


# Processes that carry a marker, started again as soon as they are gone,
# from outside the keeper's tree: what a keeper could never see the end
# of (a process SIGKILL does not end, a stranger with the marker).
RESPAWN = """
import os, subprocess, sys, time
env = {'DASKTRAIN_JOB_MARK': sys.argv[1], 'PATH': os.environ['PATH']}
children = []
while True:
    children = [c for c in children if c.poll() is None]
    while len(children) < 20:
        children.append(subprocess.Popen(['sleep', '30'], env=env,
                                         start_new_session=True))
    time.sleep(0.002)
"""


def test_a_keeper_never_waits_without_bound(tmp_path):
    mark = f'test-{uuid.uuid4().hex[:8]}/job/1'
    # Ahead of the suite's other work in the CPU queue (root: nice -10):
    # the keeper must keep finding its processes, however busy the machine.
    respawn = subprocess.Popen(
        [sys.executable, '-c', RESPAWN, mark], start_new_session=True,
        preexec_fn=(lambda: os.nice(-10)) if os.geteuid() == 0 else None)
    try:
        wait_for = time.monotonic() + 30
        while not marked(mark) and time.monotonic() < wait_for:
            time.sleep(0.05)
        began = time.monotonic()
        kept = keeper.start(['true'], {'PATH': os.environ['PATH']}, 1.0,
                            contain={'mark': mark})
        assert kept.wait(30) == 0
        # The grace, then keeper.GIVE_UP seconds of SIGKILLs, then done.
        assert time.monotonic() - began < 1.0 + keeper.GIVE_UP + 5
        assert kept.ending()["outlived"], str(kept.ending())
    finally:
        os.killpg(respawn.pid, signal.SIGKILL)
        respawn.wait()
        _none_left(mark)


def test_what_ended_a_stopped_program_is_told_as_it_happened(tmp_path):
    # It ignores SIGTERM and ends by itself 2 s later, within its grace:
    # not "stopped by SIGTERM".
    script = tmp_path / 'late.py'
    script.write_text('import signal, time\n'
                      'def later(*args):\n    raise InterruptedError\n'
                      'signal.signal(signal.SIGTERM, later)\n'
                      'print("ready", flush=True)\n'
                      'try:\n    time.sleep(300)\n'
                      'except InterruptedError:\n    time.sleep(2)\n')
    kept = keeper.start([sys.executable, str(script)],
                        {'PATH': os.environ['PATH']}, 10.0,
                        stdout=subprocess.PIPE)
    try:
        assert kept.stdout.readline() == b'ready\n'
        words = kept.stop(10.0)
        assert words.startswith('ended by itself (exit 0) ') and \
            words.endswith(' s after SIGTERM'), words
        assert 1 <= float(words.split()[5]) <= 4
    finally:
        kept.process.kill()
    assert ending_words({'status': 15, 'killed': False}) == \
        'stopped by SIGTERM'
    assert ending_words({'status': 9, 'killed': False, 'left': 0}) == \
        'killed by SIGKILL'  # by someone else: the OOM killer, a user


def test_the_submitters_limits_are_the_jobs(tmp_path):
    assert capped((100, 200), (1024, 4096)) == (100, 200)
    assert capped((-1, -1), (1024, 4096)) == (4096, 4096)  # never raised
    kept = keeper.start(['sh', '-c', 'ulimit -Sn; ulimit -Hn'],
                        {'PATH': os.environ['PATH']}, 1.0,
                        stdout=subprocess.PIPE,
                        contain={'rlimits': {'nofile': [100, 200],
                                             'bogus': [1, 1]}})
    try:
        assert kept.wait(30) == 0
        assert kept.stdout.read().split() == [b'100', b'200']
    finally:
        kept.process.kill()


def test_the_machines_cgroups_are_found_and_proved():
    mount = mount_of('24 1 0:21 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n')
    assert mount == ('/sys/fs/cgroup', '/')
    assert path_of('0::/lab.slice\n') == '/lab.slice'
    assert str(folder_of('/c', '/ns', '/ns/a')) == '/c/a'
    if os.geteuid() != 0 or own_folder() is None:
        pytest.skip('needs root and a cgroup v2 mount')
    name = f'dasktrain-test-{uuid.uuid4().hex[:6]}'
    found = prepare(name=name)
    try:
        assert found.kind == 'cgroup', found
        assert found.root == str(own_folder() / name)
        assert found.words().startswith(f'a cgroup per job under '
                                        f'{found.root}')
        missing = [c for c in ('memory', 'pids')
                   if c not in found.controllers]
        if missing:  # said in one line, and a limit is refused so
            assert found.why in found.words()
            assert found.limit_problem(mem=2 ** 30 if 'memory' in missing
                                       else None,
                                       pids=9 if 'pids' in missing else None)
        assert Containment.of_env({'DASKTRAIN_CONTAIN': found.env()}) == found
    finally:
        os.rmdir(found.root)
    # A folder it may not use: a sweep, and why.
    swept = prepare('/proc/no-such-cgroup')
    assert swept.kind == 'sweep' and 'cannot use cgroup' in swept.why
    assert swept.words().startswith('a sweep of its processes by marker')
    assert "cannot cap a job's memory" in swept.limit_problem(mem=1)


def test_what_a_killed_keeper_left_is_ended_by_the_cluster(tmp_path,
                                                           cgroups):
    # A keeper SIGKILLed (its worker killed hard): its job's cgroup still
    # holds what the program started, until the cluster ends what its
    # jobs left (`cluster stop`, the next `cluster start`).
    mark = f'ctest{uuid.uuid4().hex[:6]}/job/1'
    folder = cgroups / 'worker-1'
    folder.mkdir()
    contain = {'mark': mark, 'cgroup': str(folder / 'job-x-1')}
    kept = keeper.start(['sh', '-c', 'setsid sleep 300 & echo ready; '
                         'sleep 300'], {'PATH': os.environ['PATH']}, 1.0,
                        stdout=subprocess.PIPE, contain=contain)
    try:
        assert kept.stdout.readline() == b'ready\n'
        os.kill(kept.pid, signal.SIGKILL)
        kept.wait(10)
        # its shell dies with it; what left its session stays
        time.sleep(1)
        left = Cgroup(contain['cgroup']).pids()
        assert left and set(left) == set(marked(mark))
        assert end_all(Containment('cgroup', str(cgroups)),
                       mark.split('/')[0] + '/') >= 1
        assert _none_left(mark)
        assert not any(alive(p) for p in left)
        assert not folder.exists()
    finally:
        kept.process.kill()
        _none_left(mark)


def test_a_process_seen_just_forked_takes_no_stranger_with_it():
    """The process table may see a job's process just forked, still in
    its parent's session and group, and read its marked environment
    after it exec'd: the sweep reads its session again then, so the
    parent (not the job's) is not counted among the job's processes."""
    mark = f'test-{uuid.uuid4().hex[:8]}/job/1'
    parent = subprocess.Popen(['sleep', '60'], start_new_session=True)
    child = subprocess.Popen(
        ['sleep', '60'], start_new_session=True,
        env={'PATH': os.environ['PATH'], 'DASKTRAIN_JOB_MARK': mark})
    try:
        table = process_table()
        ppid, state, _, _ = table[child.pid]
        table[child.pid] = (ppid, state, parent.pid, parent.pid)  # as seen
        assert job_processes(mark, table=table) == {child.pid}
    finally:
        for p in (parent, child):
            p.kill()
            p.wait()
