"""Whether a job fits the cluster's workers, checked when it is
submitted (by the submitter against its own cluster, by a shared
cluster's scheduler against its workers): enough GPUs (or CPU slots, for
``gpus=0``) on one worker, or enough such workers for a job across
workers; and for a training job on GPUs, workers where CuPy can use them.
A worker whose machine has GPUs that CuPy cannot use says so in its
heartbeats (:data:`~dasktrain.jobs.worker.gpu_use.UNUSABLE_METRIC`): a
refusal names that line, the worker and what to do.
"""
from dasktrain.errors import argument, plural
from dasktrain.jobs.job import JobError


def check_fits(resources, workers, gpus, unusable=None, needs_cupy=False):
    """:meth:`JobRequest.check_fits` for ``workers`` ranks (None: one) of
    ``gpus`` each; with ``needs_cupy`` (a training job on GPUs) the
    workers of ``unusable`` do not count.

    >>> check_fits({'w': {'GPU': 2, 'CPU': 1}}, None, 2)
    >>> check_fits({'w': {'CPU': 1}}, None, 1)
    Traceback (most recent call last):
    ...
    dasktrain.jobs.fields.JobError: no worker has 1 GPU (largest: 0 among 1 ...
    >>> check_fits({'w': {'GPU': 2}}, None, 1, {'w': 'nvidia-smi sees 2 '
    ...            'GPUs, but CuPy cannot use them (...)'}, needs_cupy=True)
    Traceback (most recent call last):
    ...
    dasktrain.jobs.fields.JobError: a training job needs CuPy on its GPUs, ...
    """
    resource = 'GPU' if gpus else 'CPU'
    need = max(gpus, 1)
    what = plural(gpus, 'GPU') if gpus else 'a CPU slot'
    have = {addr: r.get(resource, 0) for addr, r in resources.items()}
    unusable = {a: line for a, line in (unusable or {}).items()
                if line and a in have} if gpus else {}
    # Where the workers' GPUs go unused for want of CuPy: that, and where.
    why = ''.join(f'; worker {a}: {line}, then start its cluster again'
                  for a, line in sorted(unusable.items())[:1])
    fits = [a for a, n in have.items() if n >= need]
    if needs_cupy and fits and set(fits) <= set(unusable):
        first = sorted(fits)[0]
        raise JobError(f'a training job needs CuPy on its GPUs, and no '
                       f'worker with {what} has it: worker {first}: '
                       f'{unusable[first]}, then start its cluster again')
    if workers is not None:
        able = sum(1 for a, n in have.items() if n >= gpus and
                   not (needs_cupy and a in unusable))
        if able < workers:
            raise JobError(f'{argument("workers")} {workers} needs as '
                           f'many Dask workers with {what}; the cluster has '
                           f'{able}; add workers or lower it{why}')
    elif not fits:
        largest = max(have.values(), default=0)
        slots = sum(r.get('CPU', 0) for r in resources.values())
        offer = 'the' if slots == 1 else f'one of the {slots:g}'
        instead = (f'pass {argument("gpus")} 0 to take {offer} CPU '
                   f'slot{"s" * (slots != 1)} the workers offer, '
                   if gpus and slots else 'ask for fewer, ')
        raise JobError(f'no worker has {what} (largest: '
                       f'{largest:g} among {plural(len(have), "worker")}); '
                       f'{instead}or add a worker with `dask worker '
                       f'ADDRESS --resources {resource}={need}`{why}')
