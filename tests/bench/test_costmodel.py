"""The scaling cost model: its formulas on numbers worked by hand."""
import pytest

from dasktrain.bench import costmodel
from dasktrain.cli import main


def test_ring_allreduce_time():
    # 4 GPUs, 1 GB/s, 10 us: 6 latencies + 1.5 x 22.5 MB / 1 GB/s
    t = costmodel.allreduce_time(22.5e6, 4, 1e9, 1e-5)
    assert t == pytest.approx(6e-5 + 1.5 * 0.0225)
    assert costmodel.allreduce_time(22.5e6, 1, 1e9, 1e-5) == 0


def test_efficiency_with_and_without_overlap():
    # 100 ms compute, 50 ms all-reduce: 2/3 without overlap; hidden fully
    # when 2/3 of the compute (66 ms) can cover it
    comm = costmodel.allreduce_time(22.5e6, 2, 22.5e6 / 0.05, 0.0)
    assert comm == pytest.approx(0.05)
    assert costmodel.efficiency(0.1, 22.5e6, 2, 22.5e6 / 0.05, 0) == \
        pytest.approx(2 / 3)
    assert costmodel.efficiency(0.1, 22.5e6, 2, 22.5e6 / 0.05, 0,
                                hidden=2 / 3) == 1.0
    slower = [e for _, _, e, _ in costmodel.predict(
        0.1, 22.5e6, links={'10 GbE': costmodel.LINKS['10 GbE']})]
    assert slower == sorted(slower, reverse=True)  # more GPUs, less


def test_fit_link_recovers_bandwidth_and_latency():
    bandwidth, latency = 2e9, 3e-5
    sizes = [(b, 2 * latency + b / bandwidth) for b in (1e6, 22.5e6)]
    fitted = costmodel.fit_link(*sizes)
    assert fitted == (pytest.approx(bandwidth), pytest.approx(latency))


def test_model_scaling_command(capsys):
    assert main(['bench', 'model-scaling', '--step-ms', '50']) == 0
    out = capsys.readouterr().out
    assert 'a prediction' in out.splitlines()[0]
    assert '| 10 GbE, 64 GPUs |' in out and 'ChainerMN, published' in out
