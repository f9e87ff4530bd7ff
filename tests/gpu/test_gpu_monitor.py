"""NVML's readings of real GPUs, directly and through a real cluster's
/metrics (dasktrain.jobs.scheduler.metrics)."""
import time
import urllib.request

from gpu_marks import COUNT, needs
from prometheus_client.parser import text_string_to_metric_families

from dasktrain.cluster import start_cluster, stop_cluster
from dasktrain.jobs.worker.gpu_use import gpu_readings


def _check(reading):
    assert reading['uuid'].startswith(('GPU-', 'MIG-'))
    assert 0 < reading['memory_used'] <= reading['memory_total']
    # NVML answers NOT_SUPPORTED for a MIG instance's utilisation and
    # temperature (and some boards' power): None, never a made-up number
    mig = reading['uuid'].startswith('MIG-')
    for key, low, high in (('utilization', 0, 1), ('temperature', 10, 110)):
        value = reading[key]
        assert (value is None and mig) or low <= value <= high, (key, value)
    assert reading['power'] is None or 1 < reading['power'] < 2000


@needs(1)
def test_the_driver_names_each_gpu_as_nvml_does():
    # cuDeviceGetUuid_v2: a MIG instance's own UUID, not its parent's
    from dasktrain.parallel.cuda_driver import driver_uuids
    readings = gpu_readings(env={})
    digits = [r['uuid'].split('-', 1)[1] for r in readings]
    found = driver_uuids()
    assert found and all(u.startswith('GPU-') for u in found)
    assert len(found) == COUNT  # CUDA's devices, in CUDA's order
    assert {u.split('-', 1)[1] for u in found} <= set(digits)


@needs(1)
def test_gpu_readings_of_every_gpu_and_of_the_visible_ones():
    readings = gpu_readings(env={})
    assert readings, 'NVML saw no GPU where CUDA sees one'
    for reading in readings:
        _check(reading)
    first = readings[0]
    for visible in (str(first['index']), first['uuid']):
        assert [r['uuid'] for r in gpu_readings(
            env={'CUDA_VISIBLE_DEVICES': visible})] == [first['uuid']]
    assert gpu_readings(env={'CUDA_VISIBLE_DEVICES': ''}) == []


@needs(1)
def test_cluster_metrics_carry_every_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path))
    monkeypatch.delenv('CUDA_VISIBLE_DEVICES', raising=False)
    expected = {r['uuid'] for r in gpu_readings(env={})}
    state = start_cluster(port=0, dashboard_port=0)
    try:
        base = state['dashboard'].rsplit('/', 1)[0]
        deadline = time.monotonic() + 30
        while True:  # the first heartbeats carry the readings
            text = urllib.request.urlopen(base + '/metrics').read().decode()
            families = {f.name: f for f in
                        text_string_to_metric_families(text)}
            samples = families['dasktrain_gpu_memory_total_bytes'].samples
            if samples or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert {s.labels['uuid'] for s in samples} == expected
        for name in ('dasktrain_gpu_utilization_ratio',
                     'dasktrain_gpu_memory_used_bytes',
                     'dasktrain_gpu_temperature_celsius'):
            assert len(families[name].samples) == len(expected), name
    finally:
        stop_cluster()
