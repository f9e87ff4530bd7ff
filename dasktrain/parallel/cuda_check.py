"""The GPUs this machine has, and whether CuPy can use them here.

A machine can have GPUs that CuPy cannot use: no CuPy, or a CUDA library
it needs missing (a server with only the NVIDIA driver, and CuPy without
its ``[ctk]`` wheels). :func:`gpu_count` says how many GPUs CuPy can
train on and, where none, why, in CuPy's and Chainer's words;
``nvidia-smi -L`` (:func:`nvidia_smi_lines`), which needs only the
driver, is what tells such a machine from one without GPUs. Where both
disagree, :func:`unusable_gpus_here` says so in one line with what to
install, and :func:`check_gpus_usable` refuses a run that would train on
the CPU instead without asking for it. The decisions are pure
(:func:`~dasktrain.parallel.gpus.unusable_gpus`,
:func:`~dasktrain.parallel.gpus.gpu_refusal`).

Chainer and CuPy are imported on the first question to CuPy, never at
import: a worker or ``cluster start`` on a machine without ``nvidia-smi``
asks :func:`unusable_gpus_here` for nothing more than a ``PATH`` lookup.
"""
import os
import shutil
import subprocess

from dasktrain.parallel.gpus import (
    VISIBLE,
    GpusUnusable,
    gpu_ids,
    gpu_refusal,
    listed_gpus,
    unusable_gpus,
)


def cuda_unavailable_reason():
    """Why Chainer cannot use CuPy, in Chainer's own words, or None.

    Chainer keeps the error of its ``import cupy`` (a missing libcublas, a
    CuPy built for another CUDA, no CuPy at all) and shows it in
    ``check_cuda_available``; that, not a guess, is what a user needs.
    """
    import chainer
    try:
        chainer.backends.cuda.check_cuda_available()
    except RuntimeError as e:
        # After Chainer's fixed 'not correctly set up (see ...#installation).'
        # comes the error itself.
        return str(e).split('#installation).', 1)[-1].strip() or str(e)
    return None


def gpu_count():
    """(number of GPUs CuPy can train on in this process, reason when 0 or
    None): those CUDA shows it, where CuPy also loads the CUDA libraries
    a training step needs (:func:`cuda_library_problem`)."""
    reason = cuda_unavailable_reason()
    if reason is not None:
        return 0, reason
    import cupy
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        return 0, f'CUDA finds no device: {e}'
    reason = cuda_library_problem(cupy) if count else None
    return (0, reason) if reason else (count, None)


def cuda_library_problem(cupy):
    """Why ``cupy`` cannot load a CUDA library every training step needs,
    or None.

    Chainer's ``import cupy`` already loaded CuPy and cuBLAS (it imports
    ``cupy.cuda.cublas``; its error is :func:`cuda_unavailable_reason`).
    CuPy 14 loads its other libraries on first use, where a missing one
    fails that call, mid-run: cuRAND (``cupy.random``: dropout, random
    initialisers) and NVRTC (every kernel CuPy compiles: each elementwise
    operation). Loaded here, through CuPy's own lazy attributes, once;
    CuPy 13 loads NVRTC at import and cuRAND on ``cupy.cuda.curand``.
    """
    try:
        cupy.cuda.curand  # noqa: B018 (its load is the check)
    except ImportError as e:
        return f'CuPy cannot load cuRAND: {e}'
    try:
        cupy.cuda.nvrtc.getVersion()
    except Exception as e:  # pathfinder's DynamicLibNotFoundError, OSError
        return f'CuPy cannot load NVRTC: {e}'
    return None


def nvidia_smi_lines():
    """``nvidia-smi -L`` output lines, or [] without the tool or a driver."""
    if shutil.which('nvidia-smi') is None:
        return []
    try:
        out = subprocess.run(['nvidia-smi', '-L'], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.splitlines() if out.returncode == 0 else []


def unusable_gpus_here():
    """One line where this machine has GPUs that CuPy cannot use in this
    process, saying why and what to install; else None (no GPU listed,
    CuPy can use them, or ``CUDA_VISIBLE_DEVICES`` hides them on purpose).
    Asks ``nvidia-smi`` first: CuPy only where it lists GPUs."""
    lines = nvidia_smi_lines()
    if not listed_gpus(lines):
        return None
    count, reason = gpu_count()
    return unusable_gpus(lines, count, reason, os.environ.get(VISIBLE))


def check_gpus_usable(devices=None):
    """Refuse (:class:`~dasktrain.parallel.gpus.GpusUnusable`, one line)
    a run on ``devices`` (None: the default, every GPU) where this machine
    has GPUs that CuPy cannot use, unless the CPU alone was asked for
    (:func:`~dasktrain.parallel.gpus.gpu_refusal`): a GPU server must not
    train for hours on its CPU because a CUDA library is missing."""
    if devices and not gpu_ids(devices):
        return  # the CPU asked for: nothing to ask CUDA
    count, reason = gpu_count()
    if count:
        return
    line = gpu_refusal(nvidia_smi_lines(), count, reason, devices,
                       os.environ.get(VISIBLE))
    if line:
        raise GpusUnusable(line)
