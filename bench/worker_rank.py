"""A rank inside a Dask worker against the same rank in a plain process:
`python bench/worker_rank.py`.

One bare step loop (the seed network, batch 100 per rank, momentum SGD,
one BLAS thread per rank; with 2 ranks the gradients summed each step
before the update), timed over ``--steps`` steps after 3 warm-up steps,
run as:

* **plain process**: 1 rank, ``python bench/worker_rank.py --loop``;
  2 ranks started with ``dasktrain launch``'s environment (a scheduler
  here for their rendezvous; each a plain process, summing through
  dasktrain's communicator), kept in this session as the others are;
* **Dask worker**: the loop as a task on dasktrain's own local workers
  (``local_workers``, as ``dasktrain train --devices cpu:N`` starts them),
  summing through the same communicator;
* **mpiexec, ChainerMN**: the loop under ``mpiexec -n N`` with real
  ChainerMN (its naive communicator's ``multi_node_mean_grad``).

Round by round, the order turned every round; each run's images/s is
the slowest rank's; the table shows the best of the rounds (this machine's
other work only ever slows a run) and the median, and the CPU time a step
costs (per rank: its training thread, and the process's other threads),
which other work on the machine does not change. Needs mpiexec and
mpi4py for the ChainerMN rows (``pip install -e .[mpi]``).
"""
import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dasktrain.parallel.comm.rendezvous import rank_environment

HERE = Path(__file__).resolve()
WARMUP = 3


def loop(steps, comm=None, mpi=None, batch=100, seed=0):
    """The bare steps; seconds of the timed ones: wall, CPU of this
    thread, CPU of the whole process. ``comm``: a dasktrain communicator;
    ``mpi``: a ChainerMN communicator."""
    import chainer

    from dasktrain.training.models import get_model
    rank = comm.rank if comm is not None else mpi.rank if mpi else 0
    np.random.seed(seed)  # the same weights on every rank
    model = get_model('cifar10')
    optimizer = chainer.optimizers.MomentumSGD(lr=0.01)
    if mpi is not None:
        import chainermn
        optimizer = chainermn.create_multi_node_optimizer(optimizer, mpi)
    optimizer.setup(model)
    params = [p for _, p in sorted(model.namedparams())]
    rng = np.random.RandomState(rank)
    x = rng.rand(batch, 3, 32, 32).astype(np.float32)
    t = rng.randint(0, 10, batch).astype(np.int32)
    size = comm.size if comm is not None else 1
    elapsed = thread = process = 0.0
    for step in range(WARMUP + steps):
        began = time.perf_counter()
        mine, ours = time.thread_time(), time.process_time()
        model.cleargrads()
        loss = model(x, t)
        loss.backward()
        if comm is not None and size > 1:
            grads = [p.grad for p in params]
            comm.allreduce(grads)
            for g in grads:
                g /= size
        optimizer.update()
        if step >= WARMUP:
            elapsed += time.perf_counter() - began
            thread += time.thread_time() - mine
            process += time.process_time() - ours
    return elapsed, thread, process


def _in_worker(name, rank, size, steps):
    from dasktrain.parallel.comm import DaskComm
    if size == 1:
        return loop(steps)
    with DaskComm.rendezvous(name, rank, size, timeout=600) as comm:
        return loop(steps, comm)


def dask_worker(n, steps, tag):
    from dasktrain.cluster.workers import local_workers
    with local_workers(n, dashboard=False) as client:
        workers = sorted(client.scheduler_info()['workers'])
        return slowest(client.gather([
            client.submit(_in_worker, tag, r, n, steps, workers=[w],
                          pure=False) for r, w in enumerate(workers)]))


def slowest(ranks):
    """The slowest rank's wall time, and the ranks' mean CPU times."""
    return (max(r[0] for r in ranks),
            sum(r[1] for r in ranks) / len(ranks),
            sum(r[2] for r in ranks) / len(ranks))


def _child(argv, env, folder):
    done = subprocess.run(argv, env=env, cwd=folder, capture_output=True,
                          text=True, timeout=1800)
    if done.returncode:
        sys.exit(f'{" ".join(argv[:4])} failed:\n{done.stdout[-1500:]}\n'
                 f'{done.stderr[-3000:]}')


def plain_process(n, steps, folder):
    env = dict(os.environ, OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1',
               MKL_NUM_THREADS='1')
    me = [sys.executable, '-P', str(HERE), '--loop', str(steps), '--into',
          str(folder)]
    if n == 1:
        _child(me, env, folder)
    else:  # ranks as dasktrain launch starts them, but in this session
        with _rendezvous() as (address, tls):
            children = [subprocess.Popen(me + ['--join'], cwd=folder, env=dict(
                env, **rank_environment(r, n, address, folder.name,
                                        'tls://127.0.0.1', tls)))
                        for r in range(n)]
            if any(c.wait(1800) for c in children):
                sys.exit('a plain rank failed')
    return slowest([json.loads(p.read_text())
                    for p in folder.glob('rank*.s')])


@contextlib.contextmanager
def _rendezvous():
    """A scheduler in this process for plain ranks to meet through: its
    address and (ca, cert, key). The ranks stay in this session, as
    mpiexec's and the workers' do: on a kernel with autogroup scheduling
    a session of their own (``dasktrain launch``'s) would give them a
    larger share of a busy machine's CPUs than the others get."""
    from distributed import LocalCluster
    from distributed.security import Security

    from dasktrain.cluster.tls import ensure_certificates
    folder = tempfile.mkdtemp(prefix='dasktrain-bench-tls-')
    try:
        files = ensure_certificates(folder)
        tls = files['tls_ca_file'], files['tls_cert'], files['tls_key']
        security = Security(tls_ca_file=tls[0], tls_client_cert=tls[1],
                            tls_client_key=tls[2], tls_scheduler_cert=tls[1],
                            tls_scheduler_key=tls[2], require_encryption=True)
        with LocalCluster(n_workers=0, processes=False, host='127.0.0.1',
                          protocol='tls', security=security,
                          dashboard_address='127.0.0.1:0',
                          scheduler_kwargs={'dashboard': False}) as cluster:
            yield cluster.scheduler_address, tls
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def under_mpiexec(n, steps, folder):
    env = dict(os.environ, OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1',
               MKL_NUM_THREADS='1')
    argv = ['mpiexec', '-n', str(n), '--oversubscribe', '--bind-to', 'none']
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT='1',
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM='1')
    _child(argv + [sys.executable, '-P', str(HERE), '--loop', str(steps),
                   '--into', str(folder), '--mpi'], env, folder)
    return slowest([json.loads(p.read_text())
                    for p in folder.glob('rank*.s')])


def child(args):
    """``--loop``: run the loop here and write its seconds."""
    comm = mpi = None
    if args.join:
        from dasktrain.parallel.comm.rendezvous import join
        comm = join()
    if args.mpi:
        import chainermn
        mpi = chainermn.create_communicator('naive')
    rank = comm.rank if comm is not None else mpi.rank if mpi else 0
    seconds = loop(args.loop, comm=comm, mpi=mpi)
    (Path(args.into) / f'rank{rank}.s').write_text(json.dumps(seconds))
    if comm is not None:
        with comm:
            pass


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--steps', type=int, default=20)
    parser.add_argument('--ranks', default='1,2')
    parser.add_argument('--json', type=Path, default=None)
    parser.add_argument('--loop', type=int, default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument('--into', default=None, help=argparse.SUPPRESS)
    parser.add_argument('--join', action='store_true',
                        help=argparse.SUPPRESS)
    parser.add_argument('--mpi', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.loop is not None:
        return child(args)
    from dasktrain.bench import machine
    ways = {'plain process': plain_process, 'Dask worker': dask_worker}
    if shutil.which('mpiexec'):
        ways['mpiexec, ChainerMN'] = under_mpiexec
    work = Path(tempfile.mkdtemp(prefix='dasktrain-worker-rank-'))
    load = [os.getloadavg()[0]]
    rates, cpu = {}, {}
    try:
        for r in range(args.rounds):
            for n in (int(k) for k in args.ranks.split(',')):
                order = list(ways) if r % 2 == 0 else list(reversed(ways))
                for name in order:
                    folder = work / f'{r}-{n}-{list(ways).index(name)}'
                    folder.mkdir()
                    if name == 'Dask worker':
                        wall, thread, process = dask_worker(
                            n, args.steps, folder.name)
                    else:
                        wall, thread, process = ways[name](n, args.steps,
                                                           folder)
                    rate = 100 * n * args.steps / wall
                    rates.setdefault(f'{n}/{name}', []).append(rate)
                    cpu.setdefault(f'{n}/{name}', []).append(
                        (1000 * thread / args.steps,
                         1000 * (process - thread) / args.steps))
                    print(f'round {r + 1}, {n} rank(s), {name}: '
                          f'{rate:.1f} images/s, CPU per step '
                          f'{cpu[f"{n}/{name}"][-1][0]:.0f} ms training, '
                          f'{cpu[f"{n}/{name}"][-1][1]:.0f} ms other '
                          'threads', file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load.append(os.getloadavg()[0])
    if args.json:
        args.json.write_text(json.dumps({'machine': machine(), 'load': load,
                                         'rates': rates, 'cpu': cpu},
                                        indent=1))
    print(f'\nMachine: {machine()}; load average {load[0]:.1f} before, '
          f'{load[1]:.1f} after; seed network, batch 100 per rank, '
          f'{args.steps} timed steps, {args.rounds} interleaved rounds\n')
    print('| ranks | where | best images/s | median | best vs plain process '
          '| CPU ms per step: training thread | other threads |')
    print('|---:|---|---:|---:|---:|---:|---:|')
    for key, got in rates.items():
        n, name = key.split('/')
        plain = max(rates[f'{n}/plain process'])
        mine = statistics.median(c[0] for c in cpu[key])
        others = statistics.median(c[1] for c in cpu[key])
        print(f'| {n} | {name} | {max(got):.1f} | '
              f'{statistics.median(got):.1f} | {max(got) / plain:.3f} | '
              f'{mine:.0f} | {others:.0f} |')


if __name__ == '__main__':
    sys.exit(main())
