"""Between machines without a second machine: `python bench/hosts.py`
(as root, on Linux).

Each "host" is a network namespace with one interface on one switch
(``dasktrain/bench/netns.py``: veth pairs to a bridge, optionally shaped
with ``tc`` to ``--rates``, both ways, as a switched Ethernet port), one
Dask worker in each, the scheduler outside them; so every byte a rank
sends to another crosses the kernel's network stack as it would cross a
wire. In each setting, round by round, the order turned every round:

* **all-reduce** of ``--mbytes`` of float32 (the seed network's 22.5 MB
  of gradients), one rank per host: dasktrain's links sealed (the
  default on a TLS cluster), dasktrain's plain links
  (``DASKTRAIN_LINKS=tcp``), and Open MPI's ``Allreduce`` through mpi4py
  over TCP (``--mca btl tcp,self``; one ``orted`` per namespace in a
  session of its own, as each host's Dask worker) between the same
  namespaces, as it comes and with ``mpi_yield_when_idle`` (Open MPI
  spins while it waits, which a busy machine punishes); each round's
  median, the table the median of the rounds, each ratio the median of
  the rounds' ratios to MPI's better way that round (a noisy neighbour
  hits both sides of a ratio alike);
* with ``--choices``, what each choice of the links buys (streams,
  record size, sealing, and with ``--before DIR`` the previous version's
  Dask comms, its workers importing DIR);
* with ``--train``, a short **training** run of the seed network across
  the hosts (``--train-hosts``): dg, dg with double buffering and float16
  on the wire, ipm; and ChainerMN over Open MPI's TCP between the same
  namespaces (``bench/chainer_example/train_cifar.py --chainermn``);
  images/s from the second epoch on.

Without root or ``ip`` it says why and exits 0; without Open MPI or mpi4py
(``pip install -e .[mpi]``) the MPI rows say so. ``--json`` keeps every
figure.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / 'chainer_example' / 'train_cifar.py'


def _times(name, rank, size, n, iterations, plain, streams, record=None):
    """On a worker: ``iterations`` timed all-reduces after a warm-up.
    ``record``: the links' record size (bytes) for this run, to measure
    what it buys; ``streams`` None: the previous version's Dask comms
    (``--before``)."""
    from dasktrain.parallel.comm import DaskComm
    if streams is None:  # the code before links: Dask's comms
        options = dict(shared_memory=False)
    else:
        options = dict(plain=plain, streams=streams)
        from dasktrain.parallel.comm import streams
        streams.RECORD = record or streams.DEFAULT_RECORD
    with DaskComm.rendezvous(name, rank, size, timeout=120,
                             **options) as comm:
        buf = np.ones(n, np.float32)
        comm.allreduce([buf])  # the receive buffers, the first records
        times = []
        for _ in range(iterations):
            comm.barrier()  # start together, as MPI's Barrier
            began = time.perf_counter()
            comm.allreduce([buf])
            times.append(time.perf_counter() - began)
        return times, getattr(comm, 'route', 'dask'), \
            getattr(comm, 'sealed', None)


def dasktrain_allreduce(client, tag, n, iterations, plain, streams,
                        record=None):
    """Each all-reduce's time (the slowest rank's), s."""
    workers = sorted(client.scheduler_info(n_workers=-1)['workers'])
    got = client.gather([
        client.submit(_times, tag, r, len(workers), n, iterations, plain,
                      streams, record, workers=[w], pure=False)
        for r, w in enumerate(workers)])
    route = got[0][1]
    if streams is not None and (route != 'links' or got[0][2] == plain):
        raise RuntimeError(f'the ranks took the {route} route, sealed '
                           f'{got[0][2]}: not what was measured')
    return [max(ts) for ts in zip(*(g[0] for g in got))]


def mpi_allreduce(launcher, n, iterations, extra=()):
    """Open MPI's Allreduce times (s), or a reason string; ``extra``: more
    of mpirun's options."""
    from dasktrain.bench.allreduce import MPI_SCRIPT
    if launcher is None:
        return 'no Open MPI mpirun (apt-get install openmpi-bin)'
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return 'mpi4py is not installed (pip install -e .[mpi])'
    try:
        done = subprocess.run(launcher[:1] + list(extra) + launcher[1:] + [
            sys.executable, '-c', MPI_SCRIPT, str(n), str(iterations)],
            capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        return 'mpirun failed: no answer within 240 s'
    if done.returncode:
        return f'mpirun failed: {done.stderr.strip()[-300:]}'
    return [float(t) for t in done.stdout.split()]


def allreduce_rows(hosts_n, rate, args):
    from dasktrain.bench.netns import Hosts, cluster, mpirun
    from dasktrain.parallel.comm.links import traffic
    n = int(args.mbytes * 1e6 / 4)
    ways = ('sealed', 'plain', 'mpi', 'mpi-yield')
    got = {w: [] for w in ways}
    with Hosts(hosts_n, rate=rate) as hosts, cluster(hosts) as client, \
            mpirun(hosts) as launcher:
        for r in range(args.rounds):
            for way in ways if r % 2 == 0 else reversed(ways):
                if way.startswith('mpi'):
                    extra = ('--mca', 'mpi_yield_when_idle', '1') \
                        if way == 'mpi-yield' else ()
                    for _ in range(3):  # orted sometimes fails to wire up
                        t = mpi_allreduce(launcher, n, args.iterations,
                                          extra)
                        if not isinstance(t, str) or 'failed' not in t:
                            break
                else:
                    t = dasktrain_allreduce(
                        client, f'ar-{hosts_n}-{rate}-{r}-{way}', n,
                        args.iterations, way == 'plain', args.streams)
                got[way].append(t if isinstance(t, str) else
                                statistics.median(t))
                print(f'{hosts_n} hosts, {rate or "unshaped"}, round '
                      f'{r + 1}, {way}: ' + (t if isinstance(t, str) else
                      f'{1000 * got[way][-1]:.1f} ms'), file=sys.stderr,
                      flush=True)
    moved = traffic(n * 4, hosts_n) * 8 / 1e9  # Gbit per host
    # MPI's better way of each round (it spins while it waits, which a
    # busy machine punishes; yielding costs it on a quiet one)
    got['mpi-best'] = [min((t for t in pair if isinstance(t, float)),
                           default=pair[0])
                       for pair in zip(got['mpi'], got['mpi-yield'])]
    ways = ways + ('mpi-best',)
    rows = {}
    for way in ways:
        timed = [t for t in got[way] if isinstance(t, float)]
        if not timed:
            rows[way] = got[way][0]
            continue
        mid = statistics.median(timed)
        rows[way] = {'ms': 1000 * mid, 'gbit_per_host': moved / mid,
                     'rounds_ms': [1000 * t for t in timed]}
        pairs = [(a, b) for a, b in zip(got[way], got['mpi-best'])
                 if isinstance(a, float) and isinstance(b, float)]
        if not way.startswith('mpi') and pairs:
            rows[way]['vs_mpi'] = statistics.median(a / b for a, b in pairs)
    return rows


def choice_rows(args):
    """What each choice of the links buys: 2 hosts, unshaped, each way
    against the defaults, paired round by round."""
    from dasktrain.bench.netns import Hosts, cluster
    from dasktrain.parallel.comm.links import STREAMS
    from dasktrain.parallel.comm.streams import DEFAULT_RECORD
    n = int(args.mbytes * 1e6 / 4)
    ways = {
        'sealed, defaults': (False, STREAMS, DEFAULT_RECORD),
        'sealed, 1 stream': (False, 1, DEFAULT_RECORD),
        'sealed, 4 streams': (False, 4, DEFAULT_RECORD),
        'sealed, 16 KiB records (TLS\'s)': (False, STREAMS, 16384),
        'sealed, 4 MiB records': (False, STREAMS, 4 << 20),
        'plain, defaults': (True, STREAMS, DEFAULT_RECORD),
        'plain, 1 stream': (True, 1, DEFAULT_RECORD),
        'plain, 4 MiB records': (True, STREAMS, 4 << 20)}
    got = {w: [] for w in ways}
    if args.before:
        got['before: Dask comms (TLS)'] = []
    with Hosts(2) as hosts:
        with cluster(hosts) as client:
            for r in range(args.rounds):
                for way in ways if r % 2 == 0 else reversed(list(ways)):
                    t = dasktrain_allreduce(client, f'ch-{r}-{way}', n,
                                            args.iterations, *ways[way])
                    got[way].append(statistics.median(t))
                    print(f'choices, round {r + 1}, {way}: '
                          f'{1000 * got[way][-1]:.1f} ms', file=sys.stderr,
                          flush=True)
        if args.before:
            env = {'PYTHONPATH': str(args.before)}
            with cluster(hosts, env=env) as client:
                for r in range(args.rounds):
                    for attempt in range(3):  # it failed now and then
                        try:
                            t = dasktrain_allreduce(
                                client, f'before-{r}-{attempt}', n,
                                args.iterations, False, None)
                            break
                        except Exception as e:
                            print(f'before, round {r + 1}: {e}',
                                  file=sys.stderr)
                    else:
                        continue
                    got['before: Dask comms (TLS)'].append(
                        statistics.median(t))
    base = got['sealed, defaults']
    return {w: {'ms': 1000 * statistics.median(t),
                'vs_defaults': statistics.median(
                    a / b for a, b in zip(t, base)) if len(t) == len(base)
                else statistics.median(t) / statistics.median(base)}
            for w, t in got.items()}


# ------------------------------------------------------------ training

def _train_dasktrain(client, data, out, hosts_n, args, **options):
    from dasktrain.config import TrainConfig
    from dasktrain.run.train import train
    config = TrainConfig(
        model='cifar10', batch_size=100, epochs=args.epochs,
        train_size=args.train_size, test_size=args.test_size,
        data_dir=str(data), augment='none', progress=False,
        collective_timeout=600, workers=hosts_n, devices=('@numpy',),
        out=str(out), **options)
    log = train(config, client=client)['log']
    later = log[1:] or log
    return statistics.mean(r['images_per_sec'] for r in later)


def _train_chainermn(launcher, data, out, args):
    if launcher is None:
        return 'no Open MPI mpirun'
    done = subprocess.run(launcher + [
        sys.executable, str(SCRIPT), '--data', str(data),
        '--epoch', str(args.epochs), '--n-train', str(args.train_size),
        '--n-test', str(args.test_size), '--out', str(out), '--chainermn'],
        capture_output=True, text=True, timeout=3600)
    found = re.search(r'throughput: ([\d.]+) images/s', done.stdout)
    if done.returncode or not found:
        return f'ChainerMN failed: {done.stderr.strip()[-300:]}'
    return float(found.group(1))


def train_rows(hosts_n, rate, args, work):
    from dasktrain.bench import synthetic_cifar10
    from dasktrain.bench.netns import Hosts, cluster, mpirun
    batches = synthetic_cifar10(work / 'data', n_train=args.train_size,
                                n_test=args.test_size)
    ways = {
        'dasktrain dg': {},
        'dasktrain dg, double buffering, float16': dict(
            double_buffering=True, comm_dtype='float16'),
        f'dasktrain ipm, mix every {args.mix_every}': dict(
            mode='ipm', mix_every=args.mix_every),
        'ChainerMN over Open MPI (TCP)': None}
    got = {w: [] for w in ways}
    with Hosts(hosts_n, rate=rate) as hosts, cluster(hosts) as client, \
            mpirun(hosts) as launcher:
        for r in range(args.rounds):
            for i, way in enumerate(ways if r % 2 == 0 else
                                    reversed(list(ways))):
                out = work / f'train-{hosts_n}-{rate}-{r}-{i}'
                if ways[way] is None:
                    rate_ = _train_chainermn(launcher, batches, out, args)
                else:
                    rate_ = _train_dasktrain(client, batches.parent, out,
                                             hosts_n, args, **ways[way])
                got[way].append(rate_)
                print(f'train, {hosts_n} hosts, {rate or "unshaped"}, round '
                      f'{r + 1}, {way}: {rate_}', file=sys.stderr, flush=True)
    rows = {}
    for way, rates in got.items():
        bad = [x for x in rates if isinstance(x, str)]
        rows[way] = bad[0] if bad else {'images_per_s': statistics.median(
            rates), 'rounds': rates}
    return rows


# ------------------------------------------------------------ report

def report(results, args, machine):
    print(f'\nMachine: {machine}; load average {results["load"][0]:.1f} '
          f'before, {results["load"][1]:.1f} after (2 or more on 2 cores: '
          'other work ran beside it); every "host" a network namespace on one '
          'switch (a bridge), one rank each; '
          f'{args.rounds} interleaved rounds of {args.iterations} '
          f'all-reduces of {args.mbytes:g} MB float32, medians; dasktrain '
          f'with {args.streams} stream(s) each way\n')
    print('| hosts | link | dasktrain sealed ms | plain ms | Open MPI TCP ms '
          '| MPI, yield when idle, ms | sealed vs MPI | plain vs MPI | Gbit/s '
          'per host (sealed / plain / MPI) |')
    print('|---:|---|---:|---:|---:|---:|---:|---:|---|')
    for key, rows in results['allreduce'].items():
        hosts_n, rate = key.split('/')
        cells = []
        for way in ('sealed', 'plain', 'mpi', 'mpi-yield'):
            row = rows[way]
            cells.append(f'{row["ms"]:.1f}' if isinstance(row, dict) else
                         row)
        ratios = [f'{rows[w]["vs_mpi"]:.2f}x' if isinstance(rows[w], dict)
                  and 'vs_mpi' in rows[w] else '' for w in ('sealed', 'plain')]
        speeds = ' / '.join(f'{rows[w]["gbit_per_host"]:.2f}'
                            if isinstance(rows[w], dict) else '-'
                            for w in ('sealed', 'plain', 'mpi-best'))
        print(f'| {hosts_n} | {rate} | {" | ".join(cells)} | '
              f'{" | ".join(ratios)} | {speeds} |')
    per_host = {}
    for key, rows in results['allreduce'].items():
        hosts_n, rate = key.split('/')
        per_host.setdefault(rate, {})[int(hosts_n)] = rows
    lines = []
    for rate, by_n in per_host.items():
        if 2 in by_n and 4 in by_n:
            for way in ('sealed', 'plain', 'mpi-best'):
                a, b = by_n[2][way], by_n[4][way]
                if isinstance(a, dict) and isinstance(b, dict):
                    ratio = b['gbit_per_host'] / a['gbit_per_host']
                    lines.append(f'| {rate} | {way} | {ratio:.2f}x |')
    if lines:
        print('\n| link | path | 4 hosts vs 2, throughput per host |')
        print('|---|---|---:|')
        print('\n'.join(lines))
    if results.get('choices'):
        print('\nWhat each choice buys: 2 hosts, unshaped, medians; each '
              'against the defaults, paired round by round:\n')
        print('| links | ms | vs the defaults |')
        print('|---|---:|---:|')
        for way, row in results['choices'].items():
            print(f'| {way} | {row["ms"]:.1f} | {row["vs_defaults"]:.2f}x |')
    if results.get('train'):
        print(f'\nTraining, seed network, batch 100 per rank, '
              f'{args.epochs} epochs of {args.train_size} synthetic images, '
              'images/s from epoch 2, medians:\n')
        print('| hosts | link | run | images/s |')
        print('|---:|---|---|---:|')
        for key, rows in results['train'].items():
            hosts_n, rate = key.split('/')
            for way, row in rows.items():
                value = f'{row["images_per_s"]:.1f}' if isinstance(
                    row, dict) else row
                print(f'| {hosts_n} | {rate} | {way} | {value} |')


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--hosts', default='2,4',
                        help='host counts (default: %(default)s)')
    parser.add_argument('--rates', default='none,10gbit,1gbit',
                        help="each port's rate, 'none' unshaped (default: "
                             '%(default)s)')
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--iterations', type=int, default=10)
    parser.add_argument('--mbytes', type=float, default=22.5)
    parser.add_argument('--streams', type=int, default=None,
                        help="dasktrain's streams each way (default: its "
                             'own)')
    parser.add_argument('--choices', action='store_true',
                        help='also what each choice of the links buys')
    parser.add_argument('--before', type=Path, default=None,
                        help='with --choices: a checkout of the version '
                             'before links (its workers import it)')
    parser.add_argument('--only-choices', action='store_true',
                        help=argparse.SUPPRESS)
    parser.add_argument('--only-train', action='store_true',
                        help=argparse.SUPPRESS)
    parser.add_argument('--train', action='store_true',
                        help='also the training runs')
    parser.add_argument('--train-hosts', type=int, default=2)
    parser.add_argument('--train-rates', default='none')
    parser.add_argument('--epochs', type=int, default=3)
    parser.add_argument('--train-size', type=int, default=2000)
    parser.add_argument('--test-size', type=int, default=500)
    parser.add_argument('--mix-every', type=int, default=10)
    parser.add_argument('--json', type=Path, default=None)
    args = parser.parse_args(argv)
    from dasktrain.bench import machine
    from dasktrain.bench.netns import unavailable
    from dasktrain.parallel.comm.links import STREAMS
    why = unavailable()
    if why:
        print(f'skipped: {why}')
        return 0
    args.streams = args.streams or STREAMS
    rates = [None if r == 'none' else r for r in args.rates.split(',')]
    results = {'machine': machine(), 'args': vars(args) | {'json': None},
               'allreduce': {}, 'train': {}, 'load': [os.getloadavg()[0]]}
    def keep():  # what is measured so far, should a later part fail
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))
    keep()
    if args.choices or args.only_choices:
        results['choices'] = choice_rows(args)
        keep()
    for rate in rates if not (args.only_choices or args.only_train) else ():
        for hosts_n in (int(h) for h in args.hosts.split(',')):
            results['allreduce'][f'{hosts_n}/{rate or "unshaped"}'] = \
                allreduce_rows(hosts_n, rate, args)
            keep()
    if args.train:
        work = Path(tempfile.mkdtemp(prefix='dasktrain-hosts-'))
        try:
            for rate in args.train_rates.split(','):
                rate = None if rate == 'none' else rate
                results['train'][f'{args.train_hosts}/{rate or "unshaped"}'] \
                    = train_rows(args.train_hosts, rate, args, work)
                keep()
        finally:
            import shutil
            shutil.rmtree(work, ignore_errors=True)
    results['load'].append(os.getloadavg()[0])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    report(results, args, results['machine'])
    return 0


if __name__ == '__main__':
    os.environ.setdefault('PYTHONUNBUFFERED', '1')
    sys.exit(main())
