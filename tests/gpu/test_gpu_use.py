"""Who uses a real GPU (dasktrain.jobs.worker.gpu_use through real NVML):
a process outside the queue holding GPU memory is seen with its pid, Unix
user and memory, makes the GPU busy over the threshold, and belongs to a
job once its pid is a job's. A worker in a PID namespace of its own (as in
a container) sees NVML's pids unresolved: its own context is its own, a
process beside it outside use unless a job holds the GPU."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from children import child
from gpu_marks import needs

from dasktrain.jobs.job import current_user
from dasktrain.parallel.outside import HELD, WORKER, busy_from, outside_use

HOLD = ('import cupy, time\n'
        'a = cupy.zeros(2 ** 28, dtype=cupy.float32)  # 1 GiB\n'
        'cupy.cuda.Device().synchronize()\n'
        'print("ready", flush=True)\n'
        'time.sleep(120)\n')


def _worker_use(env):
    """worker_use as a worker process runs it: not an ancestor of the
    holder (a process's own descendants are its job's, or the worker's)."""
    out = subprocess.run(
        [sys.executable, '-c', 'import json, sys; from dasktrain.jobs.'
         'worker.gpu_use import worker_use; print(json.dumps(worker_use('
         'env=json.loads(sys.argv[1]))))', json.dumps(env)],
        capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


@needs(1)
def test_a_process_holding_a_gpu_is_seen_with_its_user_and_memory():
    env = {'CUDA_VISIBLE_DEVICES': '0', 'CUDA_DEVICE_ORDER': 'PCI_BUS_ID'}
    with child([sys.executable, '-c', HOLD],
               env=dict(os.environ, **env)) as holder:
        deadline = time.monotonic() + 60
        while 'ready\n' not in holder.lines:
            assert time.monotonic() < deadline, holder.stderr()
            time.sleep(0.2)
        pid = holder.proc.pid
        deadline = time.monotonic() + 30
        while True:  # NVML lists a process a moment after its context
            use = _worker_use(env)
            mine = [p for p in use['processes'] if p['pid'] == pid]
            if mine or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert use['nvml'] and use['ids'] == ['0']
        assert mine, use['processes']
        seen = mine[0]
        assert seen['user'] == current_user() and seen['gpu'] == '0'
        assert seen['job'] is None and seen['session'] == pid
        assert seen['mib'] is None or seen['mib'] >= 1024
        processes = [p for p in use['processes'] if p['pid'] == pid]
        busy = outside_use(processes, {}, threshold_mib=512)
        assert busy['0'].startswith(f'{current_user()} (pid {pid}, ')
        assert outside_use(processes, {pid: 'job-1'}, 512) == {}


# A worker in a PID namespace of its own, as in a container: it makes a
# CUDA context (as a rank run in the worker leaves one), then reads who
# uses GPU 0 as its heartbeat does, with no job holding it and with one.
IN_NAMESPACE = """
import json, time, cupy
from dasktrain.jobs.worker.gpu_use import worker_use
cupy.zeros(1)
cupy.cuda.Device().synchronize()
deadline = time.monotonic() + 30
while True:  # NVML lists a process a moment after its context
    free = worker_use(held=[])
    if len(free['processes']) >= 2 or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps({'free': free, 'held': worker_use(held=['0'])}))
"""


def _unshare():
    """``unshare`` making a PID namespace with its own /proc (a user
    namespace too where this is not root), or skip saying why not."""
    if shutil.which('unshare') is None:
        pytest.skip('no unshare (util-linux)')
    argv = ['unshare', '--pid', '--fork', '--mount-proc']
    if os.geteuid() != 0:
        argv[1:1] = ['--user', '--map-root-user']
    tried = subprocess.run(argv + ['true'], capture_output=True, text=True,
                           timeout=30)
    if tried.returncode != 0:
        pytest.skip(f'no PID namespace here: {tried.stderr.strip()}')
    return argv


@needs(1)
def test_a_worker_in_a_pid_namespace_tells_its_own_from_outside_use():
    env = {'CUDA_VISIBLE_DEVICES': '0', 'CUDA_DEVICE_ORDER': 'PCI_BUS_ID'}
    unshare = _unshare()
    with child([sys.executable, '-c', HOLD],
               env=dict(os.environ, **env)) as holder:
        deadline = time.monotonic() + 60
        while 'ready\n' not in holder.lines:
            assert time.monotonic() < deadline, holder.stderr()
            time.sleep(0.2)
        read = subprocess.run(unshare + [sys.executable, '-c', IN_NAMESPACE],
                              env=dict(os.environ, **env), timeout=120,
                              capture_output=True, text=True)
    assert read.returncode == 0, read.stderr
    got = json.loads(read.stdout)
    free, held = got['free'], got['held']
    assert free['nvml'] and free['own'] == ['0'] and free['held'] == []
    listed = {p['pid']: p for p in free['processes']}
    if holder.proc.pid not in listed and all(p['seen'] for p in
                                             listed.values()):
        # Seen with driver 580 on an H100 (a Firecracker VM): NVML gives
        # the pids of the reader's own namespace and lists nobody outside
        # it. Then the reader's own context is seen, and its own: nothing
        # on the GPU is outside use.
        assert [p['job'] for p in listed.values()] == [WORKER], listed
        assert busy_from({'w': free}, threshold_mib=512) == {'w': {}}
        return
    # NVML names both by the host's pids, which /proc there does not know
    assert holder.proc.pid in listed, free['processes']
    assert len(listed) == 2, free['processes']
    assert not any(p['seen'] for p in listed.values())
    worker = next(p for pid, p in listed.items() if pid != holder.proc.pid)
    # the worker's own context (no 1 GiB array: the smaller) is its own;
    # the holder beside it is outside use of GPU 0, which no job holds
    assert worker['job'] == WORKER and listed[holder.proc.pid]['job'] is None
    busy = busy_from({'w': free}, threshold_mib=512)['w']
    assert list(busy) == ['0'] and \
        busy['0'].startswith(f'? (pid {holder.proc.pid}, ')
    # held by a job of the worker: both unseen processes are the queue's
    assert [p['job'] for p in held['processes']] == [HELD, HELD]
    assert busy_from({'w': held}, threshold_mib=512) == {'w': {}}
