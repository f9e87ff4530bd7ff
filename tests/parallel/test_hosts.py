"""Ranks on several hosts: real Dask clusters whose workers listen on
different addresses of the loopback interface (127.0.0.2, 127.0.0.3, ...:
different hosts to dasktrain, one machine to the kernel; network namespaces
joined by a switch are bench/hosts.py's). One cluster for the module, 2
hosts of 2 workers. Arrays cross over links (sealed on these TLS clusters,
plain when every rank asks), and with several ranks per host through shared
memory first (hierarchical); every rank gets the same bits, those of one
process's sum to float64's rounding (training across them: the
equivalence tests of tests/run, whose ranks sum through the same
DaskComm, and bench/hosts.py --train)."""
import os
import sys

import cloudpickle
import numpy as np
import pytest

from dasktrain.bench.netns import Loopback, cluster
from dasktrain.parallel.comm import DaskComm

cloudpickle.register_pickle_by_value(sys.modules[__name__])
# The tasks below travel by reference: the workers import this module.
HERE = {'PYTHONPATH': os.path.dirname(os.path.abspath(__file__))}


@pytest.fixture(scope='module')
def two_hosts():
    """One cluster for the module: 2 "hosts" of the loopback interface,
    2 workers each; a Client and the workers, host by host."""
    with cluster(Loopback(2), per_host=2, env=HERE) as client:
        workers = sorted(client.scheduler_info(n_workers=-1)['workers'])
        by_host = {}
        for w in workers:
            by_host.setdefault(w.split('//')[1].rsplit(':', 1)[0],
                               []).append(w)
        yield client, sorted(by_host.values())


def _sums(name, rank, size, plain):
    with DaskComm.rendezvous(name, rank, size, timeout=60,
                             plain=plain) as comm:
        big = np.random.default_rng(rank).standard_normal(300_001)
        ints = np.arange(5, dtype=np.int32) * (rank + 1)
        comm.allreduce([big, ints])
        comm.allreduce([big])  # again: the same buffers, the next segment
        return big, ints, comm.route, comm.sealed, comm.hosts


def _run(client, name, workers, plain=None):
    return client.gather([
        client.submit(_sums, name, r, len(workers), plain, workers=[w],
                      pure=False) for r, w in enumerate(workers)])


@pytest.mark.parametrize('per_host,route,plain', [
    (1, 'links', None),
    (1, 'links', True),
    (2, 'hierarchical', None),
])
def test_every_rank_gets_the_same_sum_whatever_the_route(
        two_hosts, per_host, route, plain):
    client, hosts = two_hosts
    workers = [w for ws in hosts for w in ws[:per_host]]
    size = len(workers)
    got = _run(client, f'sums-{per_host}-{plain}', workers, plain)
    once = sum(np.random.default_rng(r).standard_normal(300_001)
               for r in range(size))
    for big, ints, took, _, groups in got:
        assert took == route
        assert len(groups) == 2 and all(len(g) == per_host for g in groups)
        # the same bits everywhere; each sum rounded per rank or host
        np.testing.assert_array_equal(big, got[0][0])
        np.testing.assert_allclose(big, size * once, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(
            ints, np.arange(5, dtype=np.int32) * size * (size + 1) // 2)
    leaders = [g[0] for g in got[0][4]]
    for rank, (*_, sealed, _) in enumerate(got):  # leaders only cross
        assert sealed == (None if rank not in leaders else not plain)


def _places(name, rank, size):
    import socket

    from dasktrain.chainermn.communicator import DaskCommunicator
    comm = DaskComm.rendezvous(name, rank, size, timeout=60)
    chainermn = DaskCommunicator(comm)  # it closes comm when it leaves
    try:
        return (socket.gethostname(), comm.machine,
                (chainermn.intra_rank, chainermn.intra_size,
                 chainermn.inter_rank, chainermn.inter_size))
    finally:
        chainermn._at_exit()  # as at a rank's exit: all leave together


def test_hosts_of_one_hostname_are_machines_of_their_own(two_hosts):
    # Clones of one image share a hostname, as these two "hosts" (one
    # machine's loopback addresses) do: each is a machine of its own by
    # the address its ranks listen on, and a rank's place on its machine
    # (ChainerMN's intra_rank: the GPU it takes) counts its machine's ranks
    # alone.
    client, hosts = two_hosts
    workers = [hosts[0][0], hosts[1][0], hosts[0][1], hosts[1][1]]
    got = _run_each(client, _places, 'places', workers)
    assert len({hostname for hostname, _, _ in got}) == 1
    machines = [machine for _, machine, _ in got]
    assert machines == ['127.0.0.2', '127.0.0.3'] * 2
    assert [place for _, _, place in got] == \
        [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]


def _run_each(client, body, name, workers):
    return client.gather([
        client.submit(body, name, r, len(workers), workers=[w], pure=False)
        for r, w in enumerate(workers)])
