"""Ranks on several hosts: real Dask clusters whose workers listen on
different addresses of the loopback interface (127.0.0.2, 127.0.0.3, ...:
different hosts to dasktrain, one machine to the kernel), and, as root,
on network namespaces joined by a switch (dasktrain/bench/netns.py).
Arrays cross over links (sealed on these TLS clusters, plain when every
rank asks), and with several ranks per host through shared memory first
(hierarchical); the results are those of one process."""
import os
import sys

import cloudpickle
import numpy as np
import pytest
from test_train import assert_same_logs, config, npz

from dasktrain.bench.netns import Hosts, Loopback, cluster, ours, unavailable
from dasktrain.parallel.comm import DaskComm
from dasktrain.run.train import train

cloudpickle.register_pickle_by_value(sys.modules[__name__])
# The tasks below travel by reference: the workers import this module.
HERE = {'PYTHONPATH': os.path.dirname(os.path.abspath(__file__))}


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(40, 30, 5)


def _sums(name, rank, size):
    with DaskComm.rendezvous(name, rank, size, timeout=60) as comm:
        big = np.random.default_rng(rank).standard_normal(300_001)
        ints = np.arange(5, dtype=np.int32) * (rank + 1)
        comm.allreduce([big, ints])
        comm.allreduce([big])  # again: the same buffers, the next segment
        return big, ints, comm.route, comm.sealed, comm.hosts


def _run(client, name):
    workers = sorted(client.scheduler_info(n_workers=-1)['workers'])
    return client.gather([
        client.submit(_sums, name, r, len(workers), workers=[w], pure=False)
        for r, w in enumerate(workers)])


@pytest.mark.parametrize('hosts,per_host,route,env', [
    (3, 1, 'links', {}),
    (2, 1, 'links', {'DASKTRAIN_LINKS': 'tcp'}),
    (2, 2, 'hierarchical', {}),
])
def test_every_rank_gets_the_same_sum_whatever_the_route(hosts, per_host,
                                                         route, env):
    size = hosts * per_host
    with cluster(Loopback(hosts), per_host=per_host,
                 env=dict(HERE, **env)) as client:
        got = _run(client, f'sums-{hosts}-{per_host}')
    once = sum(np.random.default_rng(r).standard_normal(300_001)
               for r in range(size))
    for big, ints, took, _, groups in got:
        assert took == route
        assert len(groups) == hosts and \
            all(len(g) == per_host for g in groups)
        # the same bits everywhere; each sum rounded per rank or host
        np.testing.assert_array_equal(big, got[0][0])
        np.testing.assert_allclose(big, size * once, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(
            ints, np.arange(5, dtype=np.int32) * size * (size + 1) // 2)
    leaders = [g[0] for g in got[0][4]]
    for rank, (*_, sealed, _) in enumerate(got):  # leaders only cross
        assert sealed == (None if rank not in leaders else
                          env.get('DASKTRAIN_LINKS') != 'tcp')


@pytest.mark.equivalence
@pytest.mark.parametrize('hosts,per_host,mode', [(3, 1, 'dg'), (2, 2, 'dg')])
def test_ranks_across_hosts_give_the_results_of_one_process(
        data_dir, tmp_path, hosts, per_host, mode, float64):
    size = hosts * per_host
    common = config(data_dir, tmp_path, model='cifar10', mode=mode,
                    batch_size=4, **({'mix_every': 3} if mode == 'ipm'
                                     else {}))
    single = train(common.replace(out=str(tmp_path / 'one'),
                                  devices=('@numpy',) * size,
                                  in_process=True))
    with cluster(Loopback(hosts), per_host=per_host,
                 env=dict(HERE, CHAINER_DTYPE='float64')) as client:
        apart = train(common.replace(out=str(tmp_path / 'apart'),
                                     workers=size, devices=('@numpy',)),
                      client=client)
    assert len(apart['workers']) == size
    assert_same_logs(single['log'], apart['log'])
    one, two = (npz(tmp_path / d / 'model_final.npz')
                for d in ('one', 'apart'))
    for key in one:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-9,
                                   atol=1e-12, err_msg=key)


@pytest.mark.skipif(unavailable() is not None,
                    reason=f'no network namespaces here: {unavailable()}')
def test_ranks_in_network_namespaces_sum_over_the_switch():
    with Hosts(2, rate='10gbit') as hosts:
        with cluster(hosts, env=HERE) as client:
            got = _run(client, 'netns-sums')
            workers = sorted(client.scheduler_info()['workers'])
    assert [w.split('//')[1].split(':')[0] for w in workers] == \
        hosts.addresses
    once = sum(np.random.default_rng(r).standard_normal(300_001)
               for r in range(2))
    for big, _, took, sealed, _ in got:
        assert took == 'links' and sealed
        np.testing.assert_array_equal(big, 2 * once)
    assert os.getpid() not in ours()  # every namespace deleted
