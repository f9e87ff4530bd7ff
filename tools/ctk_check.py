"""Whether this environment's GPU stack runs from its own wheels alone, on
a GPU machine: CuPy with its CUDA libraries (the ``[ctk]`` extra), NCCL
and cuDNN, none of them taken from a system CUDA toolkit.

It makes CuPy use each library once (the runtime, a kernel compiled by
NVRTC, a cuBLAS product, cuRAND numbers, NCCL's version, cuDNN's through
its frontend where installed), asks dasktrain whether it would train on
the GPU, then reads ``/proc/self/maps``: every CUDA library loaded must
lie inside this environment (``sys.prefix``). It prints one line per
library and exits 1 on a missing or foreign one. Run it with the system
toolkit hidden, as docs/gpus.md shows:

    sudo unshare -m sh -c 'for d in /usr/local/cuda*; do
      mount -t tmpfs none "$d"; done
      exec env -u CUDA_PATH -u CUDA_HOME -u LD_LIBRARY_PATH \\
        .venv/bin/python -I tools/ctk_check.py'

The driver's own libraries (``libcuda``, ``libnvidia-*``) come from the
system by design and are not counted. The decisions (:func:`loaded`,
:func:`problems`) are pure; the tests read them with a machine's maps.
"""
import os
import re
import sys

#: the libraries a training step loads, by their file's stem
#: (``libcublasLt.so.13`` is cuBLAS's too)
LIBRARIES = ('cudart', 'nvrtc', 'cublas', 'cublasLt', 'curand', 'nccl',
             'cudnn')


def loaded(maps_text):
    """``{library: sorted paths}`` of the :data:`LIBRARIES` mapped in a
    ``/proc/PID/maps`` text (cuDNN's sub-libraries count as ``cudnn``).

    >>> maps = ('7f1c-7f1d r-xp 0 08:01 42 /venv/lib/python3.12/site-'
    ...         'packages/nvidia/cu13/lib/libcublasLt.so.13\\n'
    ...         '7f1e-7f1f r--p 0 08:01 43 /usr/lib/libcuda.so.1\\n'
    ...         '7f20-7f21 r-xp 0 08:01 44 /venv/lib/python3.12/site-'
    ...         'packages/nvidia/cudnn/lib/libcudnn_graph.so.9\\n')
    >>> sorted(loaded(maps))
    ['cublasLt', 'cudnn']
    """
    found = {}
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith('/'):
            continue
        path = fields[5].strip()
        stem = re.match(r'lib([A-Za-z]+)(?:_\w+)?\.so', os.path.basename(
            path))
        if stem and stem.group(1) in LIBRARIES:
            found.setdefault(stem.group(1), set()).add(path)
    return {name: sorted(paths) for name, paths in found.items()}


def problems(found, prefix, wanted):
    """The lines that fail the check: a library of ``wanted`` not loaded,
    or one loaded from outside ``prefix`` (this environment).

    >>> problems({'cublas': ['/venv/lib/libcublas.so.13'],
    ...           'nvrtc': ['/usr/local/cuda/lib64/libnvrtc.so.13']},
    ...          '/venv', ('cublas', 'nvrtc', 'curand'))
    ... # doctest: +NORMALIZE_WHITESPACE
    ['curand: not loaded',
     'nvrtc: /usr/local/cuda/lib64/libnvrtc.so.13 is outside /venv']
    """
    prefix = os.path.join(os.path.realpath(prefix), '')
    said = [f'{name}: not loaded' for name in wanted if name not in found]
    for name, paths in sorted(found.items()):
        said += [f'{name}: {path} is outside {prefix.rstrip("/")}'
                 for path in paths
                 if not os.path.realpath(path).startswith(prefix)]
    return said


def exercise():
    """Make CuPy load each library once; ``(wanted, notes, count)``: the
    libraries that must now be loaded, lines to print, and the GPUs
    dasktrain would train on."""
    import cupy
    import numpy as np
    notes = [f'CuPy {cupy.__version__}, {cupy.cuda.runtime.getDeviceCount()}'
             f' GPU(s) (CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()})']
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = cupy.asarray(host)
    product = (a @ a.T).get()              # cuBLAS
    kernel = (a * 2 + 1).get()             # an elementwise kernel: NVRTC
    drawn = cupy.random.rand(4).get()      # cuRAND
    assert (product == host @ host.T).all() and (kernel == host * 2 + 1).all()
    assert ((drawn >= 0) & (drawn < 1)).all()
    wanted = ['cudart', 'nvrtc', 'cublas', 'curand', 'nccl']
    from cupy.cuda import nccl
    notes.append(f'NCCL {nccl.get_version()}')
    import importlib.util
    if importlib.util.find_spec('cudnn') is None:
        notes.append('no cuDNN frontend (CUDNN=off): cuDNN not checked')
    else:
        from dasktrain.kernels import frontend  # finds the wheel's cuDNN
        cudnn, why = frontend.load()
        notes.append(f'cuDNN {cudnn.backend_version()} through '
                     f'nvidia-cudnn-frontend {cudnn.__version__}'
                     if cudnn is not None else f'cuDNN unusable: {why}')
        wanted.append('cudnn')
    from dasktrain.parallel.cuda_check import gpu_count
    count, reason = gpu_count()
    notes.append(f'dasktrain trains on {count} GPU(s)' if count else
                 f'dasktrain sees no usable GPU: {reason}')
    return wanted, notes, count


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--prefix', default=sys.prefix,
                        help='the folder every CUDA library must lie in '
                             '(default: this environment, %(default)s)')
    args = parser.parse_args(argv)
    wanted, notes, count = exercise()
    with open('/proc/self/maps') as f:
        found = loaded(f.read())
    for line in notes:
        print(line)
    for name, paths in sorted(found.items()):
        for path in paths:
            print(f'{name:9s} {path}')
    said = problems(found, args.prefix, wanted)
    if not count:
        said.append('dasktrain would not train on the GPU')
    for line in said:
        print(f'FAILED {line}')
    print('ok: every CUDA library from this environment' if not said else
          f'{len(said)} problem(s)')
    return 1 if said else 0


if __name__ == '__main__':
    sys.exit(main())
