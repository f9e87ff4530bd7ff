"""ChainerMN's model parallelism on ``dasktrain launch``, with real
processes, against one process doing the same maths (float64, 1e-10):
a model split over two ranks, two replicas of it on four ranks (dual
parallelism), a convolution split by channels (``allgather``), an
encoder-decoder (``create_multi_node_n_step_rnn``, ``pseudo_connect``)
and every communication function's backward (a numerical gradient check
across the ranks, and the one-process graph's gradients). Also the
communicator's messages and sub-communicators, and ``import chainermn``
under ``launch`` (the scripts in tests/chainermn/ranks import it
unchanged)."""
import importlib.util
import pickle
import subprocess
import sys
import time
from pathlib import Path

import chainer
import chainer.functions as F
import numpy as np
import pytest
from test_chainermn import launch

RANKS = Path(__file__).resolve().parent / 'ranks'
SITE = Path(np.__file__).resolve().parents[1]  # this venv's site-packages


def _load_parts():
    spec = importlib.util.spec_from_file_location('chainermn_ranks_parts',
                                                  RANKS / 'parts.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


parts = _load_parts()


def run(tmp_path, n, script, *args, timeout=240):
    code, out, err = launch(tmp_path, n, [RANKS / script, *args],
                            '--timeout', '60', timeout=timeout)
    assert code == 0, err
    return out, err


def close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10, err_msg=what)


def unprefixed(saved):
    """A MultiNodeChainList's parameters by the whole MLP's names."""
    return {'/' + k.split('/', 2)[2]: v for k, v in saved.items()}


@pytest.mark.equivalence
def test_a_model_split_over_two_ranks_trains_as_the_whole(tmp_path,
                                                          float64):
    out, err = run(tmp_path, 2, 'mp_mlp.py', tmp_path, 6, 8)
    assert 'rank 0 saved' in out
    # said once, by rank 0: the script's `import chainermn` was dasktrain's
    assert err.count("the ranks' `import chainermn` is "
                     'dasktrain.chainermn') == 1
    whole = parts.train_whole(6, 8)
    got = {}
    for r in (0, 1):
        got.update(unprefixed(dict(np.load(tmp_path / f'rank{r}.npz'))))
    assert sorted(got) == sorted(whole)  # l1 on rank 0, l2 and l3 on 1
    for name in whole:
        close(got[name], whole[name], name)


@pytest.mark.equivalence
def test_dual_parallel_2x2_trains_as_one_process_on_the_whole_batch(
        tmp_path, float64):
    run(tmp_path, 4, 'dual_mlp.py', tmp_path, 5, 4, timeout=300)
    # the multi-node optimizer's first update broadcasts, nothing more
    whole = parts.train_whole(5, 8, skip_first=True)
    for r in range(4):
        got = unprefixed(dict(np.load(tmp_path / f'rank{r}.npz')))
        assert sorted(got) == (['/l1/W', '/l1/b'] if r % 2 == 0 else
                               ['/l2/W', '/l2/b', '/l3/W', '/l3/b'])
        for name, value in got.items():
            close(value, whole[name], f'rank {r} {name}')


@pytest.mark.equivalence
def test_a_convolution_split_by_channels_equals_the_whole(tmp_path,
                                                          float64):
    run(tmp_path, 3, 'parallel_conv.py', tmp_path, 4, 5)
    whole, first = parts.train_conv(4, 5)
    for r in range(3):
        got = np.load(tmp_path / f'rank{r}.npz')
        mine = parts.channels(r, 3)
        close(got['first'], first, f'rank {r} output')  # the whole conv's
        close(got['W'], whole['/W'][mine], f'rank {r} W')
        close(got['b'], whole['/b'][mine], f'rank {r} b')


@pytest.mark.equivalence
def test_an_encoder_decoder_over_two_ranks_trains_as_one(tmp_path,
                                                         float64):
    run(tmp_path, 2, 'seq2seq.py', tmp_path, 5, 3)
    encoder, decoder = (dict(np.load(tmp_path / f'rank{r}.npz'))
                        for r in (0, 1))
    # the synchronized iterators drew the same batches on both ranks
    np.testing.assert_array_equal(encoder.pop('drawn'), decoder.pop('drawn'))
    data = parts.pairs(12)
    batches = [[data[i] for i in b] for b in np.load(
        tmp_path / 'rank0.npz')['drawn']]
    want = parts.train_seq2seq(batches)
    for got, whole in zip((encoder, decoder), want):
        assert len(got) == len(whole)
        for name, value in whole.items():
            close(got[name.replace('/rnn/', '/rnn/actual_rnn/')], value,
                  name)


def reference(case, ranks):
    """The gradients of every rank's inputs and its outputs, computed as
    one process (the collectives are copies in one graph); ``ranks``:
    each rank's saved inputs and weights."""
    xs = [[chainer.Variable(x) for x in ranks[r]['x']] for r in range(3)]
    if case == 'chain':
        (a,), (b,), (c,) = xs
        outputs = {2: [a * 2 * b * c, a]}
    elif case == 'bcast':
        outputs = {r: [xs[1][0]] for r in range(3)}
    elif case == 'gather':
        outputs = {2: [xs[1][0], xs[2][0]]}
    elif case == 'scatter':
        outputs = {r: [xs[0][r]] for r in range(3)}
    elif case == 'allgather':
        outputs = {r: [xs[p][0] for p in range(3)] for r in range(3)}
    else:  # alltoall: rank q gets input q of every rank p
        outputs = {q: [xs[p][q] for p in range(3)] for q in range(3)}
    loss = sum(F.sum(y * g) for r, ys in outputs.items()
               for y, g in zip(ys, ranks[r]['g']))
    loss.backward()
    return ([[None if v.grad is None else v.grad for v in vs] for vs in xs],
            {r: [y.array for y in ys] for r, ys in outputs.items()})


@pytest.mark.equivalence
def test_each_function_backward_against_its_one_process_graph(tmp_path,
                                                              float64):
    """send/recv (with a tag, a tuple and an unused array), bcast,
    gather, scatter, allgather, alltoall among 3 ranks: each rank's
    script checks the gradients numerically across the ranks (it fails
    otherwise); here they and the outputs are compared with one
    process's graph."""
    out, _ = run(tmp_path, 3, 'collectives.py', tmp_path)
    assert 'every function checked' in out
    ranks = []
    for r in range(3):
        with open(tmp_path / f'rank{r}.pkl', 'rb') as f:
            ranks.append(pickle.load(f))
    for case in ranks[0]:
        grads, outputs = reference(case, [ranks[r][case] for r in range(3)])
        for r in range(3):
            numeric, analytic = ranks[r][case]['check']
            assert abs(numeric - analytic) < 1e-6 * max(1, abs(analytic))
            for i, (got, want) in enumerate(zip(ranks[r][case]['gx'],
                                                grads[r])):
                if want is None:  # an input no output depends on
                    assert got is None or not got.any(), (case, r, i)
                else:
                    close(got, want, f'{case}: rank {r} input {i}')
            for i, want in enumerate(outputs.get(r, [])):
                close(ranks[r][case]['y'][i], want,
                      f'{case}: rank {r} output {i}')


def test_messages_collectives_and_sub_communicators(tmp_path):
    out, err = run(tmp_path, 3, 'messages.py')
    assert 'rank 0 ok' in out
    for r in (1, 2):
        assert f'rank {r} ok' in (tmp_path / 'ranks' / f'rank{r}.log') \
            .read_text()


IMPORTS = '''
import sys
import chainermn, chainermn.functions, chainermn.links, chainermn.iterators
from chainermn.extensions import ObservationAggregator
from chainermn.links import MultiNodeChainList
from chainermn.communicators import CommunicatorBase
import chainermn.global_except_hook, chainermn.optimizers
print('chainermn is', chainermn.__name__, chainermn.functions.__name__,
      MultiNodeChainList.__module__, chainermn.optimizers.__name__)
if sys.argv[1:] == ['dask-first']:
    import dasktrain.chainermn
    assert sys.modules['chainermn'] is dasktrain.chainermn
'''


def test_import_chainermn_is_dasktrain_under_launch_only(tmp_path):
    script = tmp_path / 'imports.py'
    script.write_text(IMPORTS)
    before = sorted(p.name for p in SITE.iterdir())
    ours = 'chainermn is dasktrain.chainermn dasktrain.chainermn.functions ' \
           'dasktrain.chainermn.links dasktrain.chainermn.optimizers'
    out, err = run(tmp_path, 2, script)
    assert ours in out
    assert ours in (tmp_path / 'ranks' / 'rank1.log').read_text()
    # dasktrain.chainermn imported first, `import chainermn` after: the same
    first = tmp_path / 'first.py'
    first.write_text('import dasktrain.chainermn\n' + IMPORTS)
    out, _ = run(tmp_path, 2, first, 'dask-first')
    assert ours in out
    # --no-chainermn: the installed ChainerMN
    code, out, err = launch(tmp_path, 2, [script], '--no-chainermn')
    assert code == 0, err
    assert 'chainermn is chainermn chainermn.functions ' \
           'chainermn.links.multi_node_chain_list chainermn.optimizers' in out
    assert "`import chainermn` is" not in err
    # outside launch, even after importing dasktrain.chainermn
    alone = subprocess.run([sys.executable, first], capture_output=True,
                           text=True, timeout=120, cwd=tmp_path)
    assert 'chainermn is chainermn chainermn.functions' in alone.stdout
    # nothing written into site-packages; the launch's folder is gone
    assert sorted(p.name for p in SITE.iterdir()) == before
    assert not list((tmp_path / 'ranks').glob('.chainermn-*'))


HANGS = '''
import threading, time, chainermn
comm = chainermn.create_communicator('naive')
if comm.rank == 1:
    threading.Thread(target=time.sleep, args=(600,)).start()  # no daemon
    raise ValueError('rank 1 broke')
time.sleep(600)
'''


def test_global_except_hook_ends_a_rank_a_thread_keeps_alive(tmp_path,
                                                             monkeypatch):
    script = tmp_path / 'hangs.py'
    script.write_text(HANGS)
    monkeypatch.setenv('CHAINERMN_FORCE_ABORT_ON_EXCEPTION', '1')
    started = time.monotonic()
    code, _, err = launch(tmp_path, 2, [script], timeout=120)
    assert code == 1
    assert 'rank 1 failed (exit 1)' in err
    assert 'ValueError: rank 1 broke' in err  # its own traceback
    assert 'uncaught exception on rank 1' in err
    assert time.monotonic() - started < 100


def test_the_pure_decisions():
    from dasktrain.chainermn.models import groups
    from dasktrain.parallel.comm.mailbox import take
    from dasktrain.parallel.comm.mesh import group
    from dasktrain.parallel.comm.ncclpair import byte_layout, route, unpack
    assert group([(1, 0), (0, 0), (1, -1), (0, 0)], 1) == [2, 0]
    assert group([(1, 0), (0, 0), (1, -1), (0, 0)], 0) == [1, 3]
    # every array at an offset aligned for any dtype, in one buffer
    offsets, total = byte_layout([3, 8, 0, 16])
    assert offsets == [0, 256, 512, 512] and total == 528
    assert all(o % 256 == 0 for o in offsets)
    assert route([True, True], [8, 8], True) == 'nccl'
    assert route([True, False], [0, 8], True) == 'host'  # no GPU bytes
    assert route([True], [8], False) == 'host'
    assert route([False, False], [8, 8], True) is None
    # a message's arrays back from its one buffer: views, nothing copied
    # (a NumPy buffer here, a GPU's under NCCL)
    sent = [np.arange(3, dtype=np.float16), np.array(5, np.int64),
            np.zeros((0, 2)), np.array([[True, False]]),
            np.arange(6.0).reshape(2, 3)]
    offsets, total = byte_layout([a.nbytes for a in sent])
    buffer = np.zeros(total, np.uint8)
    for a, start in zip(sent, offsets):
        buffer[start:start + a.nbytes] = a.reshape(-1).view(np.uint8)
    got = unpack(buffer, [(a.shape, a.dtype.str) for a in sent])
    for a, b in zip(got, sent):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        np.testing.assert_array_equal(a, b)
        assert a.size == 0 or np.shares_memory(a, buffer)
    import collections
    kept = collections.deque([(2, 'b', None), (1, 'a', 7), (2, 'c', None)])
    assert take(kept, 2) == ((2, 'b', None), True)
    assert take(kept, None) == ((1, 'a', 7), True)
    assert list(kept) == [(2, 'c', None)]
    # a model's gradients: one buffer per dtype (and device)
    arrays = [np.zeros(3), np.zeros(2, np.float32), np.zeros((2, 2))]
    assert [len(g) for g in groups(arrays)] == [2, 1]
