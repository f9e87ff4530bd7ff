"""Which GPU extras of dasktrain fit this machine's NVIDIA driver.

``make install`` (and so ``make train`` and ``make test``) and ``make
install-shared`` run this file with the Python that builds the virtual
environment, before dasktrain is installed: it uses the standard library
only. It prints the extras to install, comma-separated (``cuda13,cudnn13``),
or ``none``; with ``--explain``, a sentence saying why and how to choose
another.

    python -I tools/cuda_extra.py auto                 # `make install`
    python -I tools/cuda_extra.py 12                   # CUDA=12
    python -I tools/cuda_extra.py --numpy 1 auto       # NUMPY=1
    python -I tools/cuda_extra.py --cudnn off auto     # CUDNN=off

The decision, :func:`extras_for`, is a pure function of three things:

* The driver's CUDA version, the one ``nvidia-smi`` prints in its header
  ("CUDA Version: 12.4"): the newest CUDA the driver runs. A driver runs
  programs built for its own CUDA major version and older, and within a
  major any minor (CUDA's minor version compatibility; CuPy compiles its
  kernels to the GPU's own code, not PTX, so a newer NVRTC runs on an
  older driver of the same major). So CUDA 12.x gets CuPy for CUDA 12,
  13 or newer CuPy for CUDA 13, older than 12 nothing (no CuPy of today
  supports it).
* The NumPy major the environment will have. It is not found, it is
  chosen: dasktrain needs Python >= 3.10 and ``numpy>=1.26``, NumPy 2 has
  wheels for every such Python, and pip installs the newest NumPy a
  requirement allows, so an install gets NumPy 2 unless something pins it
  (and ``make`` sets ``PIP_CONSTRAINT`` to constraints.txt, so no pin of
  the user's environment reaches it). ``NUMPY=1`` on make's line is that
  pin. CuPy 14 needs NumPy >= 2 (its ``Requires-Dist: numpy<2.6,>=2.0``);
  CuPy 13.6 takes NumPy 1.22 to 2.5.
* Whether cuDNN is wanted (``CUDNN=off`` on make's line: not).

What each extra brings (pyproject.toml; the tests read both):

=================  =======================================================
``cuda12``         ``cupy-cuda12x[ctk]`` 14 (CuPy with the CUDA 12
                   libraries as wheels: ``cuda-toolkit[cublas,cudart,
                   cufft,curand,cusolver,cusparse,nvrtc]==12.*``) and
                   ``nvidia-nccl-cu12``; needs NumPy 2. Only the NVIDIA
                   driver is needed on the machine.
``cuda13``         the same for CUDA 13 (``cupy-cuda13x[ctk]``,
                   ``nvidia-nccl-cu13``).
``cuda12-numpy1``  NumPy 1.26 and CuPy 13.6 for CUDA 12, with NCCL. CuPy
                   13 has no ``[ctk]`` extra and loads the CUDA libraries
                   (``libcublas.so.12``, ``libnvrtc.so.12``, ...) from the
                   system's library path only: a CUDA 12 toolkit must be
                   installed.
``cuda13-numpy1``  the same for CUDA 13 (``cupy-cuda13x`` 13.6).
``cudnn12``        cuDNN 9 (``nvidia-cudnn-cu12``) and its Python graph
                   API ``nvidia-cudnn-frontend`` 1.23.x, which dasktrain's
                   cuDNN functions are written against.
``cudnn13``        the same for CUDA 13 (``nvidia-cudnn-cu13``).
``numpy1``         NumPy 1.26 alone (NUMPY=1 without a GPU).
=================  =======================================================
"""
import re
import shutil
import subprocess
import sys

CHOICES = ('auto', 'none', '12', '13')
NUMPY_CHOICES = ('1', '2')
CUDNN_CHOICES = ('on', 'off')
#: NumPy 1.26, the last NumPy 1, has wheels up to this Python
NUMPY1_LAST_PYTHON = (3, 12)
OVERRIDE = 'override: make install CUDA=none|12|13 NUMPY=1|2 CUDNN=on|off'


def cuda_version(smi_output):
    """``'12.4'`` from ``nvidia-smi``'s output, or None if it names none.

    >>> cuda_version('| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   '
    ...              'CUDA Version: 12.4  |')
    '12.4'
    """
    found = re.search(r'CUDA Version\s*:\s*(\d+)\.(\d+)', smi_output or '')
    return f'{found.group(1)}.{found.group(2)}' if found else None


def cupy_cuda_major(version):
    """The CUDA major of the CuPy wheel a driver of CUDA ``version`` runs:
    12 or 13, or None for a driver older than CUDA 12.

    >>> cupy_cuda_major('12.8'), cupy_cuda_major('13.0'), \\
    ...     cupy_cuda_major('14.1'), cupy_cuda_major('11.4')
    (12, 13, 13, None)
    """
    major = int(str(version).split('.')[0])
    if major >= 13:
        return 13
    return 12 if major == 12 else None


def extras_for(cuda_major, numpy_major=2, cudnn=True,
               python=sys.version_info[:2]):
    """The extras of dasktrain to install, as a tuple of names.

    Parameters
    ----------
    cuda_major : int or None
        The CuPy wheel's CUDA major (:func:`cupy_cuda_major`): 12, 13, or
        None for no CuPy (no driver, or one too old).
    numpy_major : int, default 2
        The NumPy the environment gets: 2 (CuPy 14, its CUDA libraries
        from wheels) or 1 (CuPy 13.6, the CUDA libraries from the system).
    cudnn : bool, default True
        cuDNN 9 and its frontend with the CUDA extra.
    python : tuple, default this interpreter's
        ``(major, minor)`` of the Python the environment is made from.

    Raises
    ------
    ValueError
        ``numpy_major`` 1 for a Python NumPy 1 has no wheels for, or an
        argument out of range.

    Examples
    --------
    >>> extras_for(13), extras_for(12, cudnn=False), extras_for(None)
    (('cuda13', 'cudnn13'), ('cuda12',), ())
    >>> extras_for(12, numpy_major=1, python=(3, 11))
    ('cuda12-numpy1', 'cudnn12')
    >>> extras_for(None, numpy_major=1, python=(3, 12))
    ('numpy1',)
    """
    if cuda_major not in (None, 12, 13):
        raise ValueError(f'cuda_major must be 12, 13 or None, got '
                         f'{cuda_major!r}')
    if numpy_major not in (1, 2):
        raise ValueError(f'NUMPY must be 1 or 2, got {numpy_major!r}')
    if numpy_major == 1 and tuple(python) > NUMPY1_LAST_PYTHON:
        raise ValueError(
            'NUMPY=1: NumPy 1.26, the last NumPy 1, has no wheels for Python '
            f'{python[0]}.{python[1]} (up to '
            f'{".".join(map(str, NUMPY1_LAST_PYTHON))}); use NUMPY=2 or '
            'PYTHON=python3.12')
    if cuda_major is None:
        return ('numpy1',) if numpy_major == 1 else ()
    cuda = f'cuda{cuda_major}' + ('-numpy1' if numpy_major == 1 else '')
    return (cuda, f'cudnn{cuda_major}') if cudnn else (cuda,)


def describe(extras):
    """What ``extras`` bring, in words.

    >>> describe(('cuda13', 'cudnn13'))
    'CuPy 14 for CUDA 13 with its CUDA libraries and NCCL from wheels, cuDNN 9'
    >>> describe(('cuda12-numpy1',))
    'NumPy 1.26, CuPy 13.6 for CUDA 12 (CUDA 12 toolkit needed) and NCCL'
    >>> describe(())
    'no CuPy, training runs on the CPU'
    """
    words = []
    for extra in extras:
        found = re.fullmatch(r'cuda(\d+)(-numpy1)?', extra)
        if found and found.group(2):
            words.append(f'NumPy 1.26, CuPy 13.6 for CUDA {found.group(1)} '
                         f'(CUDA {found.group(1)} toolkit needed) and NCCL')
        elif found:
            words.append(f'CuPy 14 for CUDA {found.group(1)} with its CUDA '
                         'libraries and NCCL from wheels')
        elif extra.startswith('cudnn'):
            words.append('cuDNN 9')
        elif extra == 'numpy1':
            words.append('NumPy 1.26')
    if not any(e.startswith('cuda') for e in extras):
        words.append('no CuPy, training runs on the CPU')
    return ', '.join(words)


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


def _setting(name, value, choices):
    value = str(value).lower()
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got "
                         f'{value!r}')
    return value


def choose(setting='auto', smi=run_nvidia_smi, numpy='2', cudnn='on',
           python=sys.version_info[:2]):
    """``(extras, sentence)`` for make's ``CUDA=``, ``NUMPY=`` and
    ``CUDNN=`` settings: ``extras`` a tuple of names (empty: none);
    ``smi`` is only called for ``CUDA=auto``.

    Raises
    ------
    ValueError
        A setting out of its choices, or NUMPY=1 where it cannot install.
    """
    setting = _setting('CUDA', str(setting).lower().removeprefix('cuda'),
                       CHOICES)
    numpy = int(_setting('NUMPY', numpy, NUMPY_CHOICES))
    with_cudnn = _setting('CUDNN', cudnn, CUDNN_CHOICES) == 'on'

    def chosen(major, why):
        extras = extras_for(major, numpy, with_cudnn, python)
        return extras, f'{why}: {describe(extras)} ({OVERRIDE})'
    if setting == 'none':
        return chosen(None, 'CUDA=none')
    if setting != 'auto':
        return chosen(int(setting), f'CUDA={setting}')
    output, problem = smi()
    if output is None:
        return chosen(None, problem)
    version = cuda_version(output)
    if version is None:
        return chosen(None, 'nvidia-smi names no CUDA version')
    major = cupy_cuda_major(version)
    if major is None:
        return chosen(None, f'the NVIDIA driver runs CUDA {version}, older '
                            'than the CUDA 12 CuPy needs; update the driver')
    return chosen(major, f'NVIDIA driver for CUDA {version} found')


def main(argv=None):
    """``[--explain] [--numpy 1|2] [--cudnn on|off] [CUDA]``: print the
    extras (``none`` for none) or, with ``--explain``, why."""
    import argparse
    parser = argparse.ArgumentParser(prog='cuda_extra.py')
    parser.add_argument('--explain', action='store_true')
    parser.add_argument('--numpy', default='2')
    parser.add_argument('--cudnn', default='on')
    parser.add_argument('cuda', nargs='?', default='auto')
    args = parser.parse_args(argv)
    try:
        extras, sentence = choose(args.cuda, numpy=args.numpy,
                                  cudnn=args.cudnn)
    except ValueError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    print(sentence if args.explain else ','.join(extras) or 'none')
    return 0


if __name__ == '__main__':
    sys.exit(main())
