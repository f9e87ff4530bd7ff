"""The GPU suite (`make test-gpu`): the CuPy and NCCL paths on real GPUs.
Every test says what it needs (gpu_marks.needs) and is skipped, with the
reason, where a machine has less; `make test` collects it too."""
import pytest
from test_cluster import Processes


@pytest.fixture
def gpu_cluster(tmp_path):
    """A `dask scheduler` whose workers each see the GPUs given to them
    (``gpu_cluster.worker(visible='1', gpus=1)``), as one worker per GPU
    runs."""
    cluster = Processes(tmp_path)
    yield cluster
    cluster.close()
