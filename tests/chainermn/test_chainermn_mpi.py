"""mpi4py's ``MPI`` on a launched rank and what ChainerMN's own code and
tests call on it (tests/chainermn/ranks/mpi_calls.py under ``dasktrain
launch``), a rank's stop line under a test runner, and the pure parts:
buffers, statuses, the synchronous send of the mailbox."""
import doctest
import queue
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.chainermn.test_chainermn import launch

RANKS = Path(__file__).resolve().parent / 'ranks'


def test_mpi4py_calls_on_two_launched_ranks(tmp_path):
    code, out, err = launch(tmp_path, 2, [RANKS / 'mpi_calls.py'])
    assert code == 0, err
    assert 'rank 0 ok' in out
    assert 'rank 1 ok' in (tmp_path / 'ranks' / 'rank1.log').read_text()
    assert '`from mpi4py import MPI` gets its MPI' in err


def test_without_the_shim_mpi4py_is_not_dasktrains(tmp_path):
    script = tmp_path / 'which.py'
    script.write_text(textwrap.dedent('''
        import importlib.util
        spec = importlib.util.find_spec('mpi4py')
        print('mpi4py from', 'nowhere' if spec is None else spec.origin)
    '''))
    code, out, err = launch(tmp_path, 1, [script], '--no-chainermn')
    assert code == 0, err
    assert 'mpi4py from' in out and '.chainermn-' not in out


LEAVES = '''
import sys, time
import chainer.links as L
import numpy as np
import chainermn
comm = chainermn.create_communicator('naive')
big = np.arange(5_000_003, dtype=np.float32)
model = L.Linear(2000, 2000)  # 16 MB of parameters
if comm.rank == 0:
    model.W.array[...] = 7
    comm.bcast_data(model)  # the ranks' Dask comms
    comm.mpi_comm.bcast(big, root=0)  # mpi4py's: the object collectives
    comm.send(big, dest=1, tag=0)  # point to point: a socket, shared memory
    print('rank 0 sent', flush=True)
    sys.exit(0)  # at once: the others have read nothing yet
time.sleep(2)
comm.bcast_data(model)
assert (model.W.array == 7).all()
assert np.array_equal(comm.mpi_comm.bcast(None, root=0), big)
assert np.array_equal(comm.recv(source=0, tag=0), big)
print('rank 1 got it all', flush=True)
'''


def test_a_rank_leaving_after_its_sends_loses_none_of_them(tmp_path):
    # As MPI_Finalize (the same script passes under mpiexec): a rank's
    # exit waits for every rank's, so what it sent is still read after it
    # stops (a connection closed with data in flight drops it).
    (tmp_path / 'leaves.py').write_text(LEAVES)
    code, out, err = launch(tmp_path, 2, [tmp_path / 'leaves.py'])
    assert code == 0, err
    assert 'rank 0 sent' in out
    assert 'rank 1 got it all' in (tmp_path / 'ranks' / 'rank1.log'
                                   ).read_text()


STOPS = '''
import os
import chainermn


def test_a_peer_is_lost():
    comm = chainermn.create_communicator()
    if comm.rank == 1:
        os._exit(3)
    comm.allreduce_obj(1)
'''


def test_a_ranks_stop_line_reaches_its_output_under_pytest(tmp_path):
    # pytest captures fd 2 into a file of its own, which os._exit never
    # prints: the line goes to the stderr the rank was started with.
    (tmp_path / 'test_stop.py').write_text(STOPS)
    code, out, err = launch(tmp_path, 2, [
        '-m', 'pytest', '-q', '-p', 'no:cacheprovider', 'test_stop.py'])
    assert code == 3, err
    assert 'rank 1 failed (exit 3)' in err
    assert 'dasktrain.chainermn: rank 0 stops (PeerLost' in err


def test_last_words_reach_the_stderr_a_process_was_started_with(tmp_path):
    # A shell between, as launch's keeper is: the parent whose fd 2 the
    # process inherited, while its own now goes to a capture file.
    program = textwrap.dedent('''
        import os, tempfile
        capture = tempfile.TemporaryFile()
        os.dup2(capture.fileno(), 2)
        from dasktrain.chainermn.support import last_words
        last_words('rank 0 stops (PeerLost: gone)')
        os._exit(1)
    ''')
    run = subprocess.run(['sh', '-c', f'"{sys.executable}" -c "$0"; exit $?',
                          program], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1
    assert run.stderr.count('rank 0 stops (PeerLost: gone)') == 1


def test_buffers_statuses_and_names():
    from dasktrain.chainermn import mpi, mpitypes
    from dasktrain.chainermn.support import Unsupported
    assert doctest.testmod(mpitypes).failed == 0
    assert doctest.testmod(mpi).failed == 0
    data = bytearray(8)
    view = mpitypes.buffer_of([data, mpi.FLOAT])
    view[:] = [1.5, -2.0]  # writes the caller's memory, as MPI does
    assert np.frombuffer(data, np.float32).tolist() == [1.5, -2.0]
    assert mpitypes.buffer_of([data, 3, mpi.BYTE]).size == 3
    assert mpitypes.buffer_of(b'abc').tolist() == [97, 98, 99]
    with pytest.raises(ValueError, match='C-contiguous'):
        mpitypes.buffer_of(np.zeros((2, 2))[:, 0])
    with pytest.raises(Unsupported, match='v-variants'):
        mpitypes.buffer_of([data, ([1], [0]), mpi.BYTE])
    status = mpi.Status()
    mpitypes.fill(status, 1, 4, 12)
    assert (status.Get_source(), status.Get_tag(),
            status.Get_count(mpi.FLOAT)) == (1, 4, 3)
    assert mpi._typedict['f'] is mpi.FLOAT and mpi.INT.Get_size() == 4
    assert mpi.SUM(2, 3) == 5 and mpi.MAX(2, 3) == 3
    target = np.zeros(3)
    mpitypes.into(target, [1.0, 2.0], 'rank 1')
    assert target.tolist() == [1.0, 2.0, 0.0]
    with pytest.raises(ValueError, match='rank 1 sent 4 elements'):
        mpitypes.into(target, np.ones(4), 'rank 1')
    with pytest.raises(AttributeError, match='mpi4py.MPI.Intercomm'):
        _ = mpi.Intercomm
    # a job of one rank: COMM_WORLD alone, as a script run by itself
    world = mpi.COMM_WORLD
    assert (world.rank, world.size, world.allreduce(5)) == (0, 1, 5)
    assert world.Split(mpi.UNDEFINED) is mpi.COMM_NULL
    with pytest.raises(ValueError, match='another rank'):
        world.send('x', dest=0)


def test_a_synchronous_send_returns_once_received():
    # The ordering rule of ssend (and of a GPU send over NCCL), on the
    # mailbox over in-memory ordered channels: back only once the peer's
    # recv took the message; what the peer sends meanwhile is kept.
    from dasktrain.parallel.comm.mailbox import Mailbox

    queues = {0: queue.Queue(), 1: queue.Queue()}  # messages to a rank

    class End:
        def __init__(self, rank):
            self.rank = rank

        def send(self, obj, dest):
            queues[dest].put(obj)

        def recv(self, source):
            return queues[self.rank].get(timeout=30)

    sender, receiver = Mailbox(End(0)), Mailbox(End(1))
    returned = threading.Event()

    def ssend():
        sender.send('sync', dest=1, tag=7, sync=True)
        returned.set()
    thread = threading.Thread(target=ssend, daemon=True)
    thread.start()
    receiver.send('meanwhile', dest=0, tag=3)
    assert not returned.wait(0.2)  # nothing received yet: still waiting
    assert receiver.recv(0) == 'sync'  # any tag; the ack goes back
    assert returned.wait(30)
    thread.join()
    assert sender.recv(1, tag=3) == 'meanwhile'
    assert sender.waiting() == {} and receiver.waiting() == {}
    sender.send('plain', dest=1)  # back at once, nothing waited for
    assert receiver.recv_tagged(0) == (0, 'plain')


def test_arrays_handed_over_through_a_ring_and_segments_of_their_own():
    from dasktrain.parallel.comm.base import CollectiveError
    from dasktrain.parallel.comm.handover import (
        Inbox,
        Outbox,
        Placed,
        Ticket,
        room,
        take,
        worth_it,
    )
    assert doctest.testmod(sys.modules[room.__module__]).failed == 0
    out, inbox = Outbox(), Inbox()
    big = np.arange(1 << 14, dtype=np.float32).reshape(128, 128)[:, ::2]
    placed = out.place(big)  # a strided view: its elements, in order
    assert isinstance(placed, Placed) and placed.shape == (128, 64)
    ring = Path('/dev/shm') / placed.name
    assert ring.stat().st_mode & 0o777 == 0o600
    assert placed.name.startswith(out.prefix)
    got = inbox.take(placed)
    np.testing.assert_array_equal(got, big)
    assert got.flags.writeable and not ring.exists()  # mapped: name gone
    # the space is reused once read: many more bytes than the ring holds
    for i in range(200):
        placed = out.place(big + i)
        assert placed is not None and placed.name is None
        np.testing.assert_array_equal(inbox.take(placed), big + i)
        out.credit(inbox.ring, inbox.read)
    # unread, it fills: then no room, and a segment of its own serves
    while out.place(big) is not None:
        pass
    ticket = out.stow(big)
    assert isinstance(ticket, Ticket)
    segment = Path('/dev/shm') / ticket.name
    assert segment.stat().st_mode & 0o777 == 0o600
    np.testing.assert_array_equal(take(ticket), big)
    assert not segment.exists()  # freed when read
    with pytest.raises(CollectiveError, match='gone'):
        take(ticket)  # read once
    with pytest.raises(CollectiveError, match='not one'):
        take(Ticket('../etc/passwd', (1,), '<f4'))
    with pytest.raises(CollectiveError, match='not one of its rings'):
        inbox.take(Placed(None, 1 << 40, 0, (4,), '<f4', 16))
    # one nobody took goes when its sender closes
    unread = out.stow(np.ones(1 << 14))
    assert (Path('/dev/shm') / unread.name).exists()
    out.close()
    inbox.close()
    assert not (Path('/dev/shm') / unread.name).exists()
    assert not worth_it(np.ones(3), True) and not worth_it(big, False)
