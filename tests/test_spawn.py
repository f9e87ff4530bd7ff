"""A parent waits for its children without looking every few
milliseconds: a keeper sleeps while its program runs, until a child ends
or a SIGTERM comes, and a rank's watch in ``dasktrain launch`` until the
rank ends or is stopped. On a machine whose cores all train, every look
of a helper process takes a core from a rank for a moment, and a shared
server runs one keeper per job. Real processes and signals; the
wake-ups are the kernel's count of each thread's sleeps."""
import os
import signal
import subprocess
import sys
import threading
import time

from dasktrain import keeper
from dasktrain.run.driver import Child
from dasktrain.spawn import Bell, ExitWaiter, SignalWaiter

SLEEPER = [sys.executable, '-c',
           'import time; print("ready", flush=True); time.sleep({})']


def wakeups(pid, tid=None):
    """How often thread ``tid`` of process ``pid`` (default: its main
    thread) has slept and woken: its voluntary context switches."""
    with open(f'/proc/{pid}/task/{tid or pid}/status') as f:
        return next(int(line.split()[1]) for line in f
                    if line.startswith('voluntary_ctxt_switches'))


def elapsed(call, *args):
    start = time.monotonic()
    call(*args)
    return time.monotonic() - start


def sleeper(seconds):
    return [SLEEPER[0], SLEEPER[1], SLEEPER[2].format(seconds)]


def test_an_exit_waiter_wakes_at_the_exit_or_the_ring():
    child = subprocess.Popen(sleeper(0.3), stdout=subprocess.DEVNULL)
    late = subprocess.Popen(sleeper(60), stdout=subprocess.DEVNULL)
    bell = Bell()
    waiter = ExitWaiter(child.pid, bell)
    try:
        assert elapsed(waiter, 30) < 15  # the exit, not the 30 s
        child.wait()
        waiter.close()
        waiter = ExitWaiter(late.pid, bell)
        threading.Timer(0.2, bell.ring).start()
        assert elapsed(waiter, 30) < 15  # the ring
        assert elapsed(waiter, 0.2) >= 0.15  # rung once, drained
    finally:
        for process in (child, late):
            process.kill()
            process.wait()
        waiter.close()
        bell.close()
    bell.ring()  # closed: nothing, no error
    bell.drain()


def test_a_signal_waiter_wakes_at_a_childs_exit_and_at_a_handled_signal():
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
    waiter = SignalWaiter()
    try:
        assert signal.getsignal(signal.SIGCHLD) not in (signal.SIG_DFL,
                                                        None)
        child = subprocess.Popen(sleeper(0.3), stdout=subprocess.DEVNULL)
        assert elapsed(waiter, 30) < 15
        child.wait()
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        assert elapsed(waiter, 30) < 15 and got == [1]
        assert elapsed(waiter, 0.2) >= 0.15  # both drained
        flood = SignalWaiter(spacing=0.5)
        try:
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGUSR1)
                looks = elapsed(flood, 30)
            assert 0.3 < looks < 15  # one return per spacing, then at once
        finally:
            flood.close()
    finally:
        waiter.close()
        signal.signal(signal.SIGUSR1, previous)
    assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
    assert signal.set_wakeup_fd(-1) == -1  # put back as it was


def test_a_keeper_sleeps_while_its_program_runs_and_stops_it_at_once():
    kept = keeper.start(sleeper(60), {'PATH': os.environ['PATH']}, 5.0,
                        stdout=subprocess.PIPE)
    try:
        assert kept.stdout.readline() == b'ready\n'
        before = wakeups(kept.pid)
        time.sleep(2)
        # 20 looks a second would be 40; the safety look once a second
        assert wakeups(kept.pid) - before <= 5
        bell, stop, ended = Bell(), threading.Event(), []
        watch = threading.Thread(target=lambda: ended.append(kept.watch(
            stop.is_set, 5.0, poll=30, bell=bell)), daemon=True)
        watch.start()
        time.sleep(0.2)
        stop.set()
        bell.ring()  # woken by the ring, not at its look 30 s on
        watch.join(15)
        assert not watch.is_alive()
        assert ended[0].stopped == 'stopped by SIGTERM'
        bell.close()
    finally:
        kept.process.kill()
        kept.process.wait()


def test_a_ranks_watch_sleeps_until_the_rank_ends(tmp_path):
    child = Child(sleeper(3), {'PATH': os.environ['PATH']}, 0,
                  str(tmp_path / 'rank0.log'), 5.0)
    try:
        while not (tmp_path / 'rank0.log').read_text():
            time.sleep(0.05)
        before = wakeups(os.getpid(), child.thread.native_id)
        time.sleep(1.5)
        assert wakeups(os.getpid(), child.thread.native_id) - before <= 4
        child.thread.join(15)
        assert child.status == 'finished' and child.result().code == 0
    finally:
        child.stop()
        child.thread.join(15)
