"""NcclComm's own life on one real GPU: a one-rank communicator whose
sums wait behind a kernel that spins on the stream (as a peer's lateness
would). Queued sums return before the stream runs them and are all done
after finish_queued; a close during a polled sum aborts the communicator
from another thread and the poller fails at once; a clean close destroys
it; every end is bounded. Skipped without a GPU or a usable NCCL."""
import threading
import time

import numpy as np
import pytest
from gpu_marks import needs, needs_nccl

import dasktrain.parallel.comm.nccl as nccl_module
from dasktrain.parallel.comm import CollectiveError, NcclComm

pytestmark = [needs(1), needs_nccl]

SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
'''


class Alone:
    """The host communicator of a one-rank NCCL communicator."""
    rank, size, timeout = 0, 1, 30.0

    def bcast(self, obj):
        return obj

    def allreduce(self, arrays, check=False):
        return arrays


@pytest.fixture
def stuck(monkeypatch):
    """What a stuck abort or destroy would have ended the process for
    (recorded, not exited: this is pytest's process)."""
    seen = []
    monkeypatch.setattr(nccl_module, '_exit_stuck', seen.append)
    return seen


def spinner(seconds):
    """A launcher of a kernel that keeps the current stream busy for
    about ``seconds``."""
    import cupy
    kernel = cupy.RawKernel(SPIN, 'spin')
    kernel((1,), (1,), (np.int64(1 << 20),))
    cupy.cuda.get_current_stream().synchronize()
    began = time.perf_counter()
    kernel((1,), (1,), (np.int64(1 << 26),))
    cupy.cuda.get_current_stream().synchronize()
    rate = (1 << 26) / (time.perf_counter() - began)
    cycles = np.int64(rate * seconds)
    return lambda: kernel((1,), (1,), (cycles,))


def test_queued_sums_leave_before_the_stream_runs_them(stuck):
    import cupy
    comm = NcclComm(Alone(), 0)
    try:
        with cupy.cuda.Device(0):
            spin = spinner(0.5)
            bufs = [cupy.full(1000, i, 'float32') for i in range(3)]
            spin()
            began = time.perf_counter()
            for b in bufs:
                comm.allreduce_queued([b])
            queued = time.perf_counter() - began
            comm.finish_queued()
            done = time.perf_counter() - began
            assert cupy.cuda.get_current_stream().done
        assert queued < 0.2 < 0.4 < done  # queued behind the spin, waited
        for i, b in enumerate(bufs):  # one rank: the sum is the array
            np.testing.assert_array_equal(cupy.asnumpy(b), np.full(1000, i))
        assert comm._queued == {}
    finally:
        comm.close()
    assert not comm._failed and stuck == []  # destroyed, in time


def test_a_close_during_a_polled_sum_aborts_and_the_poller_fails_at_once(
        stuck):
    import cupy
    comm = NcclComm(Alone(), 0)
    errors, ended = [], []

    def poller():
        with cupy.cuda.Device(0):
            try:
                comm.allreduce([ones])
            except CollectiveError as e:
                errors.append(str(e))
            ended.append(time.perf_counter())
    with cupy.cuda.Device(0):
        # allocated first: a cudaMalloc may wait for the device's work
        ones = cupy.ones(1000, 'float32')
        spin = spinner(3.0)
        spin()  # on this thread's stream: the legacy one, which the
    thread = threading.Thread(target=poller, daemon=True)  # poller's
    thread.start()                                    # sum queues behind
    time.sleep(0.5)
    assert thread.is_alive() and comm._busy == 1
    began = time.perf_counter()
    comm.close()  # a call in flight: abort, from this thread
    thread.join(10)
    assert not thread.is_alive()
    assert comm._failed and stuck == []
    assert errors and 'rank 0' in errors[0] and '\n' not in errors[0]
    assert ended[0] - began < 1.0  # not the spin's 3 s, nor the timeout
    with cupy.cuda.Device(0):
        cupy.cuda.Device(0).synchronize()  # the spin ends; nothing hangs


def test_a_close_while_an_error_propagates_aborts(stuck):
    comm = NcclComm(Alone(), 0)
    with pytest.raises(ValueError):
        try:
            raise ValueError('the training failed')
        finally:
            comm.close()
    assert comm._failed and stuck == []
