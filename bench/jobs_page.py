"""README's screenshot of the jobs page: `python bench/jobs_page.py`.

Starts a real cluster (a home of its own, free ports, two CPU slots),
submits real jobs on synthetic CIFAR-format images, one after another so
that the page shows a finished, a failed, two running and a queued one, and
once the first long job has trained 10 epochs, loads ``/dasktrain/jobs`` in
a headless Chromium and saves what it draws (about 5 minutes on 2 cores).
Needs ``chromium`` (Debian: apt-get install chromium).
"""
import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from dasktrain.bench import synthetic_cifar10
from dasktrain.config import TrainConfig


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', type=Path,
                        default=Path('docs/figures/jobs_page.png'))
    args = parser.parse_args(argv)
    browser = shutil.which('chromium')
    if browser is None:
        parser.error('needs chromium on PATH (apt-get install chromium)')
    work = Path(tempfile.mkdtemp(prefix='dasktrain-jobs-page-'))
    os.environ['DASKTRAIN_HOME'] = str(work / 'home')
    from dasktrain.cluster import connect, start_cluster, stop_cluster
    from dasktrain.jobs.client.submit import submit
    synthetic_cifar10(work / 'data', n_train=2000, n_test=500)
    base = TrainConfig(model='tiny', batch_size=50, devices=('@numpy',),
                       data_dir=str(work / 'data'), lr=0.005)
    state = start_cluster(port=0, dashboard_port=0, gpus=0, cpu_slots=2)
    try:
        with connect() as client:
            def job(name, **kw):
                return submit(base.replace(**kw), gpus=0, name=name,
                              client=client)

            def wait(until):
                while not until():
                    time.sleep(1)
            # Submitted in steps, so that the picture has every state.
            first = job('tiny-lr0.005', epochs=8)
            failing = job('typo-in-data-dir', epochs=5,
                          data_dir=str(work / 'none'),
                          url='http://127.0.0.1:9/cifar-10-python.tar.gz')
            wait(lambda: failing.status()['state'] == 'failed')
            long = job('tiny-lr0.003', epochs=30, lr=0.003)
            wait(lambda: first.status()['state'] == 'finished')
            job('tiny-lr0.008', epochs=30, lr=0.008)
            job('tiny-lr0.002', epochs=30, lr=0.002)  # waits for a slot
            wait(lambda: len(long.log_rows()) >= 10)
        page = state['dashboard'].rsplit('/', 1)[0] + '/dasktrain/jobs'
        args.out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([browser, '--headless', '--no-sandbox',
                        '--disable-gpu', '--hide-scrollbars',
                        '--window-size=1400,900',
                        f'--user-data-dir={work / "profile"}',
                        '--virtual-time-budget=5000',
                        f'--screenshot={args.out.resolve()}', page],
                       check=True, capture_output=True, timeout=120)
        print(f'wrote {args.out}')
    finally:
        stop_cluster()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
    main()
