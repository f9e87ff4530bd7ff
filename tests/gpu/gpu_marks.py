"""What the GPU suite needs, asked once: GPUs, and an NCCL that dasktrain
uses (present and recent enough) for two ranks."""
import pytest

from dasktrain.parallel.devices import gpu_count

COUNT, REASON = gpu_count()


def _nccl():
    if COUNT == 0:
        return False, f'no GPU here ({REASON})'
    from cupy.cuda import nccl

    from dasktrain.parallel.gpus import nccl_problem
    problem = nccl_problem(nccl)  # present, and recent enough to be used
    return problem is None, problem or "NCCL is usable"


NCCL, NCCL_REASON = _nccl()


def needs(n):
    """Skip unless this machine has ``n`` GPUs, saying why."""
    why = f'no GPU here ({REASON})' if COUNT == 0 else \
        f'needs {n} GPUs, this machine has {COUNT}'
    return pytest.mark.skipif(COUNT < n, reason=why)


needs_nccl = pytest.mark.skipif(not NCCL, reason=NCCL_REASON)
