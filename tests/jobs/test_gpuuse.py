"""Who uses each GPU, decided without a GPU: NVML's process lists
(tests/parallel/test_nvml.py reads them), ``/proc`` texts, and real
processes' users and sessions read from this machine's ``/proc``."""
import json
import os
import shutil
import subprocess
import sys

import pytest
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
from dasktrain.parallel.outside import (
    HELD,
    WORKER,
    busy_from,
    job_of,
    outside_use,
)


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



# A worker in a container: NVML gives the host's pids, which this
# namespace's /proc does not know (pids above any pid_max here).
HOST = 2 ** 22 + 1000


def container_reading(listed, held, own=()):
    """What worker_use reads in a container where NVML lists ``listed``
    (``{gpu: [(host pid, MiB)]}``) on GPUs '0'..'3', with ``held`` and
    ``own`` as its pool and the driver say; /proc is this machine's."""
    return worker_use(
        env={'CUDA_VISIBLE_DEVICES': '0,1,2,3'}, held=held, own=own,
        nvml=lambda ids, env: {gpu: [{'pid': pid, 'bytes': int(mib * 2 ** 20)}
                                     for pid, mib in listed.get(gpu, ())]
                               for gpu in ids})


def test_a_containerised_workers_own_job_is_not_outside_use_of_its_gpu():
    # GPU 0: the worker's job trains (its child, a host pid). GPU 1: no
    # job; a process of another container. GPU 2: the worker's own CUDA
    # context (a rank ran in it) and nothing else. GPU 3: the worker's
    # context and another container's process beside it.
    listed = {'0': [(HOST, 5000.0)], '1': [(HOST + 1, 700.0)],
              '2': [(HOST + 2, 400.0)],
              '3': [(HOST + 3, 400.0), (HOST + 4, 300.0)]}
    use = container_reading(listed, held=['0'], own=['2', '3'])
    assert [(p['gpu'], p['seen'], p['user'], p['job'])
            for p in use['processes']] == [
        ('0', False, '?', HELD), ('1', False, '?', None),
        ('2', False, '?', WORKER), ('3', False, '?', None),
        ('3', False, '?', WORKER)]
    assert use['held'] == ['0'] and use['own'] == ['2', '3']
    # the queue's view: GPU 0 is its job's; the others' processes are
    # outside use, the larger of GPU 3's two taken as the outsider
    assert busy_from({'w': use}, threshold_mib=256) == {'w': {
        '1': f'? (pid {HOST + 1}, 700 MiB)',
        '3': f'? (pid {HOST + 3}, 400 MiB)'}}
    assert busy_from({'w': use}, threshold_mib=500) == {'w': {
        '1': f'? (pid {HOST + 1}, 700 MiB)'}}


def test_no_unseen_process_is_the_queues_on_a_gpu_no_job_holds():
    # The same host pid on GPU 0 once its job has ended (or before one
    # starts): outside use, whoever it is. Nor is an unseen process the
    # worker's where the worker is seen on that GPU (same namespace).
    listed = {'0': [(HOST, 5000.0)]}
    assert busy_from({'w': container_reading(listed, held=[])}, 256) == \
        {'w': {'0': f'? (pid {HOST}, 5000 MiB)'}}
    worker = {'gpu': '0', 'pid': os.getpid(), 'mib': 300.0, 'user': 'me',
              'session': 1, 'ancestors': [1], 'seen': True}
    unseen = proc('0', HOST, 600.0, user='?', ancestors=())
    unseen.update(seen=False, session=None)
    assert outside_use([worker, unseen], {os.getpid(): WORKER}, 256,
                       held=[], own=['0']) == \
        {'0': f'? (pid {HOST}, 600 MiB)'}
    # unknown memory counts as the largest: never the worker's
    other = dict(unseen, pid=HOST + 1, mib=None)
    assert outside_use([unseen, other], {}, 256, held=[], own=['0']) == \
        {'0': f'? (pid {HOST + 1}, memory unknown)'}


def test_a_pid_seen_as_a_jobs_counts_only_on_a_gpu_the_worker_holds():
    # A host pid that happens to be a pid of this namespace's job (or a
    # job that stepped outside its CUDA_VISIBLE_DEVICES) on a GPU no job
    # holds is outside use; on a held GPU it is the job's. A reading of an
    # earlier worker (no 'held') is judged by lineage alone, as before.
    job = proc('1', 300, 4000.0, ancestors=[250, 90, 1])
    jobs = {250: 'train-job', 90: WORKER}
    assert outside_use([job], jobs, 256, held=['1']) == {}
    assert outside_use([job], jobs, 256, held=['0']) == \
        {'1': 'bob (pid 300, 4000 MiB)'}
    assert busy_from({'w': {'processes': [job], 'jobs': [[250, 'j']]}},
                     256) == {'w': {}}
    # the worker's own (its process, launch's ranks under it): any GPU
    rank = proc('1', 301, 4000.0, ancestors=[90, 1])
    assert outside_use([rank], jobs, 256, held=[]) == {}


IN_NAMESPACE = """
import json, sys
from dasktrain.jobs.worker.gpu_use import worker_use
pid, held = int(sys.argv[1]), json.loads(sys.argv[2])
print(json.dumps(worker_use(
    env={'CUDA_VISIBLE_DEVICES': '0'}, held=held, own=[],
    nvml=lambda ids, env: {'0': [{'pid': pid, 'bytes': 2 ** 30}]})))
"""


def test_in_a_pid_namespace_a_host_pid_is_unseen_and_judged_by_the_rule():
    # A real PID namespace with its own /proc, as a container has: this
    # process's pid (the host's, as NVML gives it) means nothing there.
    if shutil.which('unshare') is None:
        pytest.skip('no unshare (util-linux)')
    argv = ['unshare', '--pid', '--fork', '--mount-proc']
    if os.geteuid() != 0:
        argv[1:1] = ['--user', '--map-root-user']
    readings = []
    for held in ([], ['0']):
        run = subprocess.run(argv + [sys.executable, '-c', IN_NAMESPACE,
                                     str(os.getpid()), json.dumps(held)],
                             capture_output=True, text=True, timeout=60)
        if run.returncode != 0 and not readings and \
                'dasktrain' not in run.stderr:
            pytest.skip(f'no PID namespace here: {run.stderr.strip()}')
        assert run.returncode == 0, run.stderr
        readings.append(json.loads(run.stdout))
    free, held = readings
    assert [(p['seen'], p['user'], p['job']) for p in free['processes']] == \
        [(False, '?', None)]
    assert busy_from({'w': free}, 256) == \
        {'w': {'0': f'? (pid {os.getpid()}, 1024 MiB)'}}
    assert [p['job'] for p in held['processes']] == [HELD]
    assert busy_from({'w': held}, 256) == {'w': {}}
