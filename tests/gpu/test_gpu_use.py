"""Who uses a real GPU (dasktrain.jobs.worker.gpu_use through real NVML):
a process outside the queue holding GPU memory is seen with its pid, Unix
user and memory, makes the GPU busy over the threshold, and belongs to a
job once its pid is a job's."""
import json
import os
import subprocess
import sys
import time

from children import child
from gpu_marks import needs

from dasktrain.jobs.job import current_user
from dasktrain.parallel.outside import outside_use

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
