"""What `make install` and pip install: environment.yml describes the same
environment as pyproject.toml; Chainer imports before dasktrain in it; the
CuPy extra follows the NVIDIA driver."""
import doctest
import importlib
import importlib.util
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import ctk_check  # tools/ctk_check.py
import cuda_extra  # tools/cuda_extra.py
import pytest
import yaml

try:
    import tomllib
except ImportError:  # Python 3.10: the parser pip itself uses
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
# Files of the package that are not Python, read with importlib.resources.
PACKAGE_DATA = {'dasktrain/jobs/scheduler/page.html',
                'dasktrain/jobs/scheduler/page.js'}


def _name(requirement):
    return re.split(r'[<>=!\[ ;]', requirement, maxsplit=1)[0].lower()


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


# ------------------------------------------- chainer first, at any start

CHAINER_FIRST = ('import chainer, numpy, sys; '
                 'x = chainer.functions.relu(numpy.ones(2, "f")); '
                 'print(chainer.__version__, numpy.__version__, '
                 'x.array.tolist())')


def _chainer_first(python, cwd):
    done = subprocess.run([str(python), '-c', CHAINER_FIRST], cwd=cwd,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_chainer_imports_first_in_the_installed_environment(tmp_path):
    # Nothing imports dasktrain: the .pth installed with it patches NumPy.
    out = _chainer_first(sys.executable, tmp_path)
    assert out.startswith('7.8.1 ') and out.endswith('[1.0, 1.0]\n')


def test_starting_python_does_not_load_numpy(tmp_path):
    done = subprocess.run([sys.executable, '-c', 'import sys; print('
                           '"numpy" in sys.modules, "dasktrain" in '
                           'sys.modules)'], cwd=tmp_path, capture_output=True,
                          text=True, check=True)
    assert done.stdout == 'False True\n'  # the hook, not the patch


@pytest.mark.skipif(importlib.util.find_spec('hatchling') is None,
                    reason="the test extra's hatchling builds the wheel")
def test_chainer_imports_first_after_a_normal_install(tmp_path):
    """A wheel (not editable) in a fresh venv that borrows this one's
    dependencies through a plain path entry, whose .pth files do not run:
    only the wheel's own .pth can make `import chainer` work there."""
    subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--quiet',
                    '--no-deps', '--no-build-isolation', '-w',
                    str(tmp_path / 'dist'), str(ROOT)], check=True,
                   capture_output=True)
    wheel, = (tmp_path / 'dist').glob('dasktrain-*.whl')
    with zipfile.ZipFile(wheel) as z:
        assert 'dasktrain-chainer.pth' in z.namelist()
        modules = {p.relative_to(ROOT).as_posix()
                   for p in (ROOT / 'dasktrain').rglob('*.py')}
        assert modules <= set(z.namelist())  # every subpackage's too
        assert PACKAGE_DATA <= set(z.namelist())
    venv = tmp_path / 'venv'
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip',
                    str(venv)], check=True)
    python = venv / 'bin' / 'python'
    site = Path(subprocess.run(
        [str(python), '-c', 'import sysconfig; print(sysconfig.get_path('
         '"purelib"))'], capture_output=True, text=True,
        check=True).stdout.strip())
    subprocess.run([sys.executable, '-m', 'pip', '--python', str(python),
                    'install', '--quiet', '--no-deps', '--no-index',
                    str(wheel)], check=True, capture_output=True)
    ours = sysconfig.get_path('purelib')
    (site / 'zz-borrow.pth').write_text(ours + '\n')
    out = _chainer_first(python, tmp_path)
    assert out.startswith('7.8.1 ') and out.endswith('[1.0, 1.0]\n')
    where = subprocess.run([str(python), '-c', 'import dasktrain; print('
                            'dasktrain.__file__)'], cwd=tmp_path,
                           capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(site))  # the wheel's, not editable
    page = subprocess.run([str(python), '-c', 'from dasktrain.jobs.'
                           'scheduler.page import page_template; '
                           'print(page_template())'],
                          cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout
    assert '<script nonce="{nonce}">' in page and 'setInterval(' in page


# ----------------------------------------------- the package's subpackages

SUBPACKAGES = ('data', 'parallel', 'parallel.comm', 'training', 'cluster',
               'jobs', 'tuning', 'bench')
HEAVY = ('chainer', 'dask', 'distributed', 'optuna', 'requests', 'tornado')


def test_the_package_and_its_subpackages_import_nothing_heavy(tmp_path):
    # Their public names import their module on first use: `dasktrain
    # --help` and `from dasktrain.cluster import connect` stay fast.
    code = ('import sys, dasktrain, dasktrain.cli, dasktrain.commands, ' +
            ', '.join(f'dasktrain.{p}' for p in SUBPACKAGES) +
            f'; print([m for m in {HEAVY!r} if m in sys.modules])')
    done = subprocess.run([sys.executable, '-c', code], cwd=tmp_path,
                          capture_output=True, text=True, check=True)
    assert done.stdout == '[]\n'


def test_each_public_name_is_its_modules_after_every_import():
    # Importing a submodule sets it as its package's attribute: a public
    # name that is also a submodule's (dasktrain.augment, once) would turn
    # from the function into the module.
    import dasktrain
    for info in pkgutil.walk_packages(dasktrain.__path__, 'dasktrain.'):
        importlib.import_module(info.name)
    for package in [dasktrain] + [importlib.import_module(f'dasktrain.{p}')
                                  for p in SUBPACKAGES]:
        submodules = {m.name for m in pkgutil.iter_modules(package.__path__)}
        assert not submodules & set(package.__all__), package.__name__
        for name in package.__all__:
            module = importlib.import_module(package._EXPORTS[name])
            assert getattr(package, name) is getattr(module, name), name
    assert callable(dasktrain.augment) and callable(dasktrain.tune)


# ------------------------------------------ which GPU extras `make` installs

SMI = ('+------------------------------------------------------------------'
       '-----------------------+\n'
       '| NVIDIA-SMI {driver}              Driver Version: {driver}      '
       'CUDA Version: {cuda}     |\n')


@pytest.mark.parametrize('cuda,extras', [
    ('12.4', ('cuda12', 'cudnn12')), ('12.0', ('cuda12', 'cudnn12')),
    ('13.0', ('cuda13', 'cudnn13')), ('13.1', ('cuda13', 'cudnn13')),
    ('14.0', ('cuda13', 'cudnn13')), ('11.8', ())])
def test_the_drivers_cuda_version_picks_the_extras(cuda, extras):
    text = SMI.format(driver='580.65.06', cuda=cuda)
    assert cuda_extra.cuda_version(text) == cuda
    chosen, why = cuda_extra.choose('auto', smi=lambda: (text, None))
    assert chosen == extras
    assert f'CUDA {cuda}' in why and 'CUDA=none|12|13' in why
    assert ('cuDNN 9' in why) == bool(extras)


# Every case of the decision: the driver's CUDA major (None: no driver, or
# one older than CUDA 12), the NumPy major, cuDNN wanted or not.
@pytest.mark.parametrize('major,numpy,cudnn,extras', [
    (13, 2, True, ('cuda13', 'cudnn13')),
    (13, 2, False, ('cuda13',)),
    (13, 1, True, ('cuda13-numpy1', 'cudnn13')),
    (13, 1, False, ('cuda13-numpy1',)),
    (12, 2, True, ('cuda12', 'cudnn12')),
    (12, 2, False, ('cuda12',)),
    (12, 1, True, ('cuda12-numpy1', 'cudnn12')),
    (12, 1, False, ('cuda12-numpy1',)),
    (None, 2, True, ()),
    (None, 2, False, ()),
    (None, 1, True, ('numpy1',)),
    (None, 1, False, ('numpy1',))])
def test_each_case_of_the_install_decision(major, numpy, cudnn, extras):
    assert cuda_extra.extras_for(major, numpy, cudnn, (3, 12)) == extras
    setting = 'none' if major is None else str(major)
    chosen, why = cuda_extra.choose(setting, numpy=str(numpy),
                                    cudnn='on' if cudnn else 'off',
                                    python=(3, 12))
    assert chosen == extras
    assert ('toolkit needed' in why) == (numpy == 1 and major is not None)


def test_numpy_1_only_where_it_has_wheels():
    assert cuda_extra.extras_for(12, 1, python=(3, 10)) == \
        ('cuda12-numpy1', 'cudnn12')
    for python in ((3, 13), (3, 14)):
        with pytest.raises(ValueError, match=r'NUMPY=1: .* Python '
                           f'{python[0]}.{python[1]} '):
            cuda_extra.extras_for(12, 1, python=python)
        with pytest.raises(ValueError, match='no wheels'):
            cuda_extra.choose('none', numpy='1', python=python)
    assert cuda_extra.extras_for(13, 2, python=(3, 14)) == \
        ('cuda13', 'cudnn13')


def _requirements(extra):
    from packaging.requirements import Requirement
    project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
    return {(r := Requirement(text)).name: r for text in
            project['optional-dependencies'][extra]}


# What the wheels' METADATA say (pip download --no-deps, then the
# .dist-info/METADATA of cupy-cuda12x/13x 13.6.0, 14.0.0 and 14.2.0):
# CuPy 14 `Requires-Dist: numpy<2.6,>=2.0` and `Provides-Extra: ctk`
# (cuda-toolkit[cublas,cudart,cufft,curand,cusolver,cusparse,nvrtc]==1X.*);
# CuPy 13.6 `numpy<2.6,>=1.22` and no ctk extra.
CUPY_NUMPY = {13: '>=1.22,<2.6', 14: '>=2.0,<2.6'}
CUPY_CTK_FROM = 14


@pytest.mark.parametrize('major,numpy', [(12, 1), (12, 2), (13, 1),
                                         (13, 2)])
def test_the_extras_pin_a_cupy_that_fits_their_numpy(major, numpy):
    from packaging.specifiers import SpecifierSet
    cuda, cudnn = cuda_extra.extras_for(major, numpy, python=(3, 12))
    wanted = _requirements(cuda)
    cupy = wanted[f'cupy-cuda{major}x']
    cupy_majors = [m for m in CUPY_NUMPY if cupy.specifier.contains(f'{m}.6')]
    assert len(cupy_majors) == 1, cupy
    allowed = SpecifierSet(CUPY_NUMPY[cupy_majors[0]])
    pin = wanted['numpy'].specifier if 'numpy' in wanted else \
        SpecifierSet('>=1.26')  # the project's own
    newest = '1.26.4' if numpy == 1 else '2.4.0'
    assert pin.contains(newest) and allowed.contains(newest)
    assert not (numpy == 1 and pin.contains('2.0.0'))
    # the CUDA libraries from wheels wherever CuPy offers them
    assert ('ctk' in cupy.extras) == (cupy_majors[0] >= CUPY_CTK_FROM)
    assert (numpy == 2) == (cupy_majors[0] >= CUPY_CTK_FROM)
    # NCCL of the same CUDA, at least the 2.26 dasktrain's NCCL needs
    nccl = wanted[f'nvidia-nccl-cu{major}'].specifier
    assert nccl.contains('2.27.7') and not nccl.contains('2.25.1')
    # cuDNN 9 of the same CUDA, and the frontend 1.23 the code speaks
    brought = _requirements(cudnn)
    assert set(brought) == {f'nvidia-cudnn-cu{major}', 'nvidia-cudnn-frontend'}
    assert brought[f'nvidia-cudnn-cu{major}'].specifier.contains('9.20.0.48')
    assert not brought[f'nvidia-cudnn-cu{major}'].specifier.contains('8.9.7')
    frontend = brought['nvidia-cudnn-frontend'].specifier
    assert [v for v in ('1.22.1', '1.23.0', '1.23.9', '1.24.0')
            if frontend.contains(v)] == ['1.23.0', '1.23.9']


def test_the_install_decisions_examples_hold():
    result = doctest.testmod(cuda_extra)
    assert result.failed == 0 and result.attempted >= 8


# /proc/self/maps of a process that ran tools/ctk_check.py's exercise in
# a venv whose CuPy has its [ctk] wheels (the shape of Linux's lines).
SITE = '/opt/dasktrain/lib/python3.12/site-packages'
MAPS = '\n'.join(
    f'7f{i:04x}000-7f{i:04x}fff r-xp 00000000 fd:01 {1000 + i} {path}'
    for i, path in enumerate([
        '/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06',   # the driver
        f'{SITE}/nvidia/cu13/lib/libcudart.so.13',
        f'{SITE}/nvidia/cu13/lib/libnvrtc.so.13',
        f'{SITE}/nvidia/cu13/lib/libnvrtc-builtins.so.13.0',
        f'{SITE}/nvidia/cu13/lib/libcublas.so.13',
        f'{SITE}/nvidia/cu13/lib/libcublasLt.so.13',
        f'{SITE}/nvidia/cu13/lib/libcurand.so.10',
        f'{SITE}/nvidia/nccl/lib/libnccl.so.2',
        f'{SITE}/nvidia/cudnn/lib/libcudnn.so.9',
        f'{SITE}/nvidia/cudnn/lib/libcudnn_graph.so.9',
        f'{SITE}/cupy/_core/core.cpython-312-x86_64-linux-gnu.so'])) + \
    '\n7fff0000-7fff1000 rw-p 00000000 00:00 0 [stack]\n'
WANTED = ('cudart', 'nvrtc', 'cublas', 'curand', 'nccl', 'cudnn')


def test_the_driver_only_check_reads_where_each_library_came_from():
    found = ctk_check.loaded(MAPS)
    assert sorted(found) == ['cublas', 'cublasLt', 'cudart', 'cudnn',
                             'curand', 'nccl', 'nvrtc']
    assert found['cudnn'] == [f'{SITE}/nvidia/cudnn/lib/libcudnn.so.9',
                              f'{SITE}/nvidia/cudnn/lib/libcudnn_graph.so.9']
    assert ctk_check.problems(found, '/opt/dasktrain', WANTED) == []
    # the system toolkit's NVRTC, not the wheel's; cuDNN never loaded
    system = MAPS.replace(f'{SITE}/nvidia/cu13/lib/libnvrtc.so.13',
                          '/usr/local/cuda-13.0/lib64/libnvrtc.so.13')
    system = '\n'.join(line for line in system.splitlines()
                       if 'cudnn' not in line)
    assert ctk_check.problems(ctk_check.loaded(system), '/opt/dasktrain',
                              WANTED) == [
        'cudnn: not loaded',
        'nvrtc: /usr/local/cuda-13.0/lib64/libnvrtc.so.13 is outside '
        '/opt/dasktrain']
    result = doctest.testmod(ctk_check)
    assert result.failed == 0 and result.attempted >= 3


def test_no_driver_or_an_explicit_choice_needs_no_nvidia_smi():
    def smi():
        raise AssertionError('not asked')
    assert cuda_extra.choose('none', smi=smi)[0] == ()
    assert cuda_extra.choose('12', smi=smi)[0] == ('cuda12', 'cudnn12')
    assert cuda_extra.choose('cuda13', smi=smi, cudnn='off')[0] == \
        ('cuda13',)
    failed = (None, "nvidia-smi failed: NVIDIA-SMI has failed because it "
                    "couldn't communicate with the NVIDIA driver.")
    extras, why = cuda_extra.choose('auto', smi=lambda: failed)
    assert extras == () and why.startswith('nvidia-smi failed')
    with pytest.raises(ValueError, match="got '11'"):
        cuda_extra.choose('11')
    with pytest.raises(ValueError, match="NUMPY must be one of 1, 2, got '3'"):
        cuda_extra.choose('12', numpy='3')
    with pytest.raises(ValueError, match="CUDNN must be one of on, off"):
        cuda_extra.choose('12', cudnn='maybe')
    if shutil.which('nvidia-smi') is None:  # this machine, for real
        assert cuda_extra.choose('auto')[0] == ()
        assert 'no nvidia-smi' in cuda_extra.run_nvidia_smi()[1]


@pytest.mark.skipif(shutil.which('make') is None, reason='needs make')
@pytest.mark.parametrize('settings,extras', [
    (['CUDA=12'], 'test,cuda12,cudnn12'),
    (['CUDA=13', 'CUDNN=off'], 'test,cuda13'),
    (['CUDA=12', 'NUMPY=1'], 'test,cuda12-numpy1,cudnn12'),
    (['CUDA=none'], 'test')])
def test_make_install_installs_the_chosen_extras(settings, extras, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith('MAKE')}
    if 'NUMPY=1' in settings and sys.version_info[:2] > (3, 12):
        pytest.skip('NumPy 1 has no wheels for this Python')
    out = subprocess.run(['make', '-n', 'install', f'VENV={tmp_path}',
                          f'PYTHON={sys.executable}', *settings], cwd=ROOT,
                         env=env, capture_output=True, text=True,
                         check=True).stdout
    assert f"pip install --quiet -e '.[{extras}]'" in out
    cuda = settings[0].split('=')[1]
    assert 'cuda_extra.py --explain --numpy ' in out  # says which, and why
    assert f' {cuda}\n' in out
    shared = subprocess.run(['make', '-n', 'install-shared',
                             f'PYTHON={sys.executable}', *settings],
                            cwd=ROOT, env=env, capture_output=True,
                            text=True, check=True).stdout
    spec = extras.removeprefix('test').lstrip(',')
    assert (f"pip install --quiet '.[{spec}]'" if spec else
            "pip install --quiet '.'") in shared
    for bad in ('CUDA=11', 'NUMPY=3', 'CUDNN=maybe'):
        done = subprocess.run(['make', '-n', 'install', f'VENV={tmp_path}',
                               bad], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        assert done.returncode != 0
        assert 'CUDA is auto, none, 12 or 13, NUMPY 1 or 2, CUDNN on or ' \
            'off' in done.stderr
