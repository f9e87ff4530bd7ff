"""The board: barriers and small all-reduces through shared memory among
the ranks of one machine. Two real processes (a fork) on one shared
mapping: every operation's payload read is that operation's, a sleeping
rank is woken by its peer's publish (not by its own check turns), a
polling rank meets its peer without sleeping and lets the other threads
of its process run meanwhile, a silent peer times out, a peer that
exited is told apart; the decisions (machine, spin, sequence order) by
their doctests. The sums through it,
on ranks that ``dasktrain launch`` starts, are tests/parallel/
test_shm.py's."""
import doctest
import mmap
import multiprocessing
import os
import socket
import statistics
import struct
import sys
import threading
import time

import pytest

from dasktrain.parallel.comm import board
from dasktrain.parallel.comm.base import CollectiveError, PeerLost
from dasktrain.parallel.comm.nearby import Nearby

pytestmark = pytest.mark.skipif(not board.supported(),
                                reason='the board is for Linux on x86')
FORK = multiprocessing.get_context('fork')


def test_the_decisions():
    assert doctest.testmod(board).failed == 0
    assert doctest.testmod(board).attempted >= 3


def _segment(size=2):
    return mmap.mmap(-1, board.SLOT * size, flags=mmap.MAP_SHARED)


def _in_child(target, *args):
    proc = FORK.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _stop(proc):
    if proc.is_alive():
        proc.kill()
    proc.join(5)


def _ops(segment, rank, n, pause):
    """``n`` operations, each rank's payload its rank and the operation's
    number; rank 1 pauses now and then (a slow reader); exit 0 where every
    payload read was that operation's."""
    b = board.Board(segment, rank, 2, timeout=20, spin=0.0)
    for k in range(1, n + 1):
        def write(payload, k=k):
            payload[:8] = list(struct.pack('<II', rank, k))
        got = b.exchange(1000 + k, rank, write)
        for peer, (fp, count, payload) in enumerate(got):
            if (fp, count) != (1000 + k, peer) or \
                    struct.unpack('<II', payload[:8].tobytes()) != (peer, k):
                os._exit(3)
        if pause and k % 7 == 0:
            time.sleep(0.01)
    os._exit(0)


def test_every_payload_read_is_its_operations():
    segment = _segment()
    proc = _in_child(_ops, segment, 1, 300, True)
    try:
        b = board.Board(segment, 0, 2, timeout=20, spin=0.0)
        for k in range(1, 301):
            def write(payload, k=k):
                payload[:8] = list(struct.pack('<II', 0, k))
            got = b.exchange(1000 + k, 0, write)
            assert [(fp, count) for fp, count, _ in got] == \
                [(1000 + k, 0), (1000 + k, 1)]
            assert struct.unpack('<II', got[1][2][:8].tobytes()) == (1, k)
        proc.join(20)
        assert proc.exitcode == 0
    finally:
        _stop(proc)


def _late(segment, delays):
    b = board.Board(segment, 1, 2, timeout=20, spin=0.0)
    for delay in delays:
        time.sleep(delay)
        stamp = time.monotonic()

        def write(payload, stamp=stamp):
            payload[:8] = list(struct.pack('<d', stamp))
        b.exchange(0, 0, write)
    os._exit(0)


def test_a_sleeping_rank_is_woken_by_its_peer():
    # Each time rank 0 is asleep in the futex well before rank 1
    # publishes: it must return at once, not at its next check turn
    # (CHECK_S, 0.2 s, later at worst).
    segment = _segment()
    delays = [0.3] * 6
    proc = _in_child(_late, segment, delays)
    try:
        b = board.Board(segment, 0, 2, timeout=20, spin=0.0)
        lags = []
        for _ in delays:
            got = b.exchange()
            lags.append(time.monotonic() -
                        struct.unpack('<d', got[1][2][:8].tobytes())[0])
        assert statistics.median(lags) < 0.05, lags
    finally:
        _stop(proc)


def _sleeps(b):
    """Count ``b``'s sleeps in the futex (they still sleep)."""
    count, wait = [0], b._futex.wait

    def counted(*args):
        count[0] += 1
        return wait(*args)
    b._futex.wait = counted
    return count


@pytest.mark.parametrize('spin', [0.0, 5.0])
def test_a_polling_rank_meets_its_peer_without_sleeping(spin):
    # rank 1 publishes 0.2 s late: a rank polling for 5 s meets it without
    # a sleep in the futex, one polling for none sleeps
    segment = _segment()
    proc = _in_child(_late, segment, [0.2])
    try:
        b = board.Board(segment, 0, 2, timeout=20, spin=spin)
        sleeps = _sleeps(b)
        start = time.monotonic()
        b.exchange()
        assert time.monotonic() - start < 3
        assert (sleeps[0] == 0) == (spin > 0), sleeps
    finally:
        _stop(proc)


class _OtherThread:
    """A thread of this process that wants the GIL every millisecond,
    counting its turns while the block runs; the switch interval set to
    0.1 s meanwhile, so a wait that held the GIL would let it in about
    once per 0.1 s."""

    def __enter__(self):
        self.turns, self._done = 0, threading.Event()
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(0.1)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(0.01)
        self.turns = 0
        return self

    def _run(self):
        while not self._done.is_set():
            self.turns += 1
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._done.set()
        sys.setswitchinterval(self._interval)
        self._thread.join(5)


def test_a_polling_rank_lets_its_other_threads_run():
    # While rank 0 polls for its late peer (0.4 s), a thread of its
    # process gets the GIL: about 4 turns where the poll held it.
    segment = _segment()
    proc = _in_child(_late, segment, [0.4])
    try:
        b = board.Board(segment, 0, 2, timeout=20, spin=5.0)
        sleeps = _sleeps(b)
        with _OtherThread() as other:
            b.exchange()
        assert sleeps[0] == 0
        assert other.turns >= 40, other.turns
    finally:
        _stop(proc)


def test_a_silent_peer_times_out_naming_it():
    segment = _segment()
    b = board.Board(segment, 0, 2, timeout=0.5, spin=0.0)
    start = time.monotonic()
    with pytest.raises(CollectiveError,
                       match=r'no answer from rank\(s\) \[1\] within 0.5 s'):
        b.exchange()
    assert 0.45 < time.monotonic() - start < 3


def test_a_peer_that_exited_is_lost_at_once():
    segment = _segment()
    proc = _in_child(os._exit, 0)
    try:
        proc.join(5)
        b = board.Board(segment, 0, 2, timeout=30,
                        gone=lambda peer: not proc.is_alive(), spin=0.0)
        start = time.monotonic()
        with pytest.raises(PeerLost, match='rank 1 of this machine'):
            b.exchange()
        assert time.monotonic() - start < 2  # a check turn, not 30 s
    finally:
        _stop(proc)


def test_a_peer_is_gone_once_its_socket_ended():
    mine, theirs = socket.socketpair()
    near = Nearby(0, {1: mine}, timeout=5)
    try:
        assert not near.gone(1)
        theirs.sendall(b'x')  # unread data: still there
        assert not near.gone(1)
        theirs.close()
        assert not near.gone(1)  # its last byte is not read yet
        assert mine.recv(1) == b'x'
        assert near.gone(1)
    finally:
        near.close()


def _pair(spin):
    """Two ranks' Nearby over a socket pair, rank 0's receive polling for
    ``spin`` seconds."""
    mine, theirs = socket.socketpair()
    for sock in (mine, theirs):
        sock.settimeout(5)
    return Nearby(0, {1: mine}, 5, spin=spin), Nearby(1, {0: theirs}, 5)


def _later(seconds, do):
    thread = threading.Timer(seconds, do)
    thread.daemon = True
    thread.start()
    return thread


@pytest.mark.parametrize('spin', [0.0, 5.0])
def test_a_receive_polls_for_a_late_message_and_lets_threads_run(spin):
    near, far = _pair(spin)
    try:
        _later(0.4, lambda: far.send({'step': 3}, 0))
        with _OtherThread() as other:
            start = time.monotonic()
            got = near.recv(1)
        assert got == {'step': 3}
        assert time.monotonic() - start < 3
        assert other.turns >= 40, other.turns
    finally:
        near.close()
        far.close()


def test_a_peer_that_exits_while_a_receive_polls_is_lost_at_once():
    near, far = _pair(5.0)
    try:
        _later(0.2, far.close)
        start = time.monotonic()
        with pytest.raises(PeerLost):
            near.recv(1)
        assert time.monotonic() - start < 3  # not the poll's 5 s
    finally:
        near.close()
