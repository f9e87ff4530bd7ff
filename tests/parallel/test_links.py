"""The links between hosts (dasktrain/parallel/comm/links.py): real
sockets on 127.0.0.1, every rank a thread of this process. Only the
set-up's small messages (addresses, tokens, keys) pass through a stand-in
here (:class:`Table`); DaskComm carries them between worker processes in
tests/test_hosts.py."""
import contextlib
import socket
import threading
import time

import numpy as np
import pytest

from dasktrain.parallel.comm import CollectiveError
from dasktrain.parallel.comm import links as L
from dasktrain.parallel.comm import streams as S
from dasktrain.parallel.comm.dask import host_groups


class Table:
    """The ranks' set-up messages, handed across threads."""

    def __init__(self, size):
        self.size, self.posted = size, {}
        self.barrier = threading.Barrier(size, timeout=30)

    def rank(self, r):
        table = self

        class Rank:
            rank, size = r, table.size

            def alltoall(self, objs):
                for peer, obj in objs.items():
                    table.posted[r, peer] = obj
                table.barrier.wait()
                got = {p: table.posted[p, r] for p in range(table.size)
                       if p != r}
                table.barrier.wait()
                return got
        return Rank()


def on_ranks(size, body, timeout=60):
    """``body(rank)`` on ``size`` threads at once; their results, or the
    first error raised."""
    results, errors = [None] * size, []

    def run(r):
        try:
            results[r] = body(r)
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r,), daemon=True)
               for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), 'a rank hangs'
    if errors:
        raise errors[0]
    return results


@contextlib.contextmanager
def linked(size, streams=2, sealed=True, timeout=30.0):
    table = Table(size)
    made = on_ranks(size, lambda r: L.connect(
        table.rank(r), '127.0.0.1', streams, sealed, timeout))
    try:
        yield made
    finally:
        for links in made:
            links.close()


def data(rank, n, dtype=np.float64):
    return np.random.default_rng(rank).standard_normal(n).astype(dtype)


# ------------------------------------------------------------ decisions

def test_slices_and_records_cover_the_buffer_once():
    for count in (0, 1, 5, 1000, 262_145):
        for size in (1, 2, 3, 4, 7):
            parts = L.bounds(count, size)
            assert parts[0][0] == 0 and parts[-1][1] == count
            assert all(parts[i][1] == parts[i + 1][0]
                       for i in range(size - 1))
            assert [b - a for a, b in parts] == \
                [len(s) for s in np.array_split(np.arange(count), size)]
            for lo, hi in parts:
                got = L.records(lo, hi, 4, record=4096)
                assert sum(b - a for a, b in got) == hi - lo
                assert all(0 < (b - a) * 4 <= 4096 for a, b in got)


def test_ranks_group_by_the_host_they_listen_on():
    assert host_groups(['a', 'b', 'a', 'c', 'b']) == [[0, 2], [1, 4], [3]]
    assert host_groups(['x'] * 3) == [[0, 1, 2]]


def test_plain_links_are_asked_for_by_name_only(monkeypatch):
    assert not L.plain_asked({})
    assert L.plain_asked({'DASKTRAIN_LINKS': 'tcp'})
    assert not L.plain_asked({'DASKTRAIN_LINKS': 'sealed'})
    with pytest.raises(CollectiveError, match="'tcp' or 'sealed'"):
        L.plain_asked({'DASKTRAIN_LINKS': 'fast'})


# ------------------------------------------------------------ sums

@pytest.mark.parametrize('size,sealed,streams', [
    (2, True, 1), (2, False, 2), (3, True, 2), (4, False, 3)])
def test_every_rank_gets_the_rank_order_sum(size, sealed, streams):
    # Several records per slice (streaming), an odd size, a buffer with
    # fewer elements than ranks, and a second dtype in the same call.
    n = 3 * S.RECORD // 8 * size + 7

    def body(r):
        big, tiny = data(r, n), np.arange(size - 1, dtype=np.int32) + r
        half = data(r, 1001, np.float16)
        links[r].allreduce([big, tiny, half], [('<f8', n)])
        links[r].allreduce([big], [('<f8', n)])  # again: buffers reused
        return big, tiny, half

    with linked(size, streams, sealed) as links:
        got = on_ranks(size, body)
        assert all(lk.sealed == sealed and lk.streams == streams
                   for lk in links)
    once = data(0, n)
    for r in range(1, size):
        once = once + data(r, n)
    twice = once * size  # rank order again, of equal parts: exact
    for big, tiny, half in got:
        np.testing.assert_array_equal(big, twice)
        np.testing.assert_array_equal(
            tiny, sum(np.arange(size - 1, dtype=np.int32) + r
                      for r in range(size)))
        expected = data(0, 1001, np.float16)
        for r in range(1, size):
            expected = expected + data(r, 1001, np.float16)
        np.testing.assert_array_equal(half, expected)
        assert half.dtype == np.float16  # half the bytes on the wire


@pytest.mark.parametrize('size', [2, 3, 4])
def test_each_rank_sends_2_n_minus_1_over_n_of_the_buffer(size):
    n = 240_000  # divisible by every size: equal slices
    with linked(size, streams=2, sealed=False) as links:
        on_ranks(size, lambda r: links[r].allreduce([data(r, n)], []))
        headers = 2 * (size - 1) * L.HEADER.size
        for lk in links:
            assert lk.sent() - headers == L.traffic(n * 8, size)


def test_ranks_out_of_step_fail_instead_of_mixing():
    def body(r):
        try:
            links[r].allreduce([data(r, 10 + r)], [('<f8', 10 + r)])
        except CollectiveError as e:
            return str(e)
        return 'summed'
    with linked(2) as links:
        got = on_ranks(2, body)
    assert all('out of step' in g for g in got), got


def test_out_of_step_is_the_error_told_before_a_lost_link_it_caused():
    # The rank that finds the headers differ closes its links; the other
    # rank's lost link is an effect, its mismatch the cause.
    lost = S.LinkLost('a link failed ([Errno 32] Broken pipe)')
    step = L.OutOfStep('rank 1 sums 1 arrays where rank 0 sums 1')
    other = L.OutOfStep('rank 2 sums 2 arrays where rank 0 sums 1')
    assert L._first(None, lost) is lost
    assert L._first(lost, step) is step
    assert L._first(step, lost) is step
    assert L._first(step, other) is step  # the first of its kind stays
    assert L._first(lost, S.LinkLost('another')) is lost


def test_a_lost_peer_fails_the_others_at_once():
    def body(r):
        if r == 1:
            links[1].close()  # its worker died
            return None
        began = time.monotonic()
        with pytest.raises(CollectiveError):
            links[0].allreduce([data(0, 1_000_000)], [])
        return time.monotonic() - began
    with linked(2, timeout=60) as links:
        waited = on_ranks(2, body)[0]
    assert waited < 10  # not the collective timeout


# ------------------------------------------------------------ sealing

def _through(key, send, size):
    """What a stream sealed with ``key`` puts on the wire for ``send``
    (``size`` bytes with the tags): read raw at the other end."""
    a, b = socket.socketpair()
    out = S.Stream(a, key, 'test-out', print)
    try:
        sender = threading.Thread(target=out.send, args=(send,), daemon=True)
        sender.start()
        raw = bytearray(size)
        view = memoryview(raw)
        b.settimeout(30)
        while view:
            view = view[b.recv_into(view):]
        sender.join(30)
        return raw
    finally:
        out.close()
        b.close()


def _opened(key, raw, into):
    """``raw`` fed to a stream sealed with ``key``, opened into ``into``."""
    c, d = socket.socketpair()
    inn = S.Stream(d, key, 'test-in', print)
    try:
        def feed():  # the reader may stop at a forged record
            with contextlib.suppress(OSError):
                c.sendall(bytes(raw))
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        inn.sock.settimeout(30)
        inn.recv_into(into)
        feeder.join(30)
    finally:
        inn.close()
        c.close()


def test_sealed_records_hide_the_data_and_refuse_tampering():
    key = bytes(range(32))
    secret = np.frombuffer(b'gradients! ' * 200_000, np.uint8)
    # three records: 1 MiB, 1 MiB, then the rest, each with its tag
    raw = _through(key, secret, secret.nbytes + 3 * S.TAG)
    assert b'gradients!' not in raw
    back = np.empty_like(secret)
    _opened(key, raw, back)  # the receiving end, told the same key
    np.testing.assert_array_equal(back, secret)
    # ...but not a record changed in one bit, nor one replayed
    first = S.RECORD + S.TAG
    for forged in (raw[:-1] + bytes([raw[-1] ^ 1]),
                   raw[:first] + raw[:len(raw) - first]):
        with pytest.raises(S.LinkLost, match='authentication'):
            _opened(key, forged, np.empty_like(secret))
    with pytest.raises(S.LinkLost, match='authentication'):  # another key
        _opened(bytes(32), raw, np.empty_like(secret))


def test_a_connection_without_its_token_is_refused():
    table = Table(2)
    stranger = []

    def body(r):
        if r == 1:  # someone dials rank 0's listener with a guess
            real = table.rank(1)
            original = real.alltoall

            def alltoall(objs):
                got = original(objs)
                host, port = got[0]['address']
                s = socket.create_connection((host, port))
                s.sendall(L.HELLO.pack(1, 0, b'\0' * L.TOKEN))
                stranger.append(s)
                return got
            real.alltoall = alltoall
            return L.connect(real, '127.0.0.1', 1, True, 20)
        return L.connect(table.rank(0), '127.0.0.1', 1, True, 20)
    made = on_ranks(2, body)
    try:
        assert stranger[0].recv(1) == b''  # closed unread
        a, b = data(0, 100), data(1, 100)
        on_ranks(2, lambda r: made[r].allreduce([(a, b)[r]], []))
        np.testing.assert_array_equal(a, data(0, 100) + data(1, 100))
    finally:
        for links in made:
            links.close()
        stranger[0].close()
