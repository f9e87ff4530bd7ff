"""Every notebook runs headless on the CPU with tiny parameters."""
import os
from pathlib import Path

import nbformat
import pytest

from dasktrain.nbrun import run_notebook

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / 'notebooks')
                   .glob('*.ipynb'))
OUT = os.environ.get('DASKTRAIN_NOTEBOOKS_OUT')  # keep executed copies
TINY = dict(model='tiny', epochs=2, train_size=300, test_size=60)
FIGURES = {'01': 2, '02': 2, '03': 2, '04': 5}


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return str(make_cifar_dir(100, 100, 7))


def test_the_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == [
        '01_single_vs_multi_gpu.ipynb',
        '02_distributed_gradient_vs_parameter_mixture.ipynb',
        '03_cluster_jobs.ipynb', '04_hyperparameter_search.ipynb']


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.stem)
def test_saved_without_outputs_and_with_parameters(path):
    nb = nbformat.read(path, as_version=4)
    tagged = [c for c in nb.cells if 'parameters' in
              c.get('metadata', {}).get('tags', ())]
    assert len(tagged) == 1
    for cell in nb.cells:
        if cell.cell_type == 'code':
            assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_on_cpu_with_tiny_parameters(path, data_dir, tmp_path,
                                                   monkeypatch):
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path / 'home'))
    monkeypatch.setenv('MPLBACKEND', 'Agg')
    parameters = dict(TINY, data_dir=data_dir)
    if path.stem.startswith('03'):
        parameters.update(jobs_dir=str(tmp_path / 'jobs'), port=0,
                          dashboard_port=0, learning_rates=[0.01, 0.003])
    elif path.stem.startswith('04'):
        parameters.update(jobs_dir=str(tmp_path / 'jobs'), port=0,
                          dashboard_port=0, trials=4, startup_trials=2,
                          mix_every_values=[1, 'epoch'])
    else:
        parameters.update(out_dir=str(tmp_path / 'runs'))
    if path.stem.startswith('02'):
        parameters.update(mix_every_values=[1, 3, 'epoch', None])
    executed, figures = run_notebook(path, OUT or tmp_path / 'executed',
                                     parameters, timeout=600)
    nb = nbformat.read(executed, as_version=4)
    errors = [o for c in nb.cells for o in c.get('outputs', ())
              if o.get('output_type') == 'error']
    assert errors == []
    assert len(figures) == FIGURES[path.stem[:2]]
    assert all(f.stat().st_size > 10_000 for f in figures)
