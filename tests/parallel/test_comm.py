"""The communicator contract: every communicator declares all of it, and
the asynchronous all-reduce sums the arrays it was handed. No GPU, no
cluster: the classes are inspected, and a stand-in peer sums."""
import contextlib
import inspect
import threading

import numpy as np
import pytest

from dasktrain.errors import Error, UserError
from dasktrain.parallel.comm import (
    CollectiveError,
    Communicator,
    DaskComm,
    NcclComm,
    PeerLost,
    Solo,
)


def _parameters(method):
    return [(p.name, p.default)
            for p in inspect.signature(method).parameters.values()]


@pytest.mark.parametrize('cls', [Solo, DaskComm, NcclComm],
                         ids=lambda cls: cls.__name__)
def test_every_communicator_declares_every_member(cls):
    assert issubclass(cls, Communicator)
    assert not cls.__abstractmethods__  # every collective is implemented
    for name in Communicator.MEMBERS:
        declared = getattr(Communicator, name, None)
        if callable(declared):  # called alike on every communicator
            assert callable(getattr(cls, name)), name
            assert _parameters(getattr(cls, name)) == \
                _parameters(declared), name
        elif name in ('rank', 'size', 'timeout'):  # Communicator.__init__
            assert 'super().__init__(' in inspect.getsource(cls.__init__)
        else:  # a capability: each class states its own
            assert isinstance(cls.__dict__.get(name), bool), name


def test_solo_is_a_whole_job_of_one():
    comm = Solo()
    assert (comm.rank, comm.size, comm.timeout, comm.solo) == (0, 1, None,
                                                               True)
    a = np.arange(3.0)
    assert comm.allreduce([a])[0] is a
    assert comm.iallreduce([a]).wait()[0] is a
    assert comm.allgather(1) == comm.gather(1) == [1]
    assert comm.bcast('x') == 'x'
    comm.barrier()
    comm.close()
    assert not DaskComm.solo and not NcclComm.solo


def test_a_collective_fault_is_one_line_but_not_the_user_s_mistake():
    assert issubclass(CollectiveError, Error)
    assert issubclass(CollectiveError, RuntimeError)
    assert not issubclass(CollectiveError, UserError)
    assert issubclass(PeerLost, CollectiveError)


class Late(Communicator):
    """Rank 0 of two whose peer sends what it sends; the sum starts only
    once ``go`` is set, as a communication thread that starts late."""
    solo, sums_on_device = False, False

    def __init__(self, go=True):
        super().__init__(0, 2, 5.0)
        self.go = threading.Event()
        if go:
            self.go.set()

    def allreduce(self, arrays, check=False):
        assert self.go.wait(10)
        for a in arrays:
            a += a.copy()  # the peer's equal part
        return arrays

    def allgather(self, obj):
        return [obj, obj]

    def gather(self, obj):
        return [obj, obj]

    def bcast(self, obj):
        return obj

    def close(self):
        pass


def test_iallreduce_sums_the_arrays_it_was_given_whatever_comes_after():
    rng = np.random.default_rng(0)
    first = rng.standard_normal(5)
    second = rng.standard_normal((2, 3)).astype(np.float32)
    expected = Late().allreduce([first.copy(), second.copy()])
    arrays = [first, second]
    given = tuple(arrays)
    comm = Late(go=False)
    pending = comm.iallreduce(arrays)
    # The caller goes on at once: it rebinds its names and reuses its list
    # (a next step's arrays) before the sum has even started.
    first, second = np.zeros(5), None
    arrays[0] = np.full(5, 7.0)
    arrays.append(np.ones(3))
    comm.go.set()
    summed = pending.wait()
    assert len(summed) == 2 and all(s is g for s, g in zip(summed, given))
    for got, want in zip(given, expected):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(arrays[0], np.full(5, 7.0))
    np.testing.assert_array_equal(arrays[2], np.ones(3))
    assert pending.wait() is summed  # waiting again: the same answer


def test_iallreduce_runs_inside_its_context_on_its_own_thread():
    # On GPUs the context is the side stream: entered by the thread that
    # sums, left (the stream synchronised) before wait() returns.
    events = []

    class Recorded(Late):
        def allreduce(self, arrays, check=False):
            events.append(('sum', threading.current_thread().name))
            return super().allreduce(arrays, check)

    @contextlib.contextmanager
    def around():
        events.append(('enter', threading.current_thread().name))
        try:
            yield
        finally:  # as SideStream.after: synchronised after an error too
            events.append(('leave', threading.current_thread().name))
    comm = Recorded(go=True)
    pending = comm.iallreduce([np.ones(2)], around=around)
    pending.wait()
    assert [e[0] for e in events] == ['enter', 'sum', 'leave']
    assert {e[1] for e in events} == {'dasktrain-allreduce'}
    # also when the all-reduce fails: left, and the error raised here
    events.clear()

    class Failing(Late):
        def allreduce(self, arrays, check=False):
            raise CollectiveError('rank 1 closed its connection')
    pending = Failing().iallreduce([np.zeros(2)], around=around)
    with pytest.raises(CollectiveError):
        pending.wait()
    assert [e[0] for e in events] == ['enter', 'leave']


def test_iallreduce_raises_its_error_in_the_waiting_thread():
    class Failing(Late):
        def allreduce(self, arrays, check=False):
            raise CollectiveError('rank 1 closed its connection')
    pending = Failing().iallreduce([np.zeros(2)])
    with pytest.raises(CollectiveError, match='closed its connection'):
        pending.wait()


# ------------------------------------------- which arrays travel how

def test_a_flat_buffer_travels_as_itself_and_small_arrays_join():
    from dasktrain.parallel.comm.batches import (
        ITSELF_BYTES,
        batches,
        packing,
        place,
    )
    big = np.zeros(ITSELF_BYTES // 4, np.float32)  # a gradient bucket's
    small = [np.ones(3, np.float32), np.ones((2, 4))[:, ::2]]
    odd = np.zeros((ITSELF_BYTES // 4, 2), np.float32)[:, 0]
    cut = batches([small[0], big, small[1], odd, small[0].copy()])
    assert [(key, [a.shape for a in arrays]) for key, arrays in cut] == [
        ('<f4', [big.shape]), ('<f4', [odd.shape]),
        ('<f4', [(3,), (3,)]), ('<f8', [(2, 2)])]
    assert cut[0][1][0] is big  # nothing copied to decide
    assert packing([place(big)]) == 'itself'
    assert packing([place(odd)]) == 'host'  # a large view: copied
    assert packing([place(a) for a in small]) == 'host'
    # GPU arrays, by (device, contiguous): one GPU's join there
    assert packing([(0, True), (0, False)]) == 'device'
    assert packing([(1, True)]) == 'itself'
    assert packing([(0, True), (1, True)]) == 'each'
    assert packing([(None, True), (0, True)]) == 'each'


def test_the_examples_of_the_contract_and_of_the_arrays_hold():
    import doctest

    from dasktrain.parallel.comm import base, batches
    for module in (base, batches):
        result = doctest.testmod(module)
        assert result.attempted >= 4 and result.failed == 0, module.__name__


def test_the_flat_layout_places_each_gradient_once():
    from dasktrain.parallel.exchange.flat import layout
    from dasktrain.parallel.exchange.wire import ideal
    f2, f4, f8 = (np.dtype(t) for t in ('float16', 'float32', 'float64'))
    counts, where = layout([f4, f8, f4, f4], [3, 2, 4, 5], [[2, 0], [1, 3]])
    assert counts == [{'<f4': 7}, {'<f8': 2, '<f4': 5}]
    assert where == {2: (0, '<f4', 0), 0: (0, '<f4', 4),
                     1: (1, '<f8', 0), 3: (1, '<f4', 0)}
    counts, _ = layout([f4, f8], [3, 2], [[0, 1]], wire=f2)
    assert counts == [{'<f2': 5}]  # everything in the wire's dtype
    # the largest sum of 4 ranks stays below float16's maximum, with a
    # bit to spare: 2**k times the sum of the ranks' maxima <= 65504 / 2
    assert ideal([1.0, 0.0, float('nan')], 4, f2) == [14, 0, 0]
    assert 4 * 3.0 * 2.0 ** ideal([4 * 3.0], 4, f2)[0] <= 65504 / 2
