"""How a rank computes (dasktrain.numerics): a run's dtype, tf32, cudnn
and deterministic as Chainer's configuration for the rank's thread, the
process-wide CuPy setting held by one value at a time; and every
placement of `dasktrain train` applying them on every rank."""
import doctest
import json
import sys
import threading
from pathlib import Path

import chainer
import numpy as np
import pytest

from dasktrain import numerics
from dasktrain.cli import main
from dasktrain.config import DTYPES, ConfigError, TrainConfig
from dasktrain.errors import UserError
from dasktrain.numerics import ProcessSetting, computing, tf32_allowed


def test_the_examples_hold():
    result = doctest.testmod(numerics)
    assert result.failed == 0 and result.attempted > 8


def test_config_and_numerics_name_the_same_dtypes():
    assert DTYPES == numerics.DTYPES


def test_a_rank_computes_as_told_and_chainer_s_own_comes_back():
    before = {k: getattr(chainer.config, k) for k in
              ('dtype', 'use_cudnn', 'cudnn_deterministic')}
    with computing('mixed16', tf32=True, cudnn='off', deterministic=True):
        assert chainer.config.dtype is chainer.mixed16
        assert chainer.config.use_cudnn == 'never'
        assert chainer.config.cudnn_deterministic is True
        assert tf32_allowed() is True
        seen = []  # another thread (a Dask worker's) computes as it did
        thread = threading.Thread(target=lambda: seen.append(
            (chainer.config.use_cudnn, tf32_allowed())))
        thread.start()
        thread.join()
        assert seen == [(before['use_cudnn'], False)]
    assert {k: getattr(chainer.config, k) for k in before} == before
    assert tf32_allowed() is False
    with computing():  # the defaults leave Chainer's dtype and cuDNN
        assert chainer.config.dtype == before['dtype']
        assert chainer.config.use_cudnn == before['use_cudnn']
    with computing('float64'):
        assert chainer.config.dtype == np.float64
    with pytest.raises(ValueError, match="cudnn must be 'auto' or 'off', "
                                         "got 'never'"):
        with computing(cudnn='never'):
            pass


def test_a_setting_of_the_process_is_held_by_one_value_at_a_time():
    applied = []
    setting = ProcessSetting('tf32', lambda v: applied.append(v) or 'was')
    inside, leave = threading.Event(), threading.Event()

    def first():
        with setting.held('tf32'):
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        inside.wait(10)
        with setting.held('tf32'):  # the same value: shared
            pass
        with pytest.raises(UserError, match=r"^tf32: this run asks for "
                           r"float32, another run in this process computes "
                           r"with tf32, and CuPy holds one setting per "
                           r"process; run it in a process of its own"):
            with setting.held('float32'):
                pass
    finally:
        leave.set()
        thread.join()
    assert applied == ['tf32', 'was']  # set once, restored once
    with setting.held('float32'):  # free again
        pass
    assert applied == ['tf32', 'was', 'float32', 'was']


@pytest.mark.parametrize('argv,message', [
    (['--dtype', 'float16'], "argument --dtype: invalid choice: 'float16'"),
    (['--cudnn', 'never'], "argument --cudnn: invalid choice: 'never'"),
    (['--type-check', 'never'], "argument --type-check: invalid choice"),
    (['--dtype', 'mixed16', '--double-buffering'],
     "--dtype mixed16 scales each step's loss by its own factor, and "
     '--double-buffering applies a gradient a step late; leave one of them '
     'out'),
])
def test_bad_values_are_usage_errors(argv, message, capsys):
    assert main(['train', *argv]) == 2
    assert message in capsys.readouterr().err.splitlines()[1]


def test_python_callers_read_the_field_names():
    with pytest.raises(ConfigError, match=r"^dtype must be None, 'float32', "
                       r"'float64' or 'mixed16', got 'half'$"):
        TrainConfig(dtype='half')
    with pytest.raises(ConfigError, match="^cudnn must be 'auto' or 'off'"):
        TrainConfig(cudnn='never')
    assert TrainConfig(dtype='mixed16', tf32=True, cudnn='off',
                       type_check='always').to_json()


MODEL = '''
import json, os
import chainer
import chainer.links as L
from dasktrain.numerics import tf32_allowed


class Seen(chainer.Chain):
    """Writes what its forward sees, per process, into SEEN_DIR."""

    def __init__(self, n_classes=10):
        super().__init__()
        with self.init_scope():
            self.fc = L.Linear(None, n_classes)

    def forward(self, x):
        seen = {'use_cudnn': chainer.config.use_cudnn,
                'tf32': tf32_allowed(),
                'dtype': str(chainer.get_dtype()),
                'input': str(x.dtype),
                'type_check': chainer.config.type_check}
        path = os.path.join(SEEN_DIR, f'{os.getpid()}.jsonl')
        with open(path, 'a') as f:
            f.write(json.dumps(seen) + '\\n')
        return self.fc(x)
'''


PLACEMENTS = {
    'here': ['--devices', 'cpu:2', '--in-process'],
    'a-process-per-device': ['--devices', 'cpu:2'],
    'cluster-ranks': ['--workers', '2', '--scheduler'],  # + its address
    'launched': [],  # under `dasktrain launch -n 2`
}


@pytest.mark.parametrize('placement', list(PLACEMENTS))
def test_every_rank_computes_as_the_run_says(placement, tmp_path,
                                             make_cifar_dir, request):
    seen_dir = tmp_path / 'seen'
    seen_dir.mkdir()
    (tmp_path / 'seen_model.py').write_text(
        f'SEEN_DIR = {str(seen_dir)!r}\n{MODEL}')
    data_dir = make_cifar_dir(16, 8, 2)
    out = tmp_path / 'out'
    argv = ['train', '--model', f'{tmp_path}/seen_model.py:Seen',
            '--epochs', '1', '--batch-size', '4', '--data-dir',
            str(data_dir), '--out', str(out), '--no-progress',
            '--cudnn', 'off', '--tf32', '--dtype', 'float64',
            *PLACEMENTS[placement]]
    if placement == 'cluster-ranks':
        argv.append(request.getfixturevalue('local_cluster')
                     .scheduler_address)
    if placement == 'launched':
        argv = ['launch', '-n', '2', '--out', str(tmp_path / 'ranks'), '--',
                str(Path(sys.executable).parent / 'dasktrain'), *argv]
    assert main(argv) == 0
    rows = [json.loads(line) for path in seen_dir.iterdir()
            for line in path.read_text().splitlines()]
    assert len({p.name for p in seen_dir.iterdir()}) == \
        (1 if placement == 'here' else 2)  # processes
    assert rows and all(r['use_cudnn'] == 'never' and r['tf32'] and
                        r['dtype'] == 'float64' and r['input'] == 'float64'
                        for r in rows), rows
    # training steps checked once (then off), evaluation checked as ever
    assert {r['type_check'] for r in rows} == {True, False}
    args = json.loads((out / 'args').read_text())
    assert (args['dtype'], args['tf32'], args['cudnn'],
            args['type_check']) == ('float64', True, 'off', 'once')
