"""The all-reduce between processes on one host, against MPI's, and dg
steps with and without overlapping it with the backward pass.

``bench_allreduce()`` times one all-reduce of the seed network's gradients
(22.5 MB of float32 by default) between two Dask worker processes on this
machine, through dasktrain's shared-memory path and through its links
(the path between machines; sealed, the workers' comms being TLS),
and OpenMPI's ``Allreduce`` through mpi4py between two ``mpirun`` ranks on
the same machine, the anchor. The three are measured in turns, round after
round, and each reports its best round, so a noisy neighbour hits all
alike. mpi4py is a bench-only extra (``pip install mpi4py`` with an MPI
installed, e.g. Debian's ``openmpi-bin libopenmpi-dev``); without it the
MPI row says so.

``bench_overlap()`` times dg steps of a model between two single-threaded
worker processes for several gradient bucket sizes (0: one all-reduce
after the backward pass), the sizes in turns, round after round.
"""
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

MPI_SCRIPT = '''
import sys, time
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
n, iterations = int(sys.argv[1]), int(sys.argv[2])
buf = np.zeros(n, np.float32)
comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
times = []
for _ in range(iterations):
    comm.Barrier()
    began = time.perf_counter()
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    times.append(time.perf_counter() - began)
if comm.rank == 0:
    print(' '.join(repr(t) for t in times))
'''


def _dask_times(name, rank, size, n, iterations, shared):
    """On a worker: ``iterations`` timed all-reduces after a warm-up."""
    from dasktrain.parallel.comm import DaskComm
    with DaskComm.rendezvous(name, rank, size, timeout=60,
                             shared_memory=shared) as comm:
        buf = np.zeros(n, np.float32)
        comm.allreduce([buf])  # maps the segments
        times = []
        for _ in range(iterations):
            comm.allgather(None)  # start together, as MPI's Barrier
            began = time.perf_counter()
            comm.allreduce([buf])
            times.append(time.perf_counter() - began)
        return times


def mpi_times(n, iterations, ranks=2):
    """OpenMPI's Allreduce times (s), or a reason string."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return 'mpi4py is not installed (pip install mpi4py; bench only)'
    mpirun = shutil.which('mpirun')
    if mpirun is None:
        return 'no mpirun (apt-get install openmpi-bin)'
    out = subprocess.run(
        [mpirun, '--allow-run-as-root', '--oversubscribe', '-n', str(ranks),
         sys.executable, '-c', MPI_SCRIPT, str(n), str(iterations)],
        capture_output=True, text=True, timeout=300)
    if out.returncode:
        return f'mpirun failed: {out.stderr.strip().splitlines()[-1:]}'
    return [float(t) for t in out.stdout.split()]


def bench_allreduce(mbytes=22.5, iterations=10, rounds=3):
    """Rows: ms per all-reduce of ``mbytes`` MB of float32 between two
    processes of this machine, for shared memory, TCP and MPI, and the
    ratios to MPI's.

    Parameters
    ----------
    mbytes : float, default 22.5
        Buffer size (the seed network's gradients: 5.6 M float32).
    iterations : int, default 10
        Timed all-reduces per round (after one warm-up).
    rounds : int, default 3
        Rounds of the three, in turns; the best round's median counts.
    """
    from dasktrain.cluster.workers import local_workers
    n = int(mbytes * 1e6 / 4)
    best = {'shared memory': [], 'links': [], 'mpi': []}
    with local_workers(2) as client:
        workers = sorted(client.scheduler_info()['workers'])
        for round_ in range(rounds):
            for label, shared in (('shared memory', True), ('links', False)):
                times = client.gather([
                    client.submit(_dask_times, f'bench-ar-{round_}-{label}',
                                  r, 2, n, iterations, shared, workers=[w],
                                  pure=False)
                    for r, w in enumerate(workers)])
                best[label].append(statistics.median(
                    max(a, b) for a, b in zip(*times)))
            mpi = mpi_times(n, iterations)
            if isinstance(mpi, str):
                best['mpi'] = mpi
            else:
                best['mpi'].append(statistics.median(mpi))
    rows = []
    for label in ('shared memory', 'links'):
        rows.append((f'dasktrain all-reduce, {label}',
                     1000 * min(best[label]), 'ms'))
    if isinstance(best['mpi'], str):
        rows.append(('OpenMPI Allreduce (mpi4py)', best['mpi'], ''))
    else:
        mpi = min(best['mpi'])
        rows.append(('OpenMPI Allreduce (mpi4py)', 1000 * mpi, 'ms'))
        for label in ('shared memory', 'links'):
            rows.append((f'{label} vs MPI', f'{min(best[label]) / mpi:.2f}x',
                         ''))
    return rows


def _overlap_times(name, rank, size, model, batch, buckets, steps, rounds,
                   shared):
    """On a worker: per bucket size, each round's median step time and
    exposed communication per step (s)."""
    import chainer

    from dasktrain.parallel import GPUDistributedGradient
    from dasktrain.parallel.comm import DaskComm
    from dasktrain.training.models import get_model
    rng = np.random.RandomState(rank)
    x = rng.rand(batch, 3, 32, 32).astype(np.float32)
    t = rng.randint(0, 10, batch).astype(np.int32)
    with DaskComm.rendezvous(name, rank, size, timeout=120,
                             shared_memory=shared) as comm:
        models = {}
        for mb in buckets:
            np.random.seed(0)
            models[mb] = GPUDistributedGradient(
                get_model(model), ['@numpy'], comm=comm, bucket_mb=mb)
            models[mb].setup(chainer.optimizers.MomentumSGD(lr=0.01))
            for _ in range(2):  # warm-up; the first step learns the order
                models[mb].step(x, t, total=batch * size, observe=False)
        times = {mb: [] for mb in buckets}
        for _ in range(rounds):
            for mb in buckets:
                m, laps = models[mb], []
                comm_before = m.comm_time
                for _ in range(steps):
                    comm.allgather(None)  # start together
                    began = time.perf_counter()
                    m.step(x, t, total=batch * size, observe=False)
                    laps.append(time.perf_counter() - began)
                times[mb].append((statistics.median(laps),
                                  (m.comm_time - comm_before) / steps))
        return times


def bench_overlap(model='cifar10', batch=100, buckets=(0, 0.25, 1, 4, 16),
                  steps=6, rounds=3, shared=True):
    """Rows: a dg step between two single-threaded worker processes of this
    machine for each gradient bucket size, its exposed communication, and
    the speed-up over ``0`` (no overlap).

    Parameters
    ----------
    model : str, default 'cifar10'
    batch : int, default 100
        Images per worker per step.
    buckets : sequence of float, default (0, 0.25, 1, 4, 16)
        Bucket sizes in MiB; 0 is one all-reduce after the backward pass.
    steps : int, default 6
        Timed steps per size and round (after two warm-up steps).
    rounds : int, default 3
        Rounds of all sizes in turns; each size's best round counts.
    shared : bool, default True
        Sum through shared memory; False: over links (sealed), the path
        between machines.
    """
    from dasktrain.cluster.workers import local_workers
    buckets = sorted(set(buckets))
    with local_workers(2) as client:
        workers = sorted(client.scheduler_info()['workers'])
        got = client.gather([
            client.submit(_overlap_times, 'bench-overlap', r, 2, model,
                          batch, buckets, steps, rounds, shared,
                          workers=[w], pure=False)
            for r, w in enumerate(workers)])
    best = {}
    for mb in buckets:  # the slower rank's figure, the best round
        rounds_ = [max(a, b) for a, b in zip(got[0][mb], got[1][mb])]
        best[mb] = min(rounds_)
    rows = []
    for mb in buckets:
        step, exposed = best[mb]
        label = 'after the backward pass' if mb == 0 else \
            f'buckets of {mb:g} MiB'
        rows.append((f'dg step, {label}', 1000 * step, 'ms'))
        rows.append(('  exposed communication', 1000 * exposed, 'ms'))
        if mb and 0 in best:
            rows.append(('  speed-up vs after the backward pass',
                         f'{best[0][0] / step:.3f}x', ''))
    return rows
