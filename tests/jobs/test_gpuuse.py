"""Who uses each GPU, decided without a GPU: NVML's process lists
(tests/parallel/test_nvml.py reads them), ``/proc`` texts, and real
processes' users and sessions read from this machine's ``/proc``."""
import os
import subprocess
import sys

from test_cluster import wait_until

from dasktrain.jobs.worker.gpu_use import (
    lineage,
    parse_stat,
    parse_status,
    read_process,
    threshold,
    worker_use,
)
from dasktrain.parallel.nvml import worker_devices
from dasktrain.parallel.outside import busy_from, job_of, outside_use


def test_proc_texts_parse():
    assert parse_status('Name:\tx\nUmask:\t0022\nPPid:\t1\n'
                        'Uid:\t0\t1000\t1000\t1000\n') == (0, 1)
    assert parse_stat('7 (a) b) c) R 1 7 6 0 -1 4194560') == 6
    assert read_process(2 ** 22 + 7) == {'uid': None, 'ppid': None,
                                         'session': None}


def proc(gpu, pid, mib, user='bob', session=None, ancestors=(1,)):
    return {'gpu': gpu, 'pid': pid, 'mib': mib, 'user': user,
            'session': pid if session is None else session,
            'ancestors': list(ancestors)}


def test_outside_use_names_who_holds_a_gpu_outside_the_queue():
    processes = [
        proc('0', 100, 9000.0),                        # bob's training
        proc('0', 101, 30.0, user='gdm'),              # a desktop: small
        proc('1', 200, 5000.0, session=150, ancestors=[150, 90, 1]),
        proc('2', 300, 4000.0, ancestors=[250, 90, 1]),  # a training job
        proc('3', 400, None, user='?'),                # another container
        proc('4', 500, 800.0), proc('4', 501, 1200.0, user='ann')]
    jobs = {150: 'cmd-job', 250: 'train-job', 90: 'dask worker'}
    assert outside_use(processes, jobs, threshold_mib=256) == {
        '0': 'bob (pid 100, 9000 MiB)',
        '3': '? (pid 400, memory unknown)',
        '4': 'ann (pid 501, 1200 MiB), bob (pid 500, 800 MiB)'}
    assert outside_use(processes, jobs, threshold_mib=1000) == {
        '0': 'bob (pid 100, 9000 MiB)',
        '3': '? (pid 400, memory unknown)',
        '4': 'ann (pid 501, 1200 MiB)'}
    assert outside_use([], jobs, 256) == {}
    # the nearest job wins over the worker the job runs under
    assert job_of(processes[3], jobs) == 'train-job'
    assert threshold({'DASKTRAIN_BUSY_MIB': 'x'}) == 256.0


def test_a_workers_gpu_ids_are_matched_by_uuid_when_the_driver_says():
    a = dict(index=0, uuid='GPU-aa', name='A100', migs=[])
    b = dict(index=1, uuid='GPU-bb', name='T4', migs=[])
    assert list(worker_devices([a, b], ['1', '0'])) == []  # mixed: unknown
    assert {e: g['index'] for e, g in worker_devices(
        [a, b], ['1', 'GPU-aa'], pci_order=True).items()} == \
        {'1': 1, 'GPU-aa': 0}


def test_real_processes_are_matched_to_their_job_by_session_or_ancestry():
    # a program run as a command job is: its own session, a shell and a
    # child of the shell; a daemon that left its parent keeps the session
    child = subprocess.Popen(
        ['sh', '-c', f'{sys.executable} -c "import time; time.sleep(60)" '
                     '& wait'], start_new_session=True)
    try:
        def grandchildren():
            return [int(p) for p in os.listdir('/proc') if p.isdigit() and
                    read_process(int(p))['ppid'] == child.pid]
        wait_until(grandchildren, 10, 'the grandchild')
        pid = grandchildren()[0]
        uid, session, ancestors = lineage(pid)
        assert uid == os.getuid() and session == child.pid
        assert ancestors[:2] == [child.pid, os.getpid()]
        process = {'gpu': '0', 'pid': pid, 'mib': 5000.0, 'user': 'x',
                   'session': session, 'ancestors': ancestors}
        assert job_of(process, {child.pid: 'job-1'}) == 'job-1'
        assert outside_use([process], {child.pid: 'job-1'}, 256) == {}
        assert outside_use([process], {}, 256) == \
            {'0': f'x (pid {pid}, 5000 MiB)'}
        assert job_of(dict(process, ancestors=[1]),
                      {child.pid: 'job-1'}) == 'job-1'  # reparented
    finally:
        os.killpg(child.pid, 9)
        child.wait()


def test_a_worker_without_nvml_reports_its_gpu_ids_and_no_processes():
    use = worker_use(env={'CUDA_VISIBLE_DEVICES': '3,5'})
    assert use['ids'] == ['3', '5'] and use['processes'] == []
    assert use['nvml'] is False
    assert [os.getpid(), 'dask worker'] in use['jobs']
    # the scheduler side: each worker's busy GPUs from its heartbeat
    uses = {'tcp://w:1': {'processes': [proc('5', 9, 700.0)],
                          'jobs': [[4, 'j']]}, 'tcp://w:2': None}
    assert busy_from(uses, threshold_mib=512) == {
        'tcp://w:1': {'5': 'bob (pid 9, 700 MiB)'}, 'tcp://w:2': {}}
    assert busy_from(uses, threshold_mib=1024) == {
        'tcp://w:1': {}, 'tcp://w:2': {}}

