"""Which CuPy extra of dasktrain fits this machine's NVIDIA driver.

``make install`` (and so ``make train`` and ``make test``) runs this file
with the Python that builds the virtual environment, before dasktrain is
installed: it uses the standard library only. It prints the extra to
install, ``cuda12``, ``cuda13`` or ``none``; with ``--explain``, a sentence
saying why and how to choose another.

    python -I tools/cuda_extra.py auto     # what `make install` does
    python -I tools/cuda_extra.py 12       # CUDA=12 on make's line

The driver's CUDA version is the one ``nvidia-smi`` prints in its header
("CUDA Version: 12.4"): the newest CUDA the driver runs. A driver runs
programs built for its own CUDA major version and older, so CUDA 12.x gets
CuPy for CUDA 12 (``cupy-cuda12x``) and 13 or newer gets CuPy for CUDA 13
(``cupy-cuda13x``, which needs NumPy 2).
"""
import re
import shutil
import subprocess
import sys

CHOICES = ('auto', 'none', '12', '13')
OVERRIDE = 'override: make install CUDA=none|12|13'


def cuda_version(smi_output):
    """``'12.4'`` from ``nvidia-smi``'s output, or None if it names none.

    >>> cuda_version('| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   '
    ...              'CUDA Version: 12.4  |')
    '12.4'
    """
    found = re.search(r'CUDA Version\s*:\s*(\d+)\.(\d+)', smi_output or '')
    return f'{found.group(1)}.{found.group(2)}' if found else None


def extra_for_cuda(version):
    """The extra for a driver's CUDA version: ``'cuda12'``, ``'cuda13'``,
    or None for a driver older than CUDA 12 (no CuPy extra fits it).

    >>> extra_for_cuda('12.8'), extra_for_cuda('13.0'), extra_for_cuda('11.4')
    ('cuda12', 'cuda13', None)
    """
    major = int(version.split('.')[0])
    if major >= 13:
        return 'cuda13'
    return 'cuda12' if major == 12 else None


def run_nvidia_smi(timeout=20):
    """``(output, problem)``: nvidia-smi's output, or why there is none."""
    if shutil.which('nvidia-smi') is None:
        return None, 'no nvidia-smi on PATH (no NVIDIA driver)'
    try:
        done = subprocess.run(['nvidia-smi'], capture_output=True, text=True,
                              timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f'nvidia-smi did not run ({e})'
    if done.returncode != 0:
        said = (done.stdout + done.stderr).strip().splitlines()
        return None, (f'nvidia-smi failed: {said[0]}' if said else
                      f'nvidia-smi exited with code {done.returncode}')
    return done.stdout, None


def choose(setting='auto', smi=run_nvidia_smi):
    """``(extra, sentence)`` for a ``CUDA=`` setting: ``extra`` is
    ``'cuda12'``, ``'cuda13'`` or ``'none'``; ``smi`` is only called for
    ``'auto'``.

    Raises
    ------
    ValueError
        ``setting`` is not one of auto, none, 12, 13.
    """
    setting = str(setting).lower().removeprefix('cuda')
    if setting not in CHOICES:
        raise ValueError(f"CUDA must be one of {', '.join(CHOICES)}, got "
                         f'{setting!r}')
    if setting == 'none':
        return 'none', 'CUDA=none: no CuPy, training runs on the CPU'
    if setting != 'auto':
        extra = f'cuda{setting}'
        return extra, (f'CUDA={setting}: installing the {extra} extra '
                       f'(CuPy for CUDA {setting})')
    output, problem = smi()
    if output is None:
        return 'none', (f'{problem}: no CuPy, training runs on the CPU '
                        f'({OVERRIDE})')
    version = cuda_version(output)
    if version is None:
        return 'none', ('nvidia-smi names no CUDA version: no CuPy, '
                        f'training runs on the CPU ({OVERRIDE})')
    extra = extra_for_cuda(version)
    if extra is None:
        return 'none', (f'the NVIDIA driver runs CUDA {version}, older than '
                        'the CUDA 12 that CuPy needs here: no CuPy, training '
                        f'runs on the CPU; update the driver ({OVERRIDE})')
    return extra, (f'NVIDIA driver for CUDA {version} found: installing the '
                   f'{extra} extra (CuPy for CUDA {extra[4:]}; {OVERRIDE})')


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    explain = '--explain' in argv
    argv = [a for a in argv if a != '--explain']
    try:
        extra, sentence = choose(*argv[:1])
    except ValueError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    print(sentence if explain else extra)
    return 0


if __name__ == '__main__':
    sys.exit(main())
