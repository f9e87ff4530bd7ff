"""The queue's order: the pure planner (dasktrain.jobs.scheduler.policy.plan)
on scripted queues, and the dispatcher applying it on a real local cluster
whose worker advertises GPU=2 with GPU ids faked by CUDA_VISIBLE_DEVICES:
submission order, a 2-GPU job not starved by a stream of 1-GPU jobs,
--after, the per-user limit and the reasons `dasktrain jobs` shows."""
import json
import os
import sys
import urllib.request

import pytest
from distributed import Client
from test_cluster import Processes, job_config, wait_until

from dasktrain.cli import main
from dasktrain.commands.jobs import estimate_words
from dasktrain.jobs.client.submit import submit, submit_command
from dasktrain.jobs.fields import parse_time
from dasktrain.jobs.job import Job, JobError, current_user
from dasktrain.jobs.record import JobRecord
from dasktrain.jobs.scheduler.dispatch import estimated_end, set_user_limit
from dasktrain.jobs.scheduler.outside_use import busy_outside
from dasktrain.jobs.scheduler.policy import plan
from dasktrain.jobs.scheduler.query import scheduler_answer
from dasktrain.parallel.gpus import Gpu, GpuPool

W = {'w1': {'gpus': ['0', '1'], 'cpus': 1}}


def run(job_id, gpus, held, worker='w1', end=None, user='ann', **kw):
    return dict(id=job_id, user=user, gpus=gpus, worker=worker, held=held,
                end=end, **kw)


def q(job_id, gpus, user='ann', **kw):
    return dict(id=job_id, user=user, gpus=gpus, **kw)


# ------------------------------------------------------------ the planner

def test_jobs_start_in_submission_order_among_those_that_fit():
    p = plan([q('a', 1), q('b', 1), q('c', 1)], [], W, now=0.0)
    assert p.starts == [('a', 'w1', ['0']), ('b', 'w1', ['1'])]
    assert p.reasons == {'c': 'needs 1 GPU, 0 free'}
    assert p.estimates['c'] == {'position': 3, 'start': None}


def test_a_big_job_first_in_line_is_not_starved_by_small_ones():
    running = [run('r1', 1, ['0'], end=100.0)]
    queued = [q('big', 2), q('s1', 1), q('s2', 1, time=50.0),
              q('s3', 1, time=200.0)]
    p = plan(queued, running, W, now=10.0)
    # s2 ends (60) before big's reservation (100): it backfills; s1
    # (unknown length) and s3 (ends at 210) would delay big
    assert p.starts == [('s2', 'w1', ['1'])]
    assert p.reasons['big'] == 'needs 2 GPUs, 1 free'
    assert p.reasons['s1'] == 'behind job big (first in line)'
    assert p.reasons['s3'] == 'needs 1 GPU, 0 free'  # s2 took the last
    assert p.estimates['big'] == {'position': 1, 'start': 100.0}
    # once both GPUs can be held, big starts before every small job
    p = plan(queued, [], W, now=120.0)
    assert p.starts == [('big', 'w1', ['0', '1'])]


def test_small_jobs_backfill_onto_gpus_the_big_one_cannot_use():
    workers = {'w1': {'gpus': ['0', '1'], 'cpus': 0},
               'w2': {'gpus': ['0', '1', '2', '3'], 'cpus': 0}}
    running = [run('r', 3, ['0', '1', '2'], worker='w2', end=500.0)]
    p = plan([q('big', 4), q('s', 1), q('t', 1)], running, workers, now=0)
    # w1 can never hold 4: small jobs go there freely; w2's free GPU is
    # big's
    assert p.starts == [('s', 'w1', ['0']), ('t', 'w1', ['1'])]
    # a running job of unknown end may end any moment: even a short job
    # may not take a GPU the big one needs
    p = plan([q('big', 2), q('s', 1, time=1.0)],
             [run('r', 1, ['0'])], W, now=0)
    assert p.starts == [] and p.reasons['s'].startswith('behind job big')
    p = plan([q('big', 3), q('s', 1), q('t', 1)],
             [run('r', 2, ['0', '1'], worker='w2', end=500.0)],
             {'w2': workers['w2']}, now=0)
    # big needs 3 of w2's 4 at 500: one of the two free now is spare
    assert p.starts == [('s', 'w2', ['2'])]
    assert p.reasons['t'] == 'behind job big (first in line)'


def test_a_job_across_workers_is_a_gang_in_the_same_order():
    three = {w: {'gpus': ['0', '1'], 'cpus': 1} for w in ('w1', 'w2', 'w3')}
    # two ranks of 2 GPUs: the two tightest workers that have them, at once
    p = plan([q('gang', 2, ranks=2)], [run('r', 1, ['0'], worker='w2')],
             three, now=0.0)
    assert p.starts == [('gang', 'w1', ['0', '1']),
                        ('gang', 'w3', ['0', '1'])]
    # first in line, it waits for its ranks' workers; a later job that
    # would delay them waits behind it, one known to end first backfills
    running = [run('r1', 1, ['0'], worker='w1', end=100.0),
               run('r2', 1, ['0'], worker='w2', end=200.0)]
    queued = [q('gang', 2, ranks=2), q('late', 1), q('quick', 1, time=50.0)]
    p = plan(queued, running, {w: three[w] for w in ('w1', 'w2')}, now=0.0)
    assert p.reasons['gang'] == 'needs 2 workers with 2 GPUs free, 0 have'
    assert p.reasons['late'] == 'behind job gang (first in line)'
    assert p.starts == [('quick', 'w1', ['1'])]
    assert p.estimates['gang']['start'] == 200.0
    # a gang of CPU ranks takes a slot on each, and counts as its ranks'
    # GPUs under a user limit
    p = plan([q('cpus', 0, ranks=3)], [], three, now=0.0)
    assert [w for _, w, _ in p.starts] == ['w1', 'w2', 'w3']
    p = plan([q('gang', 1, ranks=2)], [], three, now=0.0,
             max_gpus_per_user=1)
    assert p.starts == [] and p.reasons['gang'].startswith('user limit')


def test_estimated_starts_replay_the_rules_at_each_estimated_end():
    running = [run('r1', 1, ['0'], end=100.0), run('r2', 1, ['1'],
                                                    end=300.0)]
    queued = [q('a', 1, time=1000.0), q('b', 2), q('c', 1)]
    p = plan(queued, running, W, now=0.0)
    assert p.starts == []
    assert p.estimates['a']['start'] == 100.0
    assert p.estimates['b']['start'] == 1100.0  # once a and r2 ended
    assert p.estimates['c']['start'] is None  # b's length is unknown
    assert p.estimates['r1'] == {'end': 100.0, 'overdue': False}
    assert plan([], running, W, now=200.0).estimates['r1']['overdue']
    # past its --time, whatever its epochs say
    late = run('t', 1, ['0'], end=900.0, due=100.0)
    assert plan([], [late], W, now=200.0).estimates['t']['overdue']
    assert not plan([], [late], W, now=50.0).estimates['t']['overdue']
    assert plan([], [dict(late, due=None)], W, 901.0).estimates['t'][
        'overdue']


def test_dependencies_wait_then_start_or_end_the_job():
    queued = [q('b', 1, after=['a'])]
    assert plan(queued, [run('a', 1, ['0'])], W, 0).reasons == {
        'b': 'after job a'}
    p = plan(queued, [], W, 0, states={'a': 'finished'})
    assert p.starts == [('b', 'w1', ['0'])]
    p = plan(queued, [], W, 0, states={'a': 'failed'})
    assert p.starts == [] and 'ended failed; it never ran' in p.ends['b']
    p = plan([q('b', 1, after=['a'], after_any=True)], [], W, 0,
             states={'a': 'cancelled'})
    assert p.starts == [('b', 'w1', ['0'])]
    # a job waiting on another holds nobody up
    p = plan([q('b', 2, after=['x']), q('c', 1)], [], W, 0,
             states={'x': 'running'})
    assert p.starts == [('c', 'w1', ['0'])]


def test_the_user_limit_and_gpus_busy_outside_the_queue():
    workers = {'w1': {'gpus': ['0', '1', '2', '3'], 'cpus': 0}}
    running = [run('r', 2, ['0', '1'], user='ann')]
    p = plan([q('a', 1, user='ann'), q('b', 1, user='bob')], running,
             workers, 0, max_gpus_per_user=2)
    assert p.reasons == {'a': 'user limit reached (ann holds 2 of 2 GPUs)'}
    assert p.starts == [('b', 'w1', ['2'])]
    busy = {'w1': {'3': 'root (pid 42, 900 MiB)'}}
    p = plan([q('a', 2, user='bob')], running, workers, 0, busy=busy)
    assert p.reasons == {
        'a': 'GPU 3 busy outside the queue (by root (pid 42, 900 MiB))'}
    p = plan([q('a', 1, user='bob')], running, workers, 0, busy=busy)
    assert p.starts == [('a', 'w1', ['2'])]  # never the busy GPU


def test_a_time_limit_passed_ends_the_job_and_cpu_jobs_take_slots():
    running = [run('r', 1, ['0'], limit=50.0)]
    assert 'time limit passed' in plan([], running, W, 60.0).ends['r']
    p = plan([q('c1', 0), q('c2', 0)], [], W, 0)
    assert p.starts == [('c1', 'w1', [])]
    assert p.reasons == {'c2': 'needs a CPU slot, none free'}


def test_durations_are_checked_and_named():
    assert parse_time('90s') == 90 and parse_time('2h') == 7200
    with pytest.raises(JobError, match='time_limit takes a duration'):
        parse_time('soon', 'time_limit')


# ------------------------------------------- on a real cluster, in order

@pytest.fixture
def cluster(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.close()


WAIT = ('import os, sys, time\n'
        'name = sys.argv[1]\n'
        'gpus = os.environ["CUDA_VISIBLE_DEVICES"]\n'
        'with open("order.log", "a") as f:\n'
        '    f.write(name + " " + gpus + "\\n")\n'
        'while not os.path.exists("release-" + name):\n'
        '    time.sleep(0.1)\n')


def started(lab):
    log = lab / 'order.log'
    return [line.split() for line in log.read_text().splitlines()] \
        if log.exists() else []


def test_a_two_gpu_job_is_not_starved_by_a_stream_of_one_gpu_jobs(
        cluster, tmp_path, capsys):
    cluster.worker(gpus=2, visible='3,5')
    lab = tmp_path / 'lab'
    lab.mkdir()
    (lab / 'wait.py').write_text(WAIT)
    jobs = tmp_path / 'jobs'

    def submit(name, gpus, **kw):
        return submit_command([sys.executable, 'wait.py', name], gpus=gpus,
                              name=name, cwd=lab, client=client, path=jobs,
                              **kw)
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        a, b = submit('a', 1), submit('b', 1)
        big = submit('big', 2)
        c = submit('c', 1)
        d = submit('d', 1, after=[c.id])
        # bounds, not expectations: on a loaded 2-core machine a step
        # once took longer than 60 s
        wait_until(lambda: len(started(lab)) == 2, 120, 'a and b start')
        assert sorted(n for n, _ in started(lab)) == ['a', 'b']
        assert sorted(g for _, g in started(lab)) == ['3', '5']
        wanted = ('needs 2 GPUs, 0 free', 'needs 1 GPU, 0 free',
                  f'after job {c.id}', '#1, start unknown')
        wait_until(lambda: all(w in _table(jobs, capsys) for w in wanted),
                   120, 'every waiting job says why')
        (lab / 'release-a').touch()
        wait_until(lambda: a.status()['state'] == 'finished', 120, 'a ends')
        # a GPU is free, but big is first in line: c must not take it
        wait_until(lambda: 'needs 2 GPUs, 1 free' in _table(jobs, capsys),
                   120, 'the queue sees the freed GPU')
        assert f'behind job {big.id} (first in line)' in _table(jobs, capsys)
        assert c.status()['state'] == 'queued'
        assert sorted(n for n, _ in started(lab)) == ['a', 'b']
        (lab / 'release-b').touch()
        wait_until(lambda: len(started(lab)) == 3, 120, 'big starts')
        assert started(lab)[2] == ['big', '3,5']
        (lab / 'release-big').touch()
        wait_until(lambda: len(started(lab)) == 4, 120, 'c starts')
        assert started(lab)[3][0] == 'c'
        (lab / 'release-c').touch()
        wait_until(lambda: len(started(lab)) == 5, 120, 'd starts after c')
        assert started(lab)[4][0] == 'd'
        (lab / 'release-d').touch()
        for job in (b, big, c, d):
            wait_until(lambda job=job: job.status()['state'] == 'finished',
                       30, f'{job.id} ends')


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(100, 50, 7)


def test_a_job_across_workers_waits_its_turn_as_a_gang(cluster, tmp_path,
                                                       data_dir):
    # Two workers of one CPU slot; one slot held: a job across both waits
    # in the queue (no Dask task yet), and the job behind it waits too.
    for _ in range(2):
        cluster.worker(resources='CPU=1', nthreads=3)
    jobs = tmp_path / 'jobs'
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(2)

        def view(job):
            return scheduler_answer([job.key], client).get(job.key, {})
        hold = submit_command([sys.executable, '-c',
                               'import time; time.sleep(300)'], cwd=tmp_path,
                              client=client, path=jobs, name='hold')
        wait_until(lambda: hold.status()['state'] == 'running', 60,
                   'the first job runs')
        gang = submit(job_config(data_dir, workers=2, epochs=1,
                                 train_size=200, test_size=50), gpus=0,
                      client=client, path=jobs)
        after = submit_command([sys.executable, '-c', 'pass'], cwd=tmp_path,
                               client=client, path=jobs, name='after')
        wait_until(lambda: view(gang).get('reason') and
                   view(after).get('reason'), 30, 'the queue\'s reasons')
        assert view(gang)['task'] == 'held'
        assert view(gang)['reason'] == \
            'needs 2 workers with a CPU slot free, 1 have'
        assert view(after)['reason'] == \
            f'behind job {gang.id} (first in line)'
        hold.cancel(client)
        assert gang.result(timeout=180)['final']['epoch'] == 1
        after.result(timeout=60)
    assert gang.status()['started'] >= hold.status()['ended'] - 1.0
    assert after.status()['started'] >= gang.status()['ended'] - 1.0


def _table(jobs, capsys):
    main(['jobs', '--jobs-dir', str(jobs)])
    return capsys.readouterr().out


def test_limits_dependencies_and_time_limits_on_a_cluster(cluster,
                                                         tmp_path):
    cluster.worker(resources='GPU=2 CPU=1', nthreads=3)
    jobs, me = tmp_path / 'jobs', current_user()

    def submit(argv, gpus=0, **kw):
        return submit_command(argv, gpus=gpus, cwd=tmp_path, client=client,
                              path=jobs, **kw)
    sleep = [sys.executable, '-c', 'import time; time.sleep(60)']
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        set_user_limit(client, 1)
        held = submit(sleep, gpus=1, time='1h')
        over = submit(sleep, gpus=1)
        fails = submit([sys.executable, '-c', 'raise SystemExit(4)'])
        never = submit(['true'], after=fails.id)
        anyway = submit(['true'], after=[fails.id], after_any=True)
        limited = submit(sleep, time_limit='2s')
        status = _wait_for_end(never)
        assert status['state'] == 'failed'
        assert status['error'] == (
            f'job {fails.id}, which it runs after, ended failed; it never '
            'ran (--after-any runs it after a failure too)')
        assert _wait_for_end(anyway)['state'] == 'finished'
        status = _wait_for_end(limited)
        assert status['state'] == 'failed'
        assert status['error'].startswith('its time limit passed')
        assert status['error'].endswith('stopped by SIGTERM')
        wait_until(lambda: scheduler_answer([held.key], client)[held.key]
                   .get('end'), 30, "the queue's estimate")
        answer = scheduler_answer([held.key, over.key], client)
        assert answer[over.key]['reason'] == (
            f'user limit reached ({me} holds 1 of 1 GPU)')
        assert answer[over.key]['task'] == 'held'
        assert answer[held.key]['end'] == pytest.approx(
            held.status()['started'] + 3600)
        with pytest.raises(JobError, match='max_gpus_per_user must be'):
            set_user_limit(client, 0)
        with pytest.raises(JobError, match="after: no job 'nope'"):
            submit(['true'], after='nope')
        for job in (held, over):
            job.cancel(client)


# A stranger's process as NVML and /proc show it on the worker: root's pid
# 42 holds 900 MiB of GPU 3. Scripted where the worker reads NVML and /proc
# (worker_use's nvml and read), so that the heartbeat, the dispatcher and
# `dasktrain gpus` take their own path from there on.
BUSY = '''\
from dasktrain.jobs.worker.gpu_use import USE_METRIC, worker_use


def nvml(ids, env):
    return {gpu: [{'pid': 42, 'bytes': 900 * 2 ** 20}] if gpu == '3' else []
            for gpu in ids}


def read(pid):
    return {'uid': 0, 'ppid': 1 if pid == 42 else None, 'session': pid}


def dask_setup(worker):
    worker.metrics[USE_METRIC] = lambda w: worker_use(w, read=read,
                                                      nvml=nvml)
'''
STRANGER = 'root (pid 42, 900 MiB)'


def test_a_gpu_busy_outside_the_queue_is_never_handed_out(cluster, tmp_path,
                                                          capsys):
    # The worker's preloads: dasktrain.jobs.worker.preload (its GPUs as
    # CUDA_VISIBLE_DEVICES names them, who uses them), then the scripted
    # NVML reading above in place of the real one.
    (tmp_path / 'busy.py').write_text(BUSY)
    cluster.spawn('worker', cluster.address, '--no-nanny', '--nthreads', '2',
                  '--resources', 'GPU=2', '--host', '127.0.0.1',
                  '--preload', 'dasktrain.jobs.worker.preload', '--preload',
                  str(tmp_path / 'busy.py'), cwd=tmp_path,
                  env=dict(os.environ, CUDA_VISIBLE_DEVICES='3,5'))
    lab, jobs = tmp_path / 'lab', tmp_path / 'j'
    lab.mkdir()
    (lab / 'wait.py').write_text(WAIT)
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        wait_until(lambda: list(client.run_on_scheduler(busy_outside)
                                .values()) == [{'3': STRANGER}], 30,
                   "the worker's heartbeat")
        two = submit_command([sys.executable, 'wait.py', 'two'], gpus=2,
                             name='two', cwd=lab, client=client, path=jobs)
        one = submit_command([sys.executable, 'wait.py', 'one'], gpus=1,
                             name='one', cwd=lab, client=client, path=jobs)
        wait_until(lambda: started(lab), 60, 'one starts')
        assert started(lab) == [['one', '5']]  # never GPU 3
        assert two.status()['state'] == 'queued'
        # `dasktrain gpus` names the GPUs as the queue does: one holds 5,
        # and 3 is busy by the queue's own rule
        wait_until(lambda: one.status()['gpus'] == ['5'], 30, 'one runs')
        assert main(['gpus', '--scheduler', cluster.address,
                     '--jobs-dir', str(jobs)]) == 0
        rows = capsys.readouterr().out.splitlines()
        assert f'{one.id} (one)' in next(r for r in rows if '  5  ' in r)
        row = next(r for r in rows if '  3  ' in r)
        assert ' free ' in row and f'{STRANGER}, busy: no job gets it' in row
        (lab / 'release-one').touch()
        _wait_for_end(one)
        # GPU 5 is free again, GPU 3 still busy: two waits, and says why
        busy = f'GPU 3 busy outside the queue (by {STRANGER})'
        wait_until(lambda: scheduler_answer([two.key], client)[two.key]
                   .get('reason') == busy, 30, 'the reason')
        assert busy in _table(jobs, capsys)
        assert scheduler_answer([two.key], client)[two.key]['task'] == 'held'
        assert two.status()['state'] == 'queued'
        assert started(lab) == [['one', '5']]
        two.cancel(client)


def _wait_for_end(job, timeout=60):
    wait_until(lambda: job.status()['state'] in (
        'finished', 'failed', 'cancelled', 'lost'), timeout, 'the job ends')
    return job.status()


def test_a_running_jobs_end_from_its_epoch_times_or_its_time(tmp_path):
    folder = tmp_path / 'job'
    (folder / 'out').mkdir(parents=True)
    job = Job('job', folder)
    spec = JobRecord.of({'version': 1, 'submitted': 1.0, 'gpus': 0,
                         'config': {'epochs': 10}, 'time': 3600.0})
    # no epoch yet: its --time after its start
    assert estimated_end(job, spec, {'started': 100.0}, now=200.0) == 3700.0
    untimed = JobRecord.of({'version': 1, 'submitted': 1.0, 'gpus': 0,
                            'command': ['true']})
    assert estimated_end(job, untimed, {'started': 100.0}, now=200.0) is None
    # its first seconds, before its worker records its start: from now
    assert estimated_end(job, spec, {'state': 'queued'}, now=150.0) == \
        3750.0
    # 4 epochs in 40 s: 6 more take 60 s from the log's last write
    (folder / 'out' / 'log').write_text(json.dumps(
        [{'epoch': e, 'elapsed_time': 10.0 * e} for e in range(1, 5)]))
    os.utime(folder / 'out' / 'log', (1000.0, 1000.0))
    assert estimated_end(job, spec, {'started': 100.0}, now=1010.0) == 1060.0
    # a command job (no config: no epochs to go) writing such rows: its
    # --time decides, not the rows
    command = JobRecord.of({'version': 1, 'submitted': 1.0, 'gpus': 0,
                            'command': ['true'], 'time': 3600.0})
    assert estimated_end(job, command, {'started': 100.0},
                         now=1010.0) == 3700.0


def test_the_jobs_table_labels_its_estimates():
    assert estimate_words('queued', {'position': 1, 'start': None}) == \
        '#1, start unknown'
    assert estimate_words('queued', {'position': 2, 'start': 3600.0}) \
        .startswith('#2, start ~')
    # started by the queue, its worker not yet running it: its end
    assert estimate_words('queued', {'end': 3600.0, 'overdue': False}) \
        .startswith('end ~')
    assert estimate_words('running', {'end': None, 'overdue': False}) == \
        'end unknown'
    assert estimate_words('running', {'end': 1.0, 'overdue': True}) \
        .endswith('OVERDUE')
    assert estimate_words('finished', {}) == '-'


@pytest.mark.parametrize('flags, message', [
    (['--time', 'soon'], "--time takes a duration such as 90s"),
    (['--time-limit', '0'], '--time-limit takes a duration'),
    (['--after', 'nope'], "--after: no job 'nope' in"),
    (['--after-any'], '--after-any needs --after ID[,ID]'),
])
def test_queue_flags_are_checked_first_in_one_line(flags, message, tmp_path,
                                                   capsys):
    # checked before any scheduler is asked (none listens there)
    code = main(['submit', *flags, '--scheduler', 'tcp://127.0.0.1:1',
                 '--jobs-dir', str(tmp_path), '--', 'true'])
    err = capsys.readouterr().err
    assert code != 0 and message in err and 'Traceback' not in err
    assert len(err.strip().splitlines()) == 1


def test_cluster_start_limits_users_and_the_jobs_page_says_why(
        tmp_path, monkeypatch, capsys):
    # The real `cluster start` (TLS, dasktrain's preloads: the
    # queue's dispatcher talks TLS to its own scheduler) with 2 fake GPUs.
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path / 'home'))
    monkeypatch.setenv('DASKTRAIN_JOBS_DIR', str(tmp_path / 'jobs'))
    assert main(['cluster', 'start', '--port', '0', '--dashboard-port', '0',
                 '--gpus', '2', '--max-gpus-per-user', '1']) == 0
    out = capsys.readouterr().out
    assert "GPUs one user's jobs may hold at once: 1" in out
    base = json.loads((tmp_path / 'home' / 'cluster.json').read_text())[
        'dashboard'].rsplit('/', 1)[0]
    try:
        sleep = [sys.executable, '-c', 'import time; time.sleep(60)']
        first = submit_command(sleep, gpus=1, cwd=tmp_path, time='1h')
        second = submit_command(sleep, gpus=1, cwd=tmp_path)

        def page():
            with urllib.request.urlopen(base + '/dasktrain/api/jobs',
                                        timeout=10) as r:
                return {j['id']: j for j in json.loads(r.read())['jobs']}
        # the page reads the job board (events) and the queue's last plan
        # (each second): both have caught up once the first's end is known
        # and its worker's event that it runs has come
        wait_until(lambda: page()[second.id]['reason'] and
                   page()[first.id]['end'] and
                   page()[first.id]['state'] == 'running', 60,
                   'a reason, an end and the first running')
        jobs = page()
        assert jobs[second.id]['reason'] == (
            f'user limit reached ({current_user()} holds 1 of 1 GPU)')
        assert jobs[second.id]['position'] == 1
        assert jobs[first.id]['state'] == 'running'
        assert jobs[first.id]['end'] == pytest.approx(
            first.status()['started'] + 3600)
        first.cancel()
        second.cancel()
    finally:
        main(['cluster', 'stop'])


def test_a_worker_hands_out_the_gpus_the_queue_planned():
    env = {'CUDA_VISIBLE_DEVICES': '3,5'}
    taken = GpuPool.acquire(1, total=2, env=env, want=['5'])
    try:
        assert taken == [Gpu(1, '5')]
        # planned GPUs that are not free (or not this worker's): the
        # first free ones, never one held twice
        other = GpuPool.acquire(1, total=2, env=env, want=['5'])
        assert other == [Gpu(0, '3')]
        GpuPool.release(other)
    finally:
        GpuPool.release(taken)
