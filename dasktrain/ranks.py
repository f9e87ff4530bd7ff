"""A rank of ``dasktrain launch`` on its Dask worker: the task body
:func:`run_rank`, which starts the program as a child process in a session
of its own (``PR_SET_PDEATHSIG``: it dies with its worker), relays rank
0's output as Dask events, keeps each rank's in its log file, and stops
the program's whole process group when the launch says so.

Owns the worker's side of a launch; the driver (choosing workers, the
environment, blame, exit status) is :mod:`dasktrain.launcher`'s.
"""
import codecs
import contextlib
import os
import signal
import subprocess
import threading
import time

from dasktrain.parallel.comm.rendezvous import LISTEN, SIZE
from dasktrain.parallel.gpus import VISIBLE, GpuPool
from dasktrain.spawn import die_with_parent

POLL = 0.1  # s between looks at the child


def variable(client, job, rank, what='started'):
    """The Dask Variable ``{job}/{what}{rank}``: a rank's ``started`` flag
    (a rerun task must not start the program again) or its ``gpu``
    ``[host, GPU]``."""
    from distributed import Variable
    return Variable(f'{job}/{what}{rank}', client=client)


def run_rank(argv, env, cwd, log_path, rank, job, grace, gpus):
    """The task body of one rank: start the program, relay rank 0's output,
    stop the program when the launch says so; returns ``{'rank', 'code',
    'ended', 'log', 'last', 'why'}``."""
    from distributed import Event, get_worker
    from distributed.comm.addressing import get_address_host, parse_address
    worker = get_worker()
    started = variable(worker.client, job, rank)
    if started.get():
        # Dask reran the task after its worker died: a rank never restarts.
        return {'rank': rank, 'code': 1, 'ended': time.time(), 'log': None,
                'why': 'its worker died', 'last': None}
    started.set(True)
    scheme = parse_address(worker.address)[0]
    env = dict(env, **{LISTEN: f'{scheme}://'
                        f'{get_address_host(worker.address)}'})
    held = GpuPool.acquire(1) if gpus else []
    stop = Event(f'{job}-stop', client=worker.client)
    try:
        env[VISIBLE] = _machine_gpus(worker, job, rank, int(env[SIZE]),
                                     held, stop) if gpus else ''
        with open(log_path, 'wb') as log:
            try:
                child = subprocess.Popen(
                    argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE if rank == 0 else log,
                    stderr=subprocess.PIPE if rank == 0 else log,
                    start_new_session=True, preexec_fn=die_with_parent)
            except OSError as e:
                return {'rank': rank, 'code': 127, 'ended': time.time(),
                        'log': log_path, 'last': None,
                        'why': f'cannot start {argv[0]}: {e.strerror}'}
            worker.log_event(job, {'kind': 'pid', 'rank': rank,
                                   'pid': child.pid})
            lock = threading.Lock()  # stdout and stderr share the log
            readers = [_reader(worker, job, stream, name, log, lock)
                       for stream, name in ((child.stdout, 'stdout'),
                                            (child.stderr, 'stderr'))
                       if stream is not None]
            code, ended = _wait(child, stop, grace)
            for reader in readers:
                reader.join(5)
    finally:
        GpuPool.release(held)
    return {'rank': rank, 'code': code, 'ended': ended, 'log': log_path,
            'last': _last_line(log_path), 'why': None}


def _machine_gpus(worker, job, rank, size, held, stop):
    """``CUDA_VISIBLE_DEVICES`` of a GPU rank: the GPUs the job's ranks
    on this machine hold, in rank order, as ``mpiexec`` leaves them; so
    device ``comm.intra_rank`` is this rank's own."""
    from distributed.comm.addressing import get_address_host
    host = get_address_host(worker.address)
    variable(worker.client, job, rank, 'gpu').set([host, held[0].id])
    while True:
        got = [variable(worker.client, job, r, 'gpu').get()
               for r in range(size)]
        if all(got) or stop.is_set():
            return ','.join(g for h, g in filter(None, got) if h == host)
        time.sleep(0.2)


def _reader(worker, job, stream, name, log, lock):
    """A thread copying ``stream`` to ``log`` and, as events, to the
    launch (chunks as they come: a progress bar's ``\\r`` stays)."""
    # A character split between two reads is decoded once it is whole.
    decoder = codecs.getincrementaldecoder('utf-8')(errors='replace')

    def run():
        fd = stream.fileno()
        while True:
            data = os.read(fd, 65536)
            text = decoder.decode(data, final=not data)
            with lock:
                log.write(data)
                log.flush()
            if text:
                worker.log_event(job, {'kind': 'output', 'stream': name,
                                       'text': text})
            if not data:
                break
    thread = threading.Thread(target=run, daemon=True,
                              name=f'dasktrain-{name}')
    thread.start()
    return thread


def _wait(child, stop, grace):
    """The child's exit code and when it ended; stops its process group
    (SIGTERM, SIGKILL after ``grace`` s) once ``stop`` is set."""
    ended = []
    waiter = threading.Thread(
        target=lambda: (child.wait(), ended.append(time.time())),
        daemon=True)
    waiter.start()
    last_look = 0.0
    while waiter.is_alive():
        waiter.join(POLL)
        if time.monotonic() - last_look > 0.5 and waiter.is_alive():
            last_look = time.monotonic()
            if stop.is_set():
                _stop_group(child, grace)
                waiter.join()
                # Stopped by the launch: not this rank's own failure.
                return 0, ended[0] if ended else time.time()
    return child.returncode, ended[0] if ended else time.time()


def _stop_group(child, grace):
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _last_line(path):
    """The last non-empty line of a rank's log (its error, usually)."""
    try:
        with open(path, 'rb') as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            lines = f.read().decode(errors='replace').splitlines()
    except OSError:
        return None
    lines = [line.strip() for line in lines if line.strip()]
    return lines[-1][:300] if lines else None
