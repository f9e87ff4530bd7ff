"""The first thing to run on a GPU machine (`make gpu-check`): the GPU
suite, then bench/gpu.py and bench/gpu_vs_torch.py (one GPU side by side
with PyTorch; skipped, saying so, without PyTorch), then CuPy with the
system's CUDA toolkit hidden (what a server with only the NVIDIA driver
has), written to one Markdown report headed by the machine (GPUs, driver,
CUDA, CuPy, NCCL, cuDNN, Chainer, NumPy, Python).

Needs no network. Each part runs as a process of its own under a
deadline (``--suite-timeout``, ``--bench-timeout``: seconds), so a hung
test or collective still leaves a report that says where it stopped.
The report is written atomically; the exit status is 0 when every test
that ran passed and the benchmark finished, else 1 (2 without a GPU).
"""
import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def versions():
    """(label, value) pairs describing the machine's GPU software; each
    value says 'none' or why where a part is missing."""
    out = [('Python', platform.python_version())]
    for name in ('numpy', 'chainer', 'cupy', 'dask', 'distributed'):
        try:
            out.append((name, __import__(name).__version__))
        except Exception as e:  # reported, not raised
            out.append((name, f'not importable ({type(e).__name__}: {e})'))
    try:
        import cupy
        rt = cupy.cuda.runtime
        out += [('CUDA runtime', _cuda(rt.runtimeGetVersion())),
                ('CUDA driver', _cuda(rt.driverGetVersion())),
                ('GPUs', ', '.join(
                    rt.getDeviceProperties(i)['name'].decode()
                    for i in range(rt.getDeviceCount())))]
    except Exception as e:
        out.append(('CUDA', f'unusable ({type(e).__name__}: {e})'))
    try:
        from cupy.cuda import nccl
        out.append(('NCCL', _nccl(nccl.get_version()) if nccl.available
                    else 'none (cupy.cuda.nccl.available is False)'))
    except Exception as e:
        out.append(('NCCL', f'none ({type(e).__name__}: {e})'))
    try:
        from cupy.cuda import cudnn
        out.append(("CuPy's cuDNN", str(cudnn.getVersion())))
    except Exception as e:
        out.append(("CuPy's cuDNN", f'none ({type(e).__name__})'))
    try:
        import dasktrain.kernels as kernels
        out.append(("dasktrain's cuDNN graphs", kernels.status()['cudnn']))
    except Exception as e:
        out.append(("dasktrain's cuDNN graphs",
                    f'unusable ({type(e).__name__}: {e})'))
    try:
        import chainer
        out.append(('Chainer uses cuDNN',
                    str(chainer.backends.cuda.cudnn_enabled)))
    except Exception:  # chainer's row says why
        pass
    return out


def _cuda(code):
    return f'{code // 1000}.{code % 1000 // 10}'


def _nccl(code):
    from dasktrain.parallel.gpus import nccl_version
    found = nccl_version(int(code))
    return '.'.join(map(str, found)) if found else str(code)


def nvidia_smi():
    """nvidia-smi's line per GPU, or why there is none."""
    if shutil.which('nvidia-smi') is None:
        return 'nvidia-smi: not on PATH'
    done = subprocess.run(
        ['nvidia-smi', '--query-gpu=index,name,uuid,driver_version,'
         'memory.total,mig.mode.current', '--format=csv'],
        capture_output=True, text=True, timeout=60)
    return (done.stdout or done.stderr).strip()


def run(command, timeout, log, errors=None):
    """Run ``command`` with output to ``log`` (its standard error too,
    unless ``errors`` names a file of its own); (exit status, seconds,
    True if it ran out of time). The process group is killed at the
    deadline: nothing it started outlives the check."""
    began = datetime.datetime.now()
    with open(log, 'w') as out, \
            open(errors or os.devnull, 'w') as err:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out,
                                stderr=err if errors else subprocess.STDOUT,
                                start_new_session=True)
        try:
            code, late = proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            code, late = proc.wait(), True
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return code, (datetime.datetime.now() - began).total_seconds(), late


def suite_rows(junit):
    """(outcome, test, seconds, detail) per test of a JUnit XML file."""
    rows = []
    for case in ET.parse(junit).getroot().iter('testcase'):
        name = f"{case.get('classname', '').split('.')[-1]}::" \
               f"{case.get('name')}"
        outcome, detail = 'passed', ''
        for kind in ('failure', 'error', 'skipped'):
            found = case.find(kind)
            if found is not None:
                outcome = {'failure': 'FAILED', 'error': 'ERROR',
                           'skipped': 'skipped'}[kind]
                detail = (found.get('message') or '').strip()
                if kind != 'skipped':
                    detail = (found.text or detail).strip()
                break
        rows.append((outcome, name, float(case.get('time', 0)), detail))
    return rows


TOOLKITS = ('/usr/local/cuda', '/opt/cuda', '/usr/lib/cuda')


def hidden_toolkit_command(python, toolkits, prefix):
    """The command that runs tools/ctk_check.py in a mount namespace of its
    own where every folder of ``toolkits`` is an empty tmpfs
    (``unshare -m``: root only), every CUDA library required to come from
    ``prefix``.

    >>> hidden_toolkit_command('py', ['/usr/local/cuda'], '/env')[:4]
    ['unshare', '-m', 'sh', '-c']
    """
    mounts = ''.join(f'mount -t tmpfs none {t} && ' for t in toolkits)
    return ['unshare', '-m', 'sh', '-c', f'{mounts}exec "$@"', 'sh',
            python, '-I', str(ROOT / 'tools' / 'ctk_check.py'), '--prefix',
            prefix]


def hidden_toolkit(timeout=180):
    """(sentence, text) of tools/ctk_check.py with the system's CUDA
    toolkit hidden and CUDA_PATH, CUDA_HOME and LD_LIBRARY_PATH unset, or
    why it did not run. The libraries must come from the environment that
    holds CuPy (its site-packages)."""
    if os.geteuid() != 0 or shutil.which('unshare') is None:
        return 'skipped: needs root and unshare (a mount namespace)', ''
    import cupy
    prefix = str(Path(cupy.__file__).resolve().parents[1])
    toolkits = []
    for t in TOOLKITS:
        for path in (t, os.path.realpath(t)):
            if os.path.isdir(path) and path not in toolkits:
                toolkits.append(path)
    env = {k: v for k, v in os.environ.items()
           if k not in ('CUDA_PATH', 'CUDA_HOME', 'LD_LIBRARY_PATH')}
    try:
        done = subprocess.run(
            hidden_toolkit_command(sys.executable, toolkits, prefix),
            capture_output=True, text=True, timeout=timeout, env=env,
            cwd='/')
    except subprocess.TimeoutExpired:
        return f'ran out of time ({timeout} s)', ''
    hidden = ', '.join(toolkits) or 'none found'
    return (f'exit status {done.returncode}; toolkit folders hidden: '
            f'{hidden}; CUDA_PATH, CUDA_HOME, LD_LIBRARY_PATH unset; every '
            f'CUDA library required to come from {prefix}',
            (done.stdout + done.stderr).strip()[-4000:])


BENCHES = (('bench/gpu.py', 'bench_timeout', 'bench_args'),
           ('bench/gpu_vs_torch.py', 'torch_timeout', 'torch_args'))


def report(machine, smi, suite, benches, hidden, args):
    """The report's Markdown text."""
    code, seconds, late, rows, log_tail = suite
    lines = [f'# GPU check, {datetime.date.today().isoformat()}', '',
             '`make gpu-check` (bench/gpu_check.py): the GPU suite, '
             'bench/gpu.py, bench/gpu_vs_torch.py, then CuPy with the CUDA '
             'toolkit hidden.', '', '## The machine', '',
             f'Host: {platform.node()}, {os.cpu_count()} CPUs, '
             f'{platform.platform()}', '', '```', smi, '```', '',
             '| software | version |', '|---|---|']
    lines += [f'| {k} | {v} |' for k, v in machine]
    counts = {}
    for outcome, *_ in rows:
        counts[outcome] = counts.get(outcome, 0) + 1
    status = 'ran out of time' if late else f'exit status {code}'
    lines += ['', '## The GPU suite (tests/gpu)', '',
              f'{seconds:.0f} s, {status}: ' + ', '.join(
                  f'{n} {k}' for k, n in sorted(counts.items())), '',
              '| outcome | test | s | detail |', '|---|---|---:|---|']
    for outcome, name, secs, detail in rows:
        short = detail.splitlines()[-1] if detail else ''
        lines.append(f'| {outcome} | {name} | {secs:.1f} | '
                     f'{short[:200].replace("|", "/")} |')
    failed = [r for r in rows if r[0] in ('FAILED', 'ERROR')]
    for outcome, name, _, detail in failed:
        lines += ['', f'### {outcome}: {name}', '', '```',
                  detail[-args.detail_chars:], '```']
    if late or (code not in (0, 5) and not failed):
        lines += ['', '### The suite\'s last output', '', '```',
                  log_tail, '```']
    for script, (bcode, bsec, blate, btext) in benches:
        bstatus = 'ran out of time' if blate else f'exit status {bcode}'
        lines += ['', f'## {script}', '', f'{bsec:.0f} s, {bstatus}.', '',
                  btext.strip(), '']
    sentence, text = hidden
    lines += ['', '## CuPy with the CUDA toolkit hidden (tools/ctk_check.py)',
              '', f'{sentence}.', '']
    if text:
        lines += ['```text', text, '```']
    lines.append('')
    return '\n'.join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--report', default='docs/gpu-check.md',
                        help='where the report goes (default: %(default)s)')
    parser.add_argument('--suite-timeout', type=float, default=330,
                        help='seconds for the GPU suite (default: '
                             '%(default)s)')
    parser.add_argument('--bench-timeout', type=float, default=150,
                        help='seconds for bench/gpu.py (default: '
                             '%(default)s)')
    parser.add_argument('--torch-timeout', type=float, default=300,
                        help='seconds for bench/gpu_vs_torch.py (default: '
                             '%(default)s)')
    parser.add_argument('--test-timeout', type=int, default=150,
                        help="one test's limit in seconds (default: "
                             '%(default)s)')
    parser.add_argument('--bench-args', default='',
                        help='extra arguments for bench/gpu.py')
    parser.add_argument('--torch-args', default='',
                        help='extra arguments for bench/gpu_vs_torch.py')
    parser.add_argument('--pytest-args', default='',
                        help='extra arguments for pytest (e.g. -k NAME)')
    parser.add_argument('--skip', default='',
                        help='parts to leave out, comma-separated: suite, '
                             'gpu.py, gpu_vs_torch.py, toolkit')
    parser.add_argument('--logs', default=None,
                        help='a folder to keep the whole suite.log and '
                             "the benches' logs in (default: none kept)")
    parser.add_argument('--detail-chars', type=int, default=4000,
                        help='characters of each failure shown')
    args = parser.parse_args(argv)
    for name in ('suite_timeout', 'bench_timeout', 'torch_timeout'):
        if getattr(args, name) <= 0:
            parser.error(f'--{name.replace("_", "-")} must be > 0 seconds, '
                         f'got {getattr(args, name)}')
    skip = set(filter(None, args.skip.split(',')))
    unknown = skip - {'suite', 'gpu.py', 'gpu_vs_torch.py', 'toolkit'}
    if unknown:
        parser.error(f'--skip: unknown parts {sorted(unknown)}')
    machine, smi = versions(), nvidia_smi()
    if not any(k == 'GPUs' and v for k, v in machine):
        print('gpu_check: no GPU here; ' + '; '.join(
            f'{k}: {v}' for k, v in machine if k in ('cupy', 'CUDA')),
            file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix='gpu-check-') as work:
        work = Path(work)
        junit = work / 'suite.xml'
        if 'suite' in skip:
            code, seconds, late = 5, 0.0, False
            (work / 'suite.log').write_text('skipped (--skip suite)')
        else:
            code, seconds, late = run(
                [sys.executable, '-m', 'pytest', 'tests/gpu', '-rA', '-v',
                 '-p', 'no:cacheprovider', f'--timeout={args.test_timeout}',
                 f'--junitxml={junit}', *args.pytest_args.split()],
                args.suite_timeout, work / 'suite.log')
        log = (work / 'suite.log').read_text(errors='replace')
        print(log[-6000:])
        rows = suite_rows(junit) if junit.exists() else []
        suite = (code, seconds, late, rows, log[-args.detail_chars:])
        benches = []
        for script, timeout, extra in BENCHES:
            stem = Path(script).name
            if stem in skip:
                continue
            out, err = work / f'{stem}.md', work / f'{stem}.log'
            bcode, bsec, blate = run(
                [sys.executable, script, *getattr(args, extra).split()],
                getattr(args, timeout), out, err)
            btext = out.read_text(errors='replace')
            if bcode or blate:  # what it said on the way out
                btext += '\n```\n' + err.read_text(
                    errors='replace')[-args.detail_chars:] + '\n```\n'
            print(btext[-6000:])
            benches.append((script, (bcode, bsec, blate, btext)))
        hidden = ('skipped (--skip toolkit)', '') if 'toolkit' in skip \
            else hidden_toolkit()
        print(hidden)
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for f in work.iterdir():
                if f.is_file():
                    shutil.copy(f, Path(args.logs) / f.name)
    text = report(machine, smi, suite, benches, hidden, args)
    target = ROOT / args.report
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix='.gpu-check-')
    with os.fdopen(fd, 'w') as f:
        f.write(text)
    os.replace(tmp, target)
    print(f'report: {target}')
    ok = not late and code in (0, 5) and \
        not any(r[0] in ('FAILED', 'ERROR') for r in rows) and \
        all(not b[1][2] and b[1][0] in (0, 2) for b in benches)
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
