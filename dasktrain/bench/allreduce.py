"""The all-reduce between processes on one host, against MPI's.

``bench_allreduce()`` times one all-reduce of the seed network's gradients
(22.5 MB of float32 by default) between two Dask worker processes on this
machine, through dasktrain's shared-memory path and through its TCP path,
and OpenMPI's ``Allreduce`` through mpi4py between two ``mpirun`` ranks on
the same machine, the anchor. The three are measured in turns, round after
round, and each reports its best round, so a noisy neighbour hits all
alike. mpi4py is a bench-only extra (``pip install mpi4py`` with an MPI
installed, e.g. Debian's ``openmpi-bin libopenmpi-dev``); without it the
MPI row says so.
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
    from dasktrain.parallel.collective import DaskComm
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
    from dasktrain.cluster.scaleout import local_workers
    n = int(mbytes * 1e6 / 4)
    best = {'shared memory': [], 'tcp': [], 'mpi': []}
    with local_workers(2) as client:
        workers = sorted(client.scheduler_info()['workers'])
        for round_ in range(rounds):
            for label, shared in (('shared memory', True), ('tcp', False)):
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
    for label in ('shared memory', 'tcp'):
        rows.append((f'dasktrain all-reduce, {label}',
                     1000 * min(best[label]), 'ms'))
    if isinstance(best['mpi'], str):
        rows.append(('OpenMPI Allreduce (mpi4py)', best['mpi'], ''))
    else:
        mpi = min(best['mpi'])
        rows.append(('OpenMPI Allreduce (mpi4py)', 1000 * mpi, 'ms'))
        for label in ('shared memory', 'tcp'):
            rows.append((f'{label} vs MPI', f'{min(best[label]) / mpi:.2f}x',
                         ''))
    return rows
