"""Where a run trains (dasktrain.parallel.placement): the decisions a GPU
machine or a cluster would make, given what they would see; no GPU, no
process."""
import doctest

import pytest

from dasktrain.config import TrainConfig
from dasktrain.parallel import placement
from dasktrain.parallel.placement import (
    HERE,
    PER_DEVICE,
    RANKS,
    able_workers,
    default_devices,
    gpus_per_rank,
    per_device_plan,
    place,
    rank_resources,
)


def test_the_examples_hold():
    assert doctest.testmod(placement).failed == 0


@pytest.mark.parametrize('devices,plan', [
    (('@numpy',), None),                           # one device: here
    (('@numpy',) * 3, (3, '@numpy')),
    (('@cupy:0', '@cupy:1'), (2, '@cupy:0')),      # each sees its GPU as 0
    (('@cupy:3', '@cupy:1', '@cupy:2'), (3, '@cupy:0')),
    (('@cupy:1', '@cupy:1'), None),                # two replicas, one GPU
    (('@cupy:0', '@numpy'), None),                 # mixed: in process
])
def test_one_process_per_device_where_it_applies(devices, plan):
    assert per_device_plan(devices) == plan


@pytest.mark.parametrize('available,expected', [
    (['@numpy'], ('@numpy',)),                     # no GPU: one CPU replica
    (['@numpy', '@cupy:0'], ('@cupy:0',)),
    (['@numpy', '@cupy:0', '@cupy:1'], ('@cupy:0', '@cupy:1')),
])
def test_default_devices_are_every_gpu_else_the_cpu(available, expected):
    assert default_devices(available) == expected


def test_this_machine_defaults_to_what_cuda_shows():
    from dasktrain.parallel.devices import available_devices
    assert default_devices() == default_devices(available_devices())


@pytest.mark.parametrize('fields,available,expected', [
    # no devices named: every GPU; two of them, one process each
    ({}, ['@numpy'], (HERE, ('@numpy',), None, None)),
    ({}, ['@numpy', '@cupy:0', '@cupy:1'],
     (PER_DEVICE, ('@cupy:0', '@cupy:1'), 2, ('@cupy:0',))),
    ({'in_process': True}, ['@numpy', '@cupy:0', '@cupy:1'],
     (HERE, ('@cupy:0', '@cupy:1'), None, None)),
    ({'devices': ('@numpy',) * 2}, None,
     (PER_DEVICE, ('@numpy', '@numpy'), 2, ('@numpy',))),
    ({'devices': ('@cupy:1', '@cupy:1')}, None,     # one GPU named twice
     (HERE, ('@cupy:1', '@cupy:1'), None, None)),
    ({'workers': 2}, None, (RANKS, None, 2, None)),  # each its worker's
    ({'workers': 2, 'devices': ('@cupy:0', '@cupy:1')}, None,
     (RANKS, ('@cupy:0', '@cupy:1'), 2, None)),
])
def test_placement_is_decided_once_from_the_config(fields, available,
                                                    expected):
    where = place(TrainConfig(**fields), available=available)
    assert tuple(where) == expected
    if available is None:  # named devices or ranks: CUDA is not asked
        assert place(TrainConfig(**fields), available=ask_never()) == where


def ask_never():
    """An ``available`` that fails the test if it is read."""
    class Never:
        def __iter__(self):
            raise AssertionError('CUDA asked although devices were named')
    return Never()


@pytest.mark.parametrize('devices,workers,gpus', [
    (None, [{'resources': {'GPU': 2, 'CPU': 1}}], 1),  # one each, unnamed
    (None, [{'resources': {'CPU': 1}}, {}], 0),         # a CPU cluster
    (('@cupy:0', '@cupy:1'), [{'resources': {'GPU': 4}}], 2),
    (('@numpy',), [{'resources': {'GPU': 4}}], 0),      # CPU ranks
])
def test_gpus_per_rank(devices, workers, gpus):
    assert gpus_per_rank(devices, workers) == gpus


def test_workers_able_to_host_a_rank_and_what_a_rank_holds():
    workers = {'tls://b:1': {'resources': {'GPU': 2, 'CPU': 1}},
               'tls://a:1': {'resources': {'GPU': 1}},
               'tls://c:1': {'resources': {'CPU': 1}}}
    assert able_workers(workers, 0) == ['tls://a:1', 'tls://b:1',
                                        'tls://c:1']
    assert able_workers(workers, 1) == ['tls://a:1', 'tls://b:1']
    assert able_workers(workers, 2) == ['tls://b:1']
    assert rank_resources(2, workers['tls://b:1']) == {'GPU': 2}
    assert rank_resources(0, workers['tls://c:1']) == {'CPU': 1}
    assert rank_resources(0, {'resources': {}}) is None  # a LocalCluster
