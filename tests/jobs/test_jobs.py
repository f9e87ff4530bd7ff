"""The job queue on real `dask scheduler` / `dask worker` processes on
127.0.0.1: CPU workers labelled with fake GPU resources, jobs that train
on the CPU; `dasktrain submit`, `jobs`, `logs`, `cancel` and `result`."""
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from distributed import Client
from test_cluster import Processes, job_config, wait_until

from dasktrain.cli import main
from dasktrain.jobs.client.submit import submit
from dasktrain.jobs.job import Job, JobError, list_jobs
from dasktrain.jobs.scheduler.board import JobBoard
from dasktrain.jobs.status import job_rows
from dasktrain.run.train import train

TIME_KEYS = {'elapsed_time', 'images_per_sec', 'data_wait_time',
             'comm_time'}


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return make_cifar_dir(200, 100, 5)


@pytest.fixture
def cluster(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.close()


def test_three_one_gpu_jobs_share_a_two_gpu_worker(cluster, data_dir,
                                                   tmp_path):
    cluster.worker(gpus=2)
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        jobs = [submit(job_config(data_dir, epochs=3), gpus=1,
                       name=f'j{i}', client=client, path=tmp_path / 'jobs')
                for i in range(3)]
    # the submitting client is gone; the jobs go on
    results = [job.result(timeout=180) for job in jobs]
    assert all(r['final']['epoch'] == 3 for r in results)
    spans = [(s['started'], s['ended'], s['gpus'][0])
             for s in (job.status() for job in jobs)]
    for start, _, _ in spans:  # who runs at each moment a job starts
        running = [g for s, e, g in spans if s <= start < e]
        assert len(running) <= 2
        assert len(set(running)) == len(running)  # never the same GPU
    assert {g for _, _, g in spans} == {'0', '1'}
    for job, (_, _, gpu) in zip(jobs, spans):  # each saw its own GPU only
        assert f"CUDA_VISIBLE_DEVICES='{gpu}'" in job.logs()


def test_a_cpu_job_sees_no_gpu(cluster, data_dir, tmp_path):
    # A worker that offers GPUs and CPU slots, as `cluster start` makes on
    # a GPU server; the CPU job must not inherit the worker's GPUs.
    cluster.spawn('worker', cluster.address, '--no-nanny', '--nthreads',
                  '3', '--resources', 'GPU=2 CPU=1', '--host', '127.0.0.1',
                  '--local-directory', str(tmp_path / 'space'))
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        job = submit(job_config(data_dir, epochs=1, devices=None), gpus=0,
                     client=client, path=tmp_path / 'jobs')
    result = job.result(timeout=180)
    assert result['final']['epoch'] == 1
    assert "CUDA_VISIBLE_DEVICES=''" in job.logs()
    assert job.status()['gpus'] == []


def test_a_submitted_job_across_two_cpu_workers(cluster, data_dir,
                                                tmp_path):
    for _ in range(2):  # as `cluster start` makes them: 1 slot + 1 thread
        cluster.spawn('worker', cluster.address, '--no-nanny', '--nthreads',
                      '2', '--resources', 'CPU=1', '--host', '127.0.0.1',
                      '--local-directory', str(tmp_path / 'space'))
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(2)
        job = submit(job_config(data_dir, workers=2, mode='ipm',
                                mix_every=2), gpus=0, client=client,
                     path=tmp_path / 'jobs')
        with pytest.raises(JobError, match='workers 3 needs as many Dask '
                           'workers with a CPU slot'):
            submit(job_config(data_dir, workers=3), gpus=0, client=client,
                   path=tmp_path / 'jobs')
    result = job.result(timeout=180)
    assert result['final']['epoch'] == 2
    assert result['final']['iteration'] == 2 * 4  # 400 images / (2 x 50)
    assert 'drift' in result['final']
    assert 'done: epoch 2' in job.logs()


def test_a_gang_goes_on_with_the_ranks_left_when_a_worker_dies(
        cluster, data_dir, tmp_path):
    # on_worker_loss continue (the default): the job's ranks on the
    # workers left resume from the last checkpoint; it ends as asked.
    for _ in range(2):
        cluster.spawn('worker', cluster.address, '--no-nanny', '--nthreads',
                      '2', '--resources', 'CPU=1', '--host', '127.0.0.1',
                      '--local-directory', str(tmp_path / 'space'))
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(2)
        pids = client.run(os.getpid)
        job = submit(job_config(data_dir, workers=2, epochs=12), gpus=0,
                     client=client, path=tmp_path / 'jobs')
        wait_until(lambda: len(job.log_rows()) >= 1, 120, 'the first epoch')
        # The worker of rank 1, not the one driving the ranks.
        other = next(a for a in pids if a != job.status()['worker'])
        os.kill(pids[other], signal.SIGKILL)
    result = job.result(timeout=240)
    assert [row['epoch'] for row in result['log']] == list(range(1, 13))
    assert job.status()['state'] == 'finished'
    assert f'worker(s) {other} lost: going on from the last checkpoint ' \
        'with 1 rank(s)' in job.logs()


def test_a_job_across_workers_holds_its_gpus_on_every_rank(cluster,
                                                          data_dir,
                                                          tmp_path):
    def _rank_restrictions(dask_scheduler):  # local: sent by value
        return {str(k): dict(ts.resource_restrictions or {})
                for k, ts in dask_scheduler.tasks.items()
                if str(k).startswith('dasktrain-') and '-rank' in str(k)}

    # `submit --gpus 2 -- --workers 2`: 2 x 2 GPUs, one value from submit
    # to every rank (the ranks train on the CPU here: devices say so).
    for ids in ('GPU-a,GPU-b', 'GPU-c,GPU-d'):
        cluster.worker(gpus=2, nthreads=3, visible=ids)
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(2)
        with pytest.raises(JobError, match=r'gpus_per_worker 1 contradicts '
                           r'gpus 2'):
            submit(job_config(data_dir, workers=2, gpus_per_worker=1),
                   gpus=2, client=client, path=tmp_path / 'jobs')
        seen = {}
        for gpus in (2, 0):
            # A short collective timeout: a rank whose peer was cancelled
            # first ends soon, unlinking what it made.
            job = submit(job_config(data_dir, workers=2, epochs=30,
                                    collective_timeout=10.0),
                         gpus=gpus, client=client, path=tmp_path / 'jobs')
            assert job.spec().config['gpus_per_worker'] == gpus

            def ranks(gpus=gpus):
                seen[gpus] = client.run_on_scheduler(_rank_restrictions)
                return len(seen[gpus]) == 2
            wait_until(ranks, 120, 'both ranks')
            job.cancel(client)
            wait_until(lambda job=job: job.status()['state'] == 'cancelled',
                       60, 'the cancel')
            wait_until(lambda: not client.run_on_scheduler(
                _rank_restrictions), 120, 'the ranks to go')
    assert list(seen[2].values()) == [{'GPU': 2}] * 2
    assert list(seen[0].values()) == [{}] * 2  # no GPU, no CPU slot here


@pytest.mark.equivalence
@pytest.mark.processes
def test_a_killed_worker_resumes_the_job_from_its_checkpoint(
        cluster, data_dir, tmp_path, capsys, float64):
    config = job_config(data_dir, epochs=6, train_size=500)
    worker = cluster.worker(gpus=1)
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        job = submit(config, gpus=1, client=client, path=tmp_path / 'jobs')
    wait_until(lambda: len(job.log_rows()) >= 1, 120, 'the first epoch')
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    done_before = len(job.log_rows())
    assert done_before < 6, 'the job ended before the worker was killed'
    # No worker now: the file still says running, the scheduler knows why.
    wait_until(lambda: main(['jobs', '--jobs-dir', str(tmp_path / 'jobs')])
               == 0 and 'no worker fits' in capsys.readouterr().out, 30,
               "the scheduler's view")
    cluster.worker(gpus=1)
    result = job.result(timeout=180)
    epochs = [row['epoch'] for row in result['log']]
    assert epochs == [1, 2, 3, 4, 5, 6]
    status = job.status()
    assert status['attempts'] == 2 and status['state'] == 'finished'
    text = job.logs()
    assert '=== attempt 2 on' in text
    resumed = int(text.split('resuming after epoch ')[1].split()[0])
    assert resumed >= done_before
    # It ends where an uninterrupted run ends: here, in this process, with
    # its thread count (float64: BLAS's other order of sums stays ~1e-15
    # apart; bit-identical holds within one process, see test_training).
    reference = train(config.replace(out=str(tmp_path / 'ref'),
                                     progress=False))
    for ours, theirs in zip(result['log'], reference['log'], strict=True):
        for key in set(ours) - TIME_KEYS:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-9,
                                              abs=1e-12), key


def test_cancel_a_queued_and_a_running_job(cluster, data_dir, tmp_path,
                                           capsys):
    cluster.worker(gpus=1)
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        running = submit(job_config(data_dir, epochs=50, train_size=1000),
                         gpus=1, client=client, path=tmp_path / 'jobs')
        queued = submit(job_config(data_dir), gpus=1, client=client,
                        path=tmp_path / 'jobs')
    wait_until(lambda: running.status()['state'] == 'running', 60, 'start')
    assert queued.status()['state'] == 'queued'
    args = ['--jobs-dir', str(tmp_path / 'jobs')]
    assert main(['cancel', queued.id, *args]) == 0
    assert capsys.readouterr().out == f'{queued.id}: cancelled\n'
    assert queued.status()['state'] == 'cancelled'
    wait_until(lambda: len(running.log_rows()) >= 1, 120, 'an epoch')
    assert main(['cancel', running.id, *args]) == 0
    # The state after the cancel, not the 'running' from before it.
    assert capsys.readouterr().out == f'{running.id}: cancelled\n'
    assert running.status()['state'] == 'cancelled'
    assert running.status()['epoch'] < 50
    time.sleep(1)
    assert queued.status()['state'] == 'cancelled'
    assert not (queued.folder / 'out' / 'log').exists()
    with pytest.raises(JobError, match='cancelled'):
        running.result(timeout=1)


def test_a_failing_job_is_marked_failed_and_others_finish(
        cluster, data_dir, tmp_path, capsys):
    broken = tmp_path / 'broken'
    (broken / 'cifar-10-batches-py').mkdir(parents=True)
    cluster.worker(gpus=2)
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        bad = submit(job_config(broken), gpus=1, client=client,
                     path=tmp_path / 'jobs')
        good = submit(job_config(data_dir), gpus=1, client=client,
                      path=tmp_path / 'jobs')
    assert good.result(timeout=120)['final']['epoch'] == 2
    with pytest.raises(JobError, match='failed: error: missing batch file'):
        bad.result(timeout=60)
    assert bad.status()['attempts'] == 1  # a failure is not retried
    assert main(['logs', bad.id, '--jobs-dir', str(tmp_path / 'jobs')]) == 0
    assert 'missing batch file' in capsys.readouterr().out
    assert main(['jobs', '--jobs-dir', str(tmp_path / 'jobs')]) == 0
    listing = capsys.readouterr().out
    assert f'{bad.id}' in listing and 'failed' in listing
    assert 'finished' in listing and '2/2' in listing
    assert main(['result', good.id, '--jobs-dir',
                 str(tmp_path / 'jobs')]) == 0
    assert 'validation/main/accuracy: ' in capsys.readouterr().out
    # One damaged job folder hides no other and breaks nothing.
    jobs = tmp_path / 'jobs'
    shutil.copytree(good.folder, jobs / 'cut')
    text = (jobs / 'cut' / 'status.json').read_text()
    (jobs / 'cut' / 'status.json').write_text(text[:len(text) // 2])
    shutil.copytree(good.folder, jobs / 'blank')
    (jobs / 'blank' / 'job.json').write_text('{}')
    assert main(['jobs', '--jobs-dir', str(jobs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    states = {line.split()[0]: line.split()[3] for line in lines[1:]
              if not line.startswith('unreadable:')}
    assert states == {bad.id: 'failed', good.id: 'finished',
                      'cut': 'unreadable', 'blank': 'unreadable'}
    assert 'unreadable: job cut: status.json is not valid JSON' in \
        '\n'.join(lines)
    assert 'unreadable: job blank: job.json lacks submitted, gpus, config' \
        in lines
    for command, job_id, reason in [
            ('result', 'cut', 'status.json is not valid JSON'),
            ('logs', 'blank', 'job.json lacks submitted'),
            ('cancel', 'blank', 'job.json lacks submitted')]:
        assert main([command, job_id, '--jobs-dir', str(jobs)]) == 1
        err = capsys.readouterr().err
        assert err.count('\n') == 1 and reason in err, err


def test_submit_time_errors(cluster, data_dir, tmp_path, monkeypatch,
                            capsys):
    cluster.worker(gpus=2)
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
        with pytest.raises(JobError, match='no worker has 3 GPU'):
            submit(job_config(data_dir), gpus=3, client=client,
                   path=tmp_path / 'jobs')
    began = time.monotonic()
    assert main(['submit', '--scheduler', 'tcp://127.0.0.1:9', '--', '--model',
                 'tiny']) == 1
    assert 'cannot reach the scheduler at tcp://127.0.0.1:9' in \
        capsys.readouterr().err
    assert time.monotonic() - began < 30
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path / 'nohome'))
    assert main(['submit', '--', '--model', 'tiny']) == 1
    assert 'no cluster is recorded' in capsys.readouterr().err
    assert main(['submit', '--scheduler', cluster.address, '--',
                 '--batch-size', '0']) == 2
    assert capsys.readouterr().err.splitlines() == [
        'usage: dasktrain submit -- [options]',
        'dasktrain submit --: error: --batch-size must be an int >= 1, got 0',
        'see `dasktrain train --help`']
    # `cluster status` takes the --scheduler its error message suggests.
    assert main(['cluster', 'status', '--scheduler', cluster.address]) == 0
    assert 'GPU=2, 2 threads' in capsys.readouterr().out
    assert not (tmp_path / 'jobs').exists() or \
        not any((tmp_path / 'jobs').iterdir())


def test_the_refusal_of_a_job_that_fits_no_worker_counts_in_words():
    from dasktrain.jobs.fits import check_fits

    def refusal(resources, gpus, workers=None):
        with pytest.raises(JobError) as e:
            check_fits(resources, workers, gpus)
        return str(e.value)
    said = refusal({'w': {'CPU': 1}}, 2)
    assert said.startswith('no worker has 2 GPUs (largest: 0 among 1 '
                           'worker); pass gpus 0 to take the CPU slot the '
                           'workers offer, or add a worker with '), said
    said = refusal({'a': {'GPU': 1, 'CPU': 1}, 'b': {'CPU': 2}}, 3)
    assert said.startswith('no worker has 3 GPUs (largest: 1 among 2 '
                           'workers); pass gpus 0 to take one of the 3 CPU '
                           'slots'), said
    assert refusal({'a': {'GPU': 2}}, 1, workers=2).startswith(
        'workers 2 needs as many Dask workers with 1 GPU; the cluster has 1')


def test_workers_whose_gpus_cupy_cannot_use_take_no_training_job():
    from dasktrain.jobs.fits import check_fits
    line = ("nvidia-smi sees 2 GPUs, but CuPy cannot use them (No module "
            "named 'cupy'): install CuPy with its CUDA libraries")
    # `cluster start` offers such GPUs to no one; a worker given them by
    # hand (a) keeps them for programs, not for training
    resources = {'a': {'GPU': 2, 'CPU': 1}, 'b': {'CPU': 1}}
    unusable = {'a': line, 'b': None}

    def refusal(resources, gpus, workers=None, needs_cupy=True):
        with pytest.raises(JobError) as e:
            check_fits(resources, workers, gpus, unusable, needs_cupy)
        return str(e.value)
    check_fits(resources, None, 1, unusable, needs_cupy=False)  # a program
    check_fits(resources, None, 0, unusable, needs_cupy=False)  # CPU slot
    assert refusal(resources, 1) == (
        'a training job needs CuPy on its GPUs, and no worker with 1 GPU '
        f'has it: worker a: {line}, then start its cluster again')
    check_fits({**resources, 'c': {'GPU': 1}}, None, 1, unusable, True)
    # none fits: the usual refusal, and why those GPUs go unused
    assert refusal(resources, 3, needs_cupy=False) == (
        'no worker has 3 GPUs (largest: 2 among 2 workers); pass gpus 0 to '
        'take one of the 2 CPU slots the workers offer, or add a worker '
        'with `dask worker ADDRESS --resources GPU=3`; worker a: '
        f'{line}, then start its cluster again')
    # a job across workers counts those where CuPy works
    both = {'a': {'GPU': 1}, 'c': {'GPU': 1}}
    check_fits(both, 2, 1, unusable, needs_cupy=False)
    assert refusal(both, 1, workers=2) == (
        'workers 2 needs as many Dask workers with 1 GPU; the cluster has 1; '
        f'add workers or lower it; worker a: {line}, then start its '
        'cluster again')


def test_without_gpus_submit_says_that_gpus_0_takes_a_cpu_slot(
        cluster, tmp_path, capsys):
    cluster.worker(gpus=0, resources='CPU=2')
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
    assert main(['submit', '--scheduler', cluster.address, '--jobs-dir',
                 str(tmp_path / 'jobs'), '--', '--model', 'tiny']) == 1
    err = capsys.readouterr().err
    assert err.startswith('dasktrain submit: error: no worker has 1 GPU ')
    assert 'pass --gpus 0 to take one of the 2 CPU slots' in err
    assert main(['submit', '--help']) == 0
    assert '0 takes one CPU slot' in ' '.join(capsys.readouterr().out.split())


def test_submit_command_prints_an_id_at_once(cluster, data_dir, tmp_path,
                                             capsys, monkeypatch):
    cluster.worker(gpus=1)
    with Client(cluster.address, set_as_default=False) as client:
        client.wait_for_workers(1)
    # Relative paths mean the submitter's directory, not the worker's.
    monkeypatch.chdir(data_dir.parent)
    assert main(['submit', '--scheduler', cluster.address, '--gpus', '1',
                 '--name', 'sweep', '--jobs-dir', str(tmp_path / 'jobs'),
                 '--', '--model', 'tiny', '--epochs', '1', '--devices', 'cpu',
                 '--data-dir', data_dir.name, '--train-size', '200']) == 0
    job_id = capsys.readouterr().out.strip()
    assert job_id.startswith('sweep-')
    job = Job.find(job_id, tmp_path / 'jobs')
    assert job.spec().config['data_dir'] == str(data_dir)
    assert job.result(timeout=120)['final']['epoch'] == 1
    assert list((tmp_path / 'worker-cwd').iterdir()) == []
    assert main(['logs', job_id, '--follow', '--jobs-dir',
                 str(tmp_path / 'jobs')]) == 0
    said = capsys.readouterr().out
    assert 'done: epoch 1' in said
    # its curves, as a local run draws them
    curves = Path(job.spec().config['out']) / 'curves.png'
    assert f'curves: {curves}' in said
    assert curves.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_logs_of_a_job_killed_mid_line_end_with_a_newline(tmp_path,
                                                          capsys):
    folder = tmp_path / 'jobs' / 'cut-1'
    folder.mkdir(parents=True)
    (folder / 'job.json').write_text(json.dumps(
        {'version': 1, 'submitted': 1.0, 'gpus': 0, 'command': ['true']}))
    (folder / 'status.json').write_text(json.dumps(
        {'state': 'failed', 'attempts': 1, 'error': 'killed'}))
    (folder / 'output.log').write_bytes(b'epoch 1\nepoch 2 [####  ]\r')
    assert main(['logs', 'cut-1', '--jobs-dir', str(tmp_path / 'jobs')]) == 0
    assert capsys.readouterr().out == 'epoch 1\nepoch 2 [####  ]\r\n'
    # --raw: the bytes as written, nothing added
    assert main(['logs', 'cut-1', '--raw', '--jobs-dir',
                 str(tmp_path / 'jobs')]) == 0
    assert capsys.readouterr().out == 'epoch 1\nepoch 2 [####  ]\r'
    (folder / 'output.log').write_bytes(b'done\n')
    assert main(['logs', 'cut-1', '--jobs-dir', str(tmp_path / 'jobs')]) == 0
    assert capsys.readouterr().out == 'done\n'


@pytest.mark.parametrize('purged_at', [1, 2])
def test_a_job_purged_while_the_jobs_are_listed_is_left_out(
        tmp_path, monkeypatch, purged_at):
    # The queue purges ended jobs while `jobs`, the job board and the jobs
    # table read them: a folder gone between its listing (the first read
    # of its job.json, to sort) and its reading (the second) is no longer
    # a job, neither an error nor a damaged row.
    for when, name in enumerate(('a', 'b', 'c'), start=1):
        folder = tmp_path / name
        folder.mkdir()
        (folder / 'job.json').write_text('{}')  # unreadable: by its time
        (folder / 'status.json').write_text('{}')
        os.utime(folder, (when, when))
    spec, calls = Job.spec, []

    def purged_meanwhile(job):
        calls.append(job.id)
        if job.id == 'b' and calls.count('b') == purged_at:
            shutil.rmtree(job.folder)
        return spec(job)
    monkeypatch.setattr(Job, 'spec', purged_meanwhile)
    if purged_at == 1:
        assert [job.id for job in list_jobs(tmp_path)] == ['a', 'c']
        return
    assert [s['id'] for s in JobBoard(tmp_path).summaries()] == ['a', 'c']
    (tmp_path / 'b').mkdir()
    (tmp_path / 'b' / 'status.json').write_text('{}')
    calls.clear()
    rows, unreadable = job_rows(tmp_path)
    assert [i for i, _ in unreadable] == ['a', 'c']
