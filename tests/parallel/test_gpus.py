"""The GPU path's decisions, given what a GPU machine would give them:
CUDA_VISIBLE_DEVICES values, worker GPU counts, NCCL present or not. None
of this needs a GPU; tests/gpu/ runs the same paths on real ones."""
import time
import types

import numpy as np
import pytest

from dasktrain.config import TrainConfig
from dasktrain.errors import flag_names
from dasktrain.jobs.job import JobError
from dasktrain.jobs.request import check_devices
from dasktrain.parallel.comm import CollectiveError, NcclComm, poll, signature
from dasktrain.parallel.cuda_driver import format_uuid
from dasktrain.parallel.gpus import (
    INSTALL_CUPY,
    NCCL_MISSING,
    Gpu,
    GpuError,
    GpuPool,
    GpuUse,
    gpu_ids,
    gpu_refusal,
    nccl_problem,
    nccl_version,
    place_devices,
    rank_gpu,
    refuse_shared_gpu,
    shared_gpu,
    unusable_gpus,
    use_nccl,
    visible_gpus,
    with_visible_gpus,
)
from dasktrain.parallel.placement import launched_devices, machine_place


@pytest.mark.parametrize('value,count,expected', [
    (None, 3, ['0', '1', '2']),                  # unset: all the driver has
    ('2,3', None, ['2', '3']),
    ('1,0', 2, ['1', '0']),                      # CUDA order, not sorted
    ('', 4, []),                                 # set but empty: none
    ('0,1,2,3', 2, ['0', '1']),                  # the worker offers 2
    ('GPU-8f6c2a,MIG-1b2c/1/0', None, ['GPU-8f6c2a', 'MIG-1b2c/1/0']),
    ('3, 1', None, ['3', '1']),
    ('0,nope,1', None, ['0']),                   # CUDA stops at a bad entry
])
def test_visible_gpus_follow_cuda(value, count, expected):
    env = {} if value is None else {'CUDA_VISIBLE_DEVICES': value}
    assert visible_gpus(env, count=count) == expected


@pytest.fixture
def pool():
    GpuPool.used.clear()
    yield GpuPool
    GpuPool.used.clear()


def test_pool_hands_out_ordinals_with_their_entries(pool):
    # A worker started with CUDA_VISIBLE_DEVICES=2,3: CUDA calls them 0, 1.
    env = {'CUDA_VISIBLE_DEVICES': '2,3'}
    first = pool.acquire(1, total=2, env=env)
    second = pool.acquire(1, total=2, env=env)
    assert first == [Gpu(0, '2')] and second == [Gpu(1, '3')]
    # a rank on the second uses @cupy:1, never the invalid @cupy:3
    assert place_devices(None, [g.index for g in second]) == ('@cupy:1',)
    with pytest.raises(GpuError, match='1 GPU asked'):
        pool.acquire(1, total=2, env=env)
    pool.release(first)
    assert pool.acquire(1, total=2, env=env) == [Gpu(0, '2')]


def test_pool_in_reversed_order_takes_no_other_rank_s_gpu(pool):
    env = {'CUDA_VISIBLE_DEVICES': '1,0'}
    a = pool.acquire(1, total=2, env=env)
    b = pool.acquire(1, total=2, env=env)
    assert a == [Gpu(0, '1')] and b == [Gpu(1, '0')]
    assert {g.index for g in a + b} == {0, 1}  # distinct CUDA ordinals


def test_pool_with_uuids_and_mig(pool):
    env = {'CUDA_VISIBLE_DEVICES': 'GPU-aaa,MIG-bbb'}
    gpus = pool.acquire(2, total=2, env=env)
    assert gpus == [Gpu(0, 'GPU-aaa'), Gpu(1, 'MIG-bbb')]
    child = with_visible_gpus({'PATH': '/bin'}, gpus)
    assert child['CUDA_VISIBLE_DEVICES'] == 'GPU-aaa,MIG-bbb'
    assert child['PATH'] == '/bin'


def test_a_job_without_gpus_sees_none():
    env = with_visible_gpus({'CUDA_VISIBLE_DEVICES': '0,1,2,3'}, [])
    assert env['CUDA_VISIBLE_DEVICES'] == ''
    assert visible_gpus(env, count=4) == []


@pytest.mark.parametrize('devices,given,expected', [
    (('@cupy:2', '@cupy:3'), [0, 1], ('@cupy:0', '@cupy:1')),
    (('@cupy:3', '@cupy:2'), [0, 1], ('@cupy:0', '@cupy:1')),
    (('@cupy:5', '@cupy:5'), [1], ('@cupy:1', '@cupy:1')),
    (None, [1, 0], ('@cupy:1', '@cupy:0')),
    (None, [], None),
    (('@numpy', '@numpy'), [0], ('@numpy', '@numpy')),  # CPU: as given
])
def test_devices_are_renumbered_onto_the_given_gpus(devices, given,
                                                    expected):
    assert place_devices(devices, given) == expected


def test_devices_naming_other_gpus_than_reserved_are_refused():
    with pytest.raises(GpuError, match=r'devices 2,3,4 names 3 GPUs '
                                       r'but 2 were reserved'):
        place_devices(('@cupy:2', '@cupy:3', '@cupy:4'), [0, 1])
    with pytest.raises(JobError, match='names 2 GPU'):
        check_devices(TrainConfig(devices=('@cupy:2', '@cupy:3')), 1)
    with pytest.raises(JobError, match='but 0 were reserved'):
        check_devices(TrainConfig(devices=('@cupy:0',)), 0)
    check_devices(TrainConfig(devices=('@cupy:2', '@cupy:3')), 2)
    check_devices(TrainConfig(devices=('@numpy',)), 0)
    assert gpu_ids(('@cupy:3', '@numpy', '@cupy:3', '@cupy:0')) == [3, 0]


# Each rank: (its devices, its machine, its CUDA_VISIBLE_DEVICES or None
# for unset, the driver's UUIDs of its ordinals or None where it cannot say)
A, B = '10.0.0.1', '10.0.0.2'


@pytest.mark.parametrize('ranks,shared', [
    # CPU ranks share nothing
    ([(('@numpy',), A, None, None)] * 2, None),
    ([(('@numpy',) * 2, A, '', None)] * 2, None),
    # `launch --devices 0,1 -- dasktrain train`: each rank its own
    ([(launched_devices(None, 2, r, 2), A, '0,1', None) for r in range(2)],
     None),
    # `launch --devices 0,1 -- dasktrain train --devices @cupy:0`
    ([(('@cupy:0',), A, '0,1', None)] * 2, (0, 1)),
    # ... on a GPU machine, where the driver names the GPU too
    ([(('@cupy:0',), A, '0,1', ['GPU-a', 'GPU-b'])] * 2, (0, 1)),
    # one GPU, however it is spelt
    ([((0,), A, None, None), (('@cupy:0',), A, None, None)], (0, 1)),
    ([(('0',), A, None, None), (('cuda:0',), A, None, None)], (0, 1)),
    ([(('@numpy',), A, None, None), (('@cupy:1',), A, None, None),
      ((1,), A, None, None)], (1, 2)),
    # ... or whichever ordinal shows it: physical GPU 1 both times
    ([(('@cupy:1',), A, '0,1', None), (('@cupy:0',), A, '1', None)],
     (0, 1)),
    ([(('@cupy:0',), A, 'GPU-a', None), (('@cupy:0',), B, None, ['GPU-a'])],
     (0, 1)),
    # two machines: GPU 0 of each is another GPU
    ([(('@cupy:0',), A, None, None), (('@cupy:0',), B, None, None)], None),
    ([(('@cupy:0',), A, None, ['GPU-a']), (('@cupy:0',), B, None,
                                           ['GPU-b'])], None),
    # two containers of one address (host network), each its own GPU 0:
    # the driver's UUIDs tell them apart
    ([(('@cupy:0',), A, None, ['GPU-a']), (('@cupy:0',), A, None,
                                           ['GPU-b'])], None),
    # a rank's further replicas may be on another rank's GPU: only its
    # first (its master, NCCL's) is its own
    ([(('@cupy:0', '@cupy:1'), A, '0,1', None),
      (('@cupy:0', '@cupy:1'), A, '1,0', None)], None),
    # two replicas of one rank on one GPU: one rank
    ([(('@cupy:0', '@cupy:0'), A, '0', None),
      (('@cupy:0',), A, '1', None)], None),
])
def test_ranks_holding_one_gpu_are_told_apart_from_those_that_do_not(
        ranks, shared):
    uses = [rank_gpu(devices, machine,
                     visible_gpus({} if visible is None else
                                  {'CUDA_VISIBLE_DEVICES': visible}), uuids)
            for devices, machine, visible, uuids in ranks]
    assert shared_gpu(uses) == shared
    if shared is None:
        refuse_shared_gpu(uses)  # nothing to refuse
        return
    with pytest.raises(GpuError) as refused:
        refuse_shared_gpu(uses)
    line = str(refused.value)
    assert '\n' not in line
    assert line.startswith(f'ranks {shared[0]} and {shared[1]} would both '
                           'train on GPU ')
    assert 'which NCCL does not support (it may hang)' in line
    assert 'leave --devices out' not in line  # named as from Python
    assert 'leave devices out: each rank takes its own' in line


def test_a_refused_gpu_is_named_by_its_entry_its_uuid_and_its_machine():
    with pytest.raises(GpuError, match=r'both train on GPU 1 \(GPU-b\) of '
                                       r'10\.0\.0\.1, which NCCL'):
        refuse_shared_gpu([GpuUse(A, '1', 'GPU-b')] * 2)
    with pytest.raises(GpuError, match=r'both train on GPU MIG-c of '):
        refuse_shared_gpu([GpuUse(A, 'MIG-c', 'MIG-c')] * 2)
    with pytest.raises(GpuError, match=r'GPU 0, which NCCL .* each rank its '
                                       r'own GPU \(use GPU comm.intra_rank\)'):
        refuse_shared_gpu([GpuUse(None, '0', None)] * 2,
                          remedy='use GPU comm.intra_rank')


def test_a_rank_s_place_on_its_machine_is_by_machine_not_hostname():
    # Clones of one image share a hostname: ranks tell their machines
    # apart by the host each listens on. Two such hosts are two machines,
    # each rank first (its GPU 0) on its own.
    machines = [A, B, A, B]
    assert [machine_place(machines, r) for r in range(4)] == \
        [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]
    assert [launched_devices(None, 2, *machine_place(machines, r)[:2])
            for r in range(4)] == [('@cupy:0',), ('@cupy:0',),
                                   ('@cupy:1',), ('@cupy:1',)]
    assert machine_place(['127.0.0.1'] * 3, 2) == (2, 3, 0, 1)
    assert machine_place([None], 0) == (0, 1, 0, 1)  # a job of one


def nccl_module(available=True, version=22809):
    """What launch reads of ``cupy.cuda.nccl``: ``available`` and
    ``get_version()`` (ncclGetVersion's code)."""
    return types.SimpleNamespace(available=available,
                                 get_version=lambda: version)


def test_nccl_is_used_only_where_it_loaded_and_is_recent():
    loaded = nccl_module()
    missing = nccl_module(available=False)  # cupy-cudaXXx alone
    assert use_nccl(('@cupy:0',), loaded)
    assert not use_nccl(('@cupy:0',), missing)
    assert not use_nccl(('@cupy:0',), None)       # no CuPy at all
    assert not use_nccl(('@numpy',), loaded)      # CPU ranks: Dask comms
    assert 'nvidia-nccl' in NCCL_MISSING and '\n' not in NCCL_MISSING
    assert nccl_problem(missing) == NCCL_MISSING
    # NCCL_COMM_BLOCKING needs 2.14, an abort from another thread 2.19.1,
    # a sum completed from any thread 2.26: older ones fall back, saying
    # which
    for code, words in ((22505, '2.25.5'), (22203, '2.22.3'),
                        (21901, '2.19.1'), (21306, '2.13.6'),
                        (2708, '2.7.8'), (0, 'older than 2.3.4')):
        old = nccl_module(version=code)
        assert not use_nccl(('@cupy:0',), old)
        problem = nccl_problem(old)
        assert f'NCCL {words} is older than 2.26' in problem
        assert 'Dask comms' in problem and '\n' not in problem
    assert nccl_problem(nccl_module(version=22703)) is None
    assert nccl_problem(nccl_module(version=22809)) is None
    assert nccl_problem(nccl_module(version=22602)) is None
    assert nccl_version(20906) == (2, 9, 6)


def test_poll_raises_and_aborts_at_the_deadline():
    aborted = []
    began = time.monotonic()
    with pytest.raises(CollectiveError, match='NCCL set-up did not finish'):
        poll(lambda: False, began + 0.2, 'NCCL set-up',
             lambda: aborted.append(True))
    assert aborted == [True] and time.monotonic() - began < 5
    calls = iter([False, False, True])
    poll(lambda: next(calls), time.monotonic() + 5, 'x', aborted.clear)
    assert aborted == [True]

    def failing():
        raise CollectiveError('NCCL failed on rank 1: unhandled cuda error')
    with pytest.raises(CollectiveError, match='unhandled cuda error'):
        poll(failing, time.monotonic() + 5, 'x', lambda: None)


def test_signature_tells_ranks_apart():
    a = [np.zeros(3, np.float32), np.zeros((2, 2))]
    assert signature(a) == [('<f4', 3), ('<f8', 4)]
    assert signature(a, where=True) == [('<f4', 3, False), ('<f8', 4, False)]
    assert signature(a) != signature(a[:1])


SMI = ['GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)',
       'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2)']
NO_CUPY = "No module named 'cupy'"
NO_NVRTC = ('CuPy cannot load NVRTC: Failure finding "libnvrtc.so": No '
            'such file')  # CuPy 14 without its [ctk] wheels, no toolkit
NO_DEVICE = ('CUDA finds no device: cudaErrorNoDevice: no CUDA-capable '
             'device is detected')


# What a GPU machine gives the decision: nvidia-smi's GPUs, CuPy's count
# and reason (gpu_count), the devices asked for, CUDA_VISIBLE_DEVICES.
@pytest.mark.parametrize('count,problem,devices,visible,refused', [
    (0, NO_CUPY, None, None, True),              # the default: every GPU
    (0, NO_NVRTC, None, None, True),             # a library missing
    (0, NO_CUPY, ('@cupy:0',), None, True),      # GPUs named
    (0, NO_CUPY, ('@numpy', '@cupy:1'), None, True),
    (0, NO_CUPY, ('@numpy',), None, False),      # --devices cpu
    (0, NO_NVRTC, ('@numpy',) * 4, None, False),  # --devices cpu:4
    (2, None, None, None, False),                # CuPy uses them
    (0, NO_DEVICE, None, '', False),             # hidden: a CPU job
    (0, NO_CUPY, None, '-1', False),             # hidden, CUDA's way
    (0, NO_DEVICE, None, '7', True),             # names a GPU not there
])
def test_a_run_is_refused_where_cupy_cannot_use_the_gpus(
        count, problem, devices, visible, refused):
    line = gpu_refusal(SMI, count, problem, devices, visible)
    assert (line is not None) == refused
    assert (unusable_gpus(SMI, count, problem, visible) is not None) == \
        (refused or (count == 0 and visible is None))
    if refused:
        shown = '' if visible is None else f'; CUDA_VISIBLE_DEVICES={visible}'
        assert line == (f'nvidia-smi sees 2 GPUs, but CuPy cannot use them '
                        f'({problem}{shown}): {INSTALL_CUPY}; or pass '
                        'devices cpu to train on the CPU')
    # without GPUs listed (no driver, or nvidia-smi failed) nothing is
    assert gpu_refusal([], count, problem, devices, visible) is None
    assert gpu_refusal(['No devices were found'], count, problem,
                       devices, visible) is None


def test_the_refusal_says_what_to_install_and_names_the_flag():
    with flag_names():
        line = gpu_refusal(SMI[:1], 0, NO_CUPY)
    assert line.startswith("nvidia-smi sees 1 GPU, but CuPy cannot use it "
                           "(No module named 'cupy'): install CuPy with its "
                           "CUDA libraries: `make install` in dasktrain's "
                           'checkout')
    assert "pip install 'dasktrain[cuda13]'" in line
    assert "'dasktrain[cuda12]' for CUDA 12" in line
    assert line.endswith('; or pass --devices cpu to train on the CPU')
    assert '\n' not in line


def test_nccl_in_progress_is_waited_for_and_errors_raised():
    class NcclError(RuntimeError):  # as cupy_backends' NcclError
        def __init__(self, status):
            self.status = status
            super().__init__(f'NCCL error {status}')
    comm = NcclComm.__new__(NcclComm)
    comm._nccl, comm.rank = types.SimpleNamespace(NcclError=NcclError), 1

    def in_progress():  # CuPy's NcclError(7) dies on its message table
        raise KeyError(7)
    comm._call(in_progress)  # not an error: poll until settled
    comm._call(lambda: (_ for _ in ()).throw(NcclError(7)))

    def failed():
        raise NcclError(2)
    with pytest.raises(CollectiveError, match='NCCL failed on rank 1'):
        comm._call(failed)
    with pytest.raises(KeyError):  # not NCCL's: let it through
        comm._call(lambda: {}['missing'])


def test_uuids_are_spelled_as_nvidia_smi_does():
    raw = bytes.fromhex('8f6c2a1b00d44e1f9a0b00c1d2e3f405')  # zero bytes
    assert format_uuid(raw) == 'GPU-8f6c2a1b-00d4-4e1f-9a0b-00c1d2e3f405'


def test_a_failed_runs_model_can_be_collected_before_its_error_is_gone():
    import gc
    import traceback
    import weakref

    from dasktrain.parallel.devices import frames_released

    class Model:
        pass
    refs = []

    def run():
        model = Model()  # held by this frame's locals
        refs.append(weakref.ref(model))
        raise ValueError('the run failed')
    try:
        with frames_released():
            run()
    except ValueError as e:
        gc.collect()
        assert refs[0]() is None  # freeable while the error still exists
        lines = ''.join(traceback.format_tb(e.__traceback__))
        assert "raise ValueError('the run failed')" in lines


@pytest.mark.parametrize('options', [
    {}, {'comm': 'mirror'}, {'comm': 'mirror', 'bucket_mb': 1e-3},
    {'mode': 'ipm', 'mix_every': 1},
    *({'comm': 'mirror', 'double_buffering': True, 'warmup': 0,
       'stale': recipe} for recipe in ('corrected', 'predicted', 'plain'))],
    ids=str)
def test_no_step_synchronises_a_whole_device(options, monkeypatch):
    # devices.synchronize is cudaDeviceSynchronize on each GPU: it would
    # also wait for a side stream's all-reduce (no overlap left, and its
    # time counted nowhere). Steps order their work by streams and events
    # (Clock, devices.transfer); the CPU counts the calls all the same.
    import chainer
    from test_parallel import Mirror, batch, fresh

    import dasktrain.parallel.devices as devices_module
    import dasktrain.parallel.replicas as replicas_module
    from dasktrain.parallel import GPUDistributedGradient
    calls = []
    for module in (devices_module, replicas_module):
        monkeypatch.setattr(module, 'synchronize', calls.append)
    options = dict(options)
    comm = Mirror() if options.pop('comm', None) else None
    replicas = 1 if options.get('bucket_mb') else 3
    model = GPUDistributedGradient(fresh(), ['@numpy'] * replicas,
                                   comm=comm, **options)
    model.setup(chainer.optimizers.MomentumSGD(lr=0.01))
    for step in range(4):
        model.step(*batch(6, step), total=12 if comm else None)
    model.end_epoch()
    assert calls == []


def test_nccl_between_machines_only_where_the_cluster_allows_it():
    # What a gang's GPU ranks decide from their allgather: one machine,
    # NCCL; several, NCCL only where every rank was told it may (its
    # sockets are in clear); a shared cluster's gang is told no unless
    # `cluster start --allow-clear-nccl`, a cluster of your own yes.
    import doctest

    from dasktrain.cluster import settings
    from dasktrain.parallel import gpus
    from dasktrain.parallel.gpus import (
        CLEAR_NCCL,
        clear_nccl_allowed,
        nccl_between,
    )
    assert nccl_between([('10.0.0.5', False)] * 2)
    assert not nccl_between([('10.0.0.5', True), ('10.0.0.6', False)])
    assert nccl_between([('10.0.0.5', True), ('10.0.0.6', True)])
    assert clear_nccl_allowed({}) and not clear_nccl_allowed(
        {CLEAR_NCCL: '0'})
    shared = settings.environment({}, settings.settings(shared=True))
    assert not settings.clear_nccl(shared)
    assert settings.clear_nccl(settings.environment({}, settings.settings(
        allow_clear_nccl=True, shared=True)))
    assert settings.clear_nccl({}) and not settings.clear_nccl(
        {}, shared=True)  # a worker joined by hand to a shared cluster
    assert any(line.startswith('GPU ranks on several machines: sealed '
                               'links, not NCCL') for line in
               settings.rules(shared))
    for module in (gpus, settings):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module.__name__
