"""environment.yml must describe the environment pyproject.toml installs."""
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement):
    return re.split(r'[<>=!\[ ;]', requirement, 1)[0].lower()


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
    wanted = {_name(r): r for r in project['dependencies'] +
              project['optional-dependencies']['test']}
    env = yaml.safe_load((ROOT / 'environment.yml').read_text())
    conda = [d for d in env['dependencies'] if isinstance(d, str)]
    pip = next(d['pip'] for d in env['dependencies'] if isinstance(d, dict))
    assert pip == ['-e .[test]']  # the project itself, with its pins
    listed = {_name(d): d for d in conda if _name(d) not in ('python', 'pip')}
    # chainer comes through pip (sdist); everything else conda provides.
    assert set(listed) == set(wanted) - {'chainer'}
    for name, spec in listed.items():
        bound = re.sub(r'^[A-Za-z0-9_.-]+(\[[^\]]*\])?', '', wanted[name])
        assert spec.replace(' ', '').endswith(bound.replace(' ', '')), name


def test_setuptools_is_capped_for_build_and_run():
    assert 'setuptools<81' in (ROOT / 'constraints.txt').read_text()
    project = tomllib.loads((ROOT / 'pyproject.toml').read_text())
    assert 'setuptools<81' in project['project']['dependencies']
    assert 'PIP_CONSTRAINT' in (ROOT / 'Makefile').read_text()
