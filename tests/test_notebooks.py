"""Every notebook runs headless on the CPU with tiny parameters."""
import ast
import json
import os
from pathlib import Path

import nbformat
import pytest
from nbrun import clean, run_notebook  # tools/nbrun.py

from dasktrain.files import repository_path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / 'notebooks').glob('*.ipynb'))
OUT = os.environ.get('DASKTRAIN_NOTEBOOKS_OUT')  # keep executed copies
TINY = dict(model='tiny', epochs=2, train_size=300, test_size=60)
FIGURES = {'01': 2, '02': 3, '03': 2, '04': 5, '05': 2}


@pytest.fixture(scope='module')
def data_dir(make_cifar_dir):
    return str(make_cifar_dir(100, 100, 7))


def test_the_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == [
        '01_single_vs_multi_gpu.ipynb',
        '02_distributed_gradient_vs_parameter_mixture.ipynb',
        '03_cluster_jobs.ipynb', '04_hyperparameter_search.ipynb',
        '05_own_model_and_data.ipynb']


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_executed_with_their_figures_and_parameters(path):
    """Committed as tools/execute_notebooks.py leaves them: a reader sees
    tables and figures before running anything, and is told on what."""
    nb = nbformat.read(path, as_version=4)
    tags = [c.get('metadata', {}).get('tags', []) for c in nb.cells]
    assert tags[0] == ['execution-note']
    assert 'synthetic' in nb.cells[0].source
    at = tags.index(['parameters'])
    assert tags[at + 1] == ['injected-parameters']
    assert sum('parameters' in t for t in tags) == 1
    # no temporary folder of the run that executed it: "Run All" in
    # Jupyter writes where the defaults say
    assert '/tmp/' not in nb.cells[at + 1].source
    outputs = [o for c in nb.cells if c.cell_type == 'code'
               for o in c.outputs]
    # nor in what the cells printed: a reader's run prints their paths
    assert not [o for o in outputs if '/tmp/' in str(o.get('text', ''))]
    # no stray values of a cell's last expression (a write's byte count,
    # a matplotlib object's repr): tables and figures only
    stray = [o.data['text/plain'] for o in outputs
             if o.output_type == 'execute_result' and
             set(o.data) == {'text/plain'}]
    assert stray == [], stray
    assert not [o for o in outputs if o.output_type == 'error']
    assert all(c.execution_count for c in nb.cells if c.cell_type == 'code')
    figures = [o for o in outputs if 'image/png' in o.get('data', {})]
    assert len(figures) == FIGURES[path.stem[:2]]
    # run again, it starts from the source (no old outputs or injections)
    source = clean(nbformat.read(path, as_version=4))
    assert [c for c in source.cells if c.cell_type == 'code' and
            c.outputs] == []
    assert len(source.cells) == len(nb.cells) - 2
    tagged = [source.cells[at - 1]]
    # nbformat 4.5 wants an id on every cell, saved in the file (reading
    # makes up missing ones, with a warning today, an error in future
    # nbformat versions)
    ids = [cell.get('id') for cell in json.loads(path.read_text())['cells']]
    assert all(ids) and len(set(ids)) == len(ids)
    # Paths default to the checkout's data/ and runs/ (None here, resolved
    # by repository_path), never to folders relative to the kernel's;
    # a lab mirror's url and md5 can be passed.
    defaults = {node.targets[0].id: ast.literal_eval(node.value)
                for node in ast.parse(tagged[0].source).body}
    for name in ('data_dir', 'url', 'md5', 'out_dir', 'jobs_dir'):
        if name in defaults or name in ('data_dir', 'url', 'md5'):
            assert defaults[name] is None, name


def test_default_paths_are_the_checkouts_wherever_the_kernel_runs(
        tmp_path, monkeypatch):
    for where in (ROOT / 'notebooks', ROOT, tmp_path):
        monkeypatch.chdir(where)
        assert repository_path('data') == ROOT / 'data'
        assert repository_path('runs', '01') == ROOT / 'runs' / '01'


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_on_cpu_with_tiny_parameters(path, data_dir, tmp_path,
                                                   monkeypatch,
                                                   archive_server,
                                                   cifar_archive):
    monkeypatch.setenv('DASKTRAIN_HOME', str(tmp_path / 'home'))
    monkeypatch.setenv('MPLBACKEND', 'Agg')
    # Relative paths, as typed in this directory: the kernel runs here.
    monkeypatch.chdir(tmp_path)
    parameters = dict(TINY, data_dir=os.path.relpath(data_dir))
    if path.stem.startswith('03'):
        parameters.update(jobs_dir='jobs', port=0, dashboard_port=0,
                          learning_rates=[0.01, 0.003])
    elif path.stem.startswith('04'):
        parameters.update(jobs_dir='jobs', port=0, dashboard_port=0,
                          trials=4, startup_trials=2,
                          mix_every_values=[1, 'epoch'])
    else:
        parameters.update(out_dir='runs')
    if path.stem.startswith('01'):  # from a mirror with its own MD5
        parameters.update(data_dir='mirrored', url=archive_server.url(),
                          md5=cifar_archive[1], batch_size=20)
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
    streams = ''.join(o.get('text', '') for c in nb.cells
                      for o in c.get('outputs', ()))
    assert 'IProgress' not in streams and 'TqdmWarning' not in streams
    made = 'jobs' if path.stem[:2] in ('03', '04') else 'runs'
    assert (tmp_path / made).is_dir()
    if path.stem.startswith('01'):
        assert (tmp_path / 'mirrored' / 'cifar-10-batches-py').is_dir()
        assert len(archive_server.requests) == 1
