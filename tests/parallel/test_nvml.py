"""NVML's process lists read without a GPU: entries as pynvml gives them
(scripted: its ``c_nvmlProcessInfo`` fields, None or
NVML_VALUE_NOT_AVAILABLE for unknown memory, the unversioned call raising
where pynvml is newer than the driver)."""
from types import SimpleNamespace

from dasktrain.parallel.nvml import (
    NO_INSTANCE,
    NOT_AVAILABLE,
    merge_entries,
    nvml_processes,
)

GIB = 1024 ** 3


def entry(pid, used, gi=NO_INSTANCE, ci=NO_INSTANCE):
    """An entry as pynvml's nvmlStructToFriendlyObject makes it."""
    return SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=gi,
                           computeInstanceId=ci)


def test_entries_merge_once_per_process_and_unknown_memory_stays_unknown():
    compute = [entry(10, 2 * GIB), entry(11, None), entry(12, NOT_AVAILABLE)]
    graphics = [entry(10, 2 * GIB), entry(13, 50 * 2 ** 20)]
    assert merge_entries(compute, graphics) == [
        {'pid': 10, 'bytes': 2 * GIB}, {'pid': 13, 'bytes': 50 * 2 ** 20},
        {'pid': 11, 'bytes': None}, {'pid': 12, 'bytes': None}]
    # one process on two MIG instances: both count
    assert merge_entries([entry(5, GIB, 1, 0), entry(5, GIB, 2, 0)]) == \
        [{'pid': 5, 'bytes': 2 * GIB}]
    # a v1 entry (pid and usedGpuMemory only), a list NVML refused
    assert merge_entries([SimpleNamespace(pid=3, usedGpuMemory=7)], None) \
        == [{'pid': 3, 'bytes': 7}]
    assert merge_entries([], []) == []          # nobody
    assert merge_entries(None, None) is None    # nobody can tell


class Mismatch(Exception):
    """What pynvml raises for an unversioned call the driver lacks."""


def scripted_pynvml(compute=None, graphics=None, unversioned=True):
    def fails(handle):
        raise Mismatch('NVMLLibraryMismatchError')

    def gives(entries):
        return fails if entries is None else lambda handle: entries
    return SimpleNamespace(
        nvmlDeviceGetComputeRunningProcesses=gives(compute)
        if unversioned else fails,
        nvmlDeviceGetComputeRunningProcesses_v2=gives(compute),
        nvmlDeviceGetGraphicsRunningProcesses=fails,  # e.g. NOT_SUPPORTED
        nvmlDeviceGetGraphicsRunningProcesses_v2=gives(graphics))


def test_nvml_lists_are_read_with_the_v2_fallback_and_refusals_as_unknown():
    nvml = scripted_pynvml(compute=[entry(7, GIB)], unversioned=False)
    assert nvml_processes(nvml, 'h') == [{'pid': 7, 'bytes': GIB}]
    nvml = scripted_pynvml(compute=[entry(7, GIB)], graphics=[entry(8, 1)])
    assert [p['pid'] for p in nvml_processes(nvml, 'h')] == [7, 8]
    assert nvml_processes(scripted_pynvml(), 'h') is None  # no permission
    assert nvml_processes(SimpleNamespace(), 'h') is None  # an old pynvml


def test_the_examples_hold():
    import doctest

    from dasktrain.parallel import nvml, outside
    for module in (nvml, outside):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__
