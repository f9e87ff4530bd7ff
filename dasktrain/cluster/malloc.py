"""The C allocator a Dask worker process starts with: glibc's own.

Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_=65536`` in every worker
process's environment before it starts it
(``distributed.nanny.pre-spawn-environ``), to hand freed memory back to the
system sooner. Setting any of glibc's thresholds turns off its dynamic
mmap threshold (``mallopt(3)``), so every large temporary, and Chainer's
CPU kernels make many (im2col's columns, each layer's output), is a fresh
mmap whose pages fault in at first touch and go back at free: measured
here, the seed network's single-threaded step at 122 images/s with the
setting against 151 without (plain Chainer, AMD EPYC), and dasktrain's
ranks in Dask workers 25 % behind ChainerMN's under mpiexec. dasktrain's
workers start without it:

* :data:`CONFIG`, for the Dask config under which local workers are made
  (the nanny reads its pre-spawn environment then; ``None`` drops an
  entry);
* :func:`dask_setup`, a nanny preload for ``dask worker`` processes
  (``cluster start``'s: ``--preload-nanny dasktrain.cluster.malloc``),
  which takes it out of the nanny's environment for its worker before
  the nanny starts it.

A value the user set in the environment that starts the workers is theirs
and stays. But a nanny also writes its pre-spawn environment into its own
process's ``os.environ`` before each start (``WorkerProcess.start``), so
after a plain Dask ``LocalCluster`` in the same Python process the
variable looks set by the user; :func:`users_environ` undoes that,
against the value this process had when dasktrain first imported this
module. Owns that one setting.
"""
import os

VARIABLE = 'MALLOC_TRIM_THRESHOLD_'
CONFIG = {f'distributed.nanny.pre-spawn-environ.{VARIABLE}': None}
# Before any nanny of this process could have written it: the user's.
_USERS = os.environ.get(VARIABLE)


def users_environ(env=os.environ):
    """Put the variable in ``env`` (default: this process's environment,
    which child processes and nannies inherit) back to the user's value,
    undoing what an earlier in-process Dask nanny wrote; returns ``env``."""
    if env.get(VARIABLE) != _USERS:
        if _USERS is None:
            env.pop(VARIABLE, None)
        else:
            env[VARIABLE] = _USERS
    return env


def dask_setup(nanny):
    """Nanny preload: the worker process starts with glibc's allocator
    settings, unless the user set the variable for the nanny itself."""
    if VARIABLE in os.environ:
        return
    for env in (getattr(nanny, 'pre_spawn_env', None),
                getattr(nanny, 'env', None)):
        if isinstance(env, dict):
            env.pop(VARIABLE, None)
