"""The mesh's transports (dasktrain.parallel.comm.transports): a DaskComm
whose ranks meet over Unix sockets gives what one over Dask's TCP comms
gives, collective for collective; its messages carry arrays writable and
whole; a frame no rank wrote, a peer that left and an address outside
the folder fail as such. (Another user's connection: test_strangers.)"""
import asyncio
import os
import socket
import struct
import sys
import tempfile
import threading

import numpy as np
import pytest

from dasktrain.parallel.comm import CollectiveError, PeerLost
from dasktrain.parallel.comm.dask import DaskComm
from dasktrain.parallel.comm.transports import (
    UnixTransport,
    pack,
    transport_for,
    unix_fits,
    unpack,
)

pytestmark = pytest.mark.timeout(120)


def meet_all(size, transport, body, shared_memory=False):
    """``body(comm)`` on ``size`` ranks as threads of this process, met
    through rank 0 over ``transport``; each rank's result (or error)."""
    told, results = {}, [None] * size
    ready = threading.Event()

    def tell(address):
        told['address'] = address
        ready.set()

    def find(limit):
        assert ready.wait(limit)
        return told['address']

    def rank(r):
        try:
            comm = DaskComm.meet(r, size, tell, find, transport, timeout=20,
                                 shared_memory=shared_memory)
            try:
                results[r] = body(comm)
            finally:
                comm.close()
        except BaseException as e:  # the test reads it
            results[r] = e
    threads = [threading.Thread(target=rank, args=(r,), daemon=True)
               for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), 'a rank hangs'
    return results


def collectives(comm):
    """A bit of every collective a ChainerMN script makes, in float64."""
    r = comm.rank
    out = {'allgather': comm.allgather((r, np.arange(3.0) * r))}
    out['bcast'] = comm.bcast({'w': np.linspace(0, 1, 5)} if r == 0
                              else None)
    summed = comm.allreduce([np.full(7, r + 0.5), np.arange(4.0) ** r])
    out['allreduce'] = [a.copy() for a in summed]
    if r == 0:
        comm.send(np.asfortranarray(np.arange(6.0).reshape(2, 3)), 1)
        comm.send(np.arange(10.0)[::3], 2)
    elif r in (1, 2):
        got = comm.recv(0)
        got += 1  # writable, as an MPI receive buffer is
        out['recv'] = got
    sub = comm.split(r % 2, -r)
    out['split'] = (sub.rank, sub.size, sub.allgather(r))
    sub.close()
    return out


def same(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and \
            a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and \
            all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def test_unix_sockets_give_what_dask_comms_give(tmp_path):
    unix = meet_all(3, UnixTransport(tmp_path), collectives)
    tcp = meet_all(3, transport_for('tcp://127.0.0.1'), collectives)
    for r in range(3):
        assert not isinstance(unix[r], BaseException), unix[r]
        assert not isinstance(tcp[r], BaseException), tcp[r]
        assert same(unix[r], tcp[r]), (r, unix[r], tcp[r])
    # and the values themselves, against a hand-made reference
    assert np.array_equal(unix[0]['allreduce'][0], np.full(7, 4.5))
    assert np.array_equal(unix[2]['allreduce'][1],
                          1 + np.arange(4.0) + np.arange(4.0) ** 2)
    assert np.array_equal(unix[1]['recv'], np.arange(6.0).reshape(2, 3) + 1)
    assert np.array_equal(unix[2]['recv'], np.arange(10.0)[::3] + 1)
    assert [u['split'] for u in unix] == [(1, 2, [2, 0]), (0, 1, [1]),
                                          (0, 2, [2, 0])]
    # every listener's socket was removed as its communicator closed
    assert os.listdir(tmp_path) == []


def test_shared_memory_among_ranks_met_over_unix_sockets(tmp_path):
    def body(comm):
        return comm.route, comm.allreduce([np.full(5, comm.rank + 1.0)])[0]
    got = meet_all(2, UnixTransport(tmp_path), body, shared_memory=True)
    assert [g[0] for g in got] == ['shared memory'] * 2, got
    assert all(np.array_equal(g[1], np.full(5, 3.0)) for g in got)


def test_a_rank_that_leaves_is_peer_lost_over_unix_sockets(tmp_path):
    def body(comm):
        if comm.rank == 1:
            return 'left'  # closes at once, without the barrier
        return comm.allgather(comm.rank)
    got = meet_all(2, UnixTransport(tmp_path), body)
    assert got[1] == 'left'
    assert isinstance(got[0], PeerLost), got[0]
    assert 'closed its connection during an allgather' in str(got[0])


def test_a_rank_that_never_comes_is_said(tmp_path):
    def find(limit):
        raise CollectiveError('rank 0 of 2 did not start')
    with pytest.raises(CollectiveError, match='did not start'):
        DaskComm.meet(1, 2, None, find, UnixTransport(tmp_path), timeout=2)
    assert os.listdir(tmp_path) == []


def test_messages_keep_arrays_whole_and_writable():
    msg = {'c': np.arange(12.0).reshape(3, 4),
           'f': np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)),
           'strided': np.arange(20.0)[::4], 'empty': np.zeros((0, 3)),
           'obj': ('text', b'bytes', 7)}
    parts = pack(msg)
    assert len(parts) == 4  # c, f and empty out of band; strided inline
    got = unpack(parts[:1] + [bytearray(p) for p in parts[1:]])
    assert same(got, msg)
    assert got['f'].flags.f_contiguous
    assert all(got[k].flags.writeable for k in ('c', 'f', 'strided'))


def run_pair(folder, server_side, client_side):
    """A listener in ``folder`` and one connection to it on a loop of its
    own: ``server_side(comm)`` and ``client_side(comm, transport)``'s
    results."""
    transport = UnixTransport(folder)
    done = {}

    async def main():
        arrived = asyncio.Event()

        async def handler(comm):
            done['server'] = await server_side(comm)
            arrived.set()
        listener = await transport.listen(handler)
        try:
            done['client'] = await client_side(listener.contact_address,
                                               transport)
            await asyncio.wait_for(arrived.wait(), 10)
        finally:
            listener.stop()
    asyncio.run(main())
    return done


def test_a_frame_no_rank_wrote_is_a_lost_connection(tmp_path):
    async def server(comm):
        try:
            await comm.read()
        except OSError as e:
            return type(e).__name__, str(e)
        return 'read'

    async def client(address, transport):
        _, writer = await asyncio.open_unix_connection(
            address.removeprefix('unix://'))
        writer.write(struct.pack('<I', 1 << 20))  # a million parts
        await writer.drain()
        writer.close()
    done = run_pair(tmp_path, server, client)
    assert done['server'] == ('ConnectionResetError',
                              'a message of 1048576 parts: not from a rank')


def test_a_peer_closing_mid_message_is_a_lost_connection(tmp_path):
    async def server(comm):
        try:
            await comm.read()
        except OSError as e:
            return type(e).__name__
        return 'read'

    async def client(address, transport):
        comm = await transport.dial(address)
        comm._writer.write(struct.pack('<IQ', 1, 1000) + b'x' * 10)
        await comm._writer.drain()
        comm.abort()
    assert run_pair(tmp_path, server, client)['server'] == \
        'ConnectionResetError'


def test_only_the_folders_listeners_are_dialled(tmp_path):
    transport = UnixTransport(tmp_path)
    elsewhere = tempfile.mkdtemp()
    try:
        for address in (f'unix://{elsewhere}/m0', f'unix://{tmp_path}/../x',
                        'tcp://127.0.0.1:1', str(tmp_path / 'm0')):
            with pytest.raises(ConnectionRefusedError,
                               match='not a listener of this launch'):
                asyncio.run(transport.dial(address))
    finally:
        os.rmdir(elsewhere)


def test_sockets_fit_or_the_launch_says_tls():
    assert unix_fits(tempfile.gettempdir() + '/dasktrain-meet-abcdefgh')
    folder = '/tmp/' + 'd' * (107 - len('/tmp/') - 14)
    assert unix_fits(folder) and not unix_fits(folder + 'd')
    # and the kernel agrees: a path that fits binds, one byte more not
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(OSError):
        sock.bind('/tmp/' + 'x' * 108)
    sock.close()


def test_a_rank_meeting_over_unix_sockets_imports_no_dask(tmp_path):
    import subprocess
    program = (
        'import sys, threading\n'
        'from dasktrain.parallel.comm.dask import DaskComm\n'
        'from dasktrain.parallel.comm.transports import UnixTransport\n'
        'told, ready = {}, threading.Event()\n'
        'def tell(a): told["a"] = a; ready.set()\n'
        'def find(limit): ready.wait(limit); return told["a"]\n'
        'def rank(r, out):\n'
        '    with DaskComm.meet(r, 2, tell, find, UnixTransport(sys.argv[1]),'
        ' timeout=20) as comm:\n'
        '        out[r] = comm.allgather(r)\n'
        'out = {}\n'
        't = threading.Thread(target=rank, args=(1, out)); t.start()\n'
        'rank(0, out); t.join()\n'
        'print(sorted(out.items()), [m for m in ("dask", "distributed",'
        ' "cryptography") if m in sys.modules])\n')
    got = subprocess.run([sys.executable, '-c', program, str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == '[(0, [0, 1]), (1, [0, 1])] []', got.stdout


def test_a_hello_that_is_not_a_ranks_is_hung_up_on_quietly(tmp_path,
                                                           caplog):
    async def server(comm):
        hello = await comm.read()
        return hello['rank']  # a list has no 'rank': TypeError

    async def client(address, transport):
        comm = await transport.dial(address)
        await comm.write(['not', 'a', 'hello'])
        try:
            return await asyncio.wait_for(comm.read(), 10)
        except OSError as e:
            return type(e).__name__

    got = {}

    async def main():
        transport = UnixTransport(tmp_path)
        listener = await transport.listen(server)
        try:
            got['client'] = await client(listener.contact_address,
                                         transport)
        finally:
            listener.stop()
    with caplog.at_level('DEBUG', logger='asyncio'):
        asyncio.run(main())
    assert got['client'] == 'ConnectionResetError'
    assert not [r for r in caplog.records if r.levelname == 'ERROR'], \
        caplog.text
