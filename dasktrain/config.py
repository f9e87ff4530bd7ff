"""TrainConfig: every setting of a training run, in one frozen dataclass.

It flows unchanged from the CLI (each ``--flag`` is one field) through job
submission to the workers, and is written to ``OUT/args``.
"""
import dataclasses
import json
import math
import numbers
import os
import types
import typing
from typing import Union

from dasktrain.errors import UserError, argument

# Test-time augmentation averages up to this many views (data/augment.py
# holds them: the image, its flip, and 8 shifts of 2 pixels).
MAX_TTA_VIEWS = 10
MODELS = ('cifar10', 'resnet20', 'resnet32', 'resnet56', 'tiny')
OPTIMIZERS = ('adam', 'momentum-sgd')
DTYPES = ('float32', 'float64', 'mixed16')  # numerics.DTYPES
TYPE_CHECKS = ('once', 'always')
# The keys of a log row (training/loop.py writes them), which
# early_stop_monitor may name; ipm runs with several replicas add 'drift'.
LOG_KEYS = ('epoch', 'iteration', 'main/loss', 'main/accuracy',
            'validation/main/loss', 'validation/main/accuracy',
            'elapsed_time', 'images_per_sec', 'data_wait_time', 'comm_time',
            'lr')
IPM_KEYS = ('drift',)  # logged by ipm runs with several replicas


class ConfigError(UserError, ValueError):
    """A setting with a value it cannot take."""


_UNIONS = (Union, types.UnionType)  # Optional[int] and int | None


def _has_type(value, annotation):
    """Whether ``value`` fits a field's annotation (ints pass for floats;
    bools pass for nothing but bool)."""
    origin = typing.get_origin(annotation)
    if origin in _UNIONS:
        return any(_has_type(value, a) for a in typing.get_args(annotation))
    if origin is tuple:
        kind = typing.get_args(annotation)[0]
        return isinstance(value, tuple) and all(_has_type(v, kind)
                                                for v in value)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if annotation is int:
        return isinstance(value, numbers.Integral)
    if annotation is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, annotation)


def _type_words(annotation):
    names = {int: 'an int', float: 'a number', str: 'a string',
             bool: 'True or False', type(None): 'None'}
    if typing.get_origin(annotation) in _UNIONS:
        return ' or '.join(_type_words(a)
                           for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is tuple:
        return 'a tuple of strings'
    return names.get(annotation, getattr(annotation, '__name__', '?'))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: str = 'cifar10'          # the seed post's network; see models.py
    #                                 or your own: file.py:NAME, pkg.mod:NAME
    model_args: dict | None = None  # keyword arguments of your own model
    mode: str = 'dg'                # 'dg': mean gradient; 'ipm': mix params
    mix_every: int | str | None = None  # ipm: iterations, 'epoch', or
    #                                 None = one-shot (mix only at the end)
    mix_optimizer_state: bool = False  # ipm: average Adam moments too
    devices: tuple[str, ...] | None = None  # None: every GPU, else 1 CPU
    batch_size: int = 100           # per replica, as in the seed post
    epochs: int = 20                # the seed post's run length
    optimizer: str = 'adam'
    lr: float | None = None         # None: 1e-3 for Adam (alpha), 0.05 for
    #                                 momentum SGD (momentum 0.9)
    weight_decay: float = 0.0       # L2 factor; 5e-4 suits ResNets
    seed: int = 0                   # fixes init, order, augmentation, dropout
    deterministic: bool = False     # GPU: deterministic cuDNN algorithms and
    #                                 dropout masks from each replica's own
    #                                 seeded stream (slower convolutions);
    #                                 the CPU is deterministic either way
    # How a step computes (numerics.py applies them on every rank).
    dtype: str | None = None        # 'float32', 'float64', or 'mixed16':
    #                                 Chainer's mixed16 (float16 activations
    #                                 and weights, float32 BatchNorm), with
    #                                 dynamic loss scaling and float32
    #                                 master weights in the update; None:
    #                                 Chainer's default ($CHAINER_DTYPE,
    #                                 else float32)
    tf32: bool = False              # GPUs of compute capability >= 8.0:
    #                                 float32 matrix products (and cuDNN
    #                                 convolutions) round their inputs to
    #                                 TF32's 10-bit mantissa, accumulating
    #                                 in float32 (~1e-3 relative per
    #                                 product); faster on tensor cores
    cudnn: str = 'auto'             # 'off': chainer.config.use_cudnn
    #                                 'never' for the whole run; 'auto':
    #                                 Chainer's own ($CHAINER_USE_CUDNN)
    type_check: str = 'once'        # Chainer's type checks: 'once' per
    #                                 input signature (the batch's shapes
    #                                 and dtypes), off on later steps of a
    #                                 checked one (they cost a ResNet-20
    #                                 step 0.75 ms of host time);
    #                                 'always': on every step
    out: str = 'results'            # log, args, checkpoint, models
    dataset: str = 'cifar10'        # cifar10, cifar100, sample, npz:PATH, or
    #                                 your own function: file.py:NAME
    label_set: str = 'fine'         # cifar100: 100 'fine' or 20 'coarse'
    data_dir: str = 'data'          # CIFAR-10 cache
    url: str | None = None          # mirror (else $DASKTRAIN_CIFAR10_URL)
    md5: str | None = None          # the mirror archive's MD5
    augment: bool | str = 'auto'    # crop 4px at 32 + flip for images,
    #                                 none for other inputs (True: auto);
    #                                 'crop-flip', 'crop', 'none' (False)
    train_size: int | None = None   # first N training images (quick runs)
    test_size: int | None = None    # first N test images (quick runs)
    tta: int = 1                    # test-time views averaged (1: none)
    early_stop_patience: int | None = None  # epochs without improvement
    early_stop_monitor: str = 'validation/main/loss'
    early_stop_mode: str = 'auto'   # 'max' or 'min': which way the monitor
    #                                 improves; 'auto' reads it off the name
    #                                 (accuracy: max, loss: min) or refuses
    resume: bool = False            # continue from OUT/checkpoint.npz
    progress: bool = True           # progress bar on a terminal
    in_process: bool = False        # several devices: all replicas in this
    #                                 process (the seed's design) instead of
    #                                 one worker process per device
    # Scale-out (scaleout.py): one job as replica groups on Dask workers.
    workers: int | None = None      # groups, one per worker; None: here
    scheduler: str | None = None    # None: the `cluster start` cluster
    gpus_per_worker: int | None = None  # GPUs each rank holds (0: none);
    #                                 None: as many as devices names, else
    #                                 1 where the workers have GPUs
    on_worker_loss: str = 'continue'  # or 'wait' for a replacement worker
    collective_timeout: float = 300.0  # s a rank waits for the others: a
    #                                 hung peer fails the job, not hangs it
    comm_dtype: str | None = None  # dg across processes: 'float16'
    #                                 halves the bytes of each all-reduce
    double_buffering: bool = False  # dg across processes: each step's
    #                                 all-reduce travels while the next
    #                                 step computes: applied a step late
    exact_warmup: int | str = 'epoch'  # double buffering: exact steps
    #                                 first ('epoch': the first epoch)
    stale_steps: str = 'corrected'  # double buffering: 'corrected' (each
    #                                 replica's own gradient now, the job's
    #                                 mean a step late in its place; within
    #                                 2 points of exact with momentum too),
    #                                 'predicted' (the mean a step late, at
    #                                 weights one update ahead), 'plain'
    #                                 (ChainerMN's; momentum and Adam stall:
    #                                 bench/double_buffering.py)
    bucket_mb: float | None = None  # dg, one replica per process: MiB of
    #                                 gradients all-reduced as one bucket
    #                                 while the backward pass goes on (0:
    #                                 one all-reduce after it); None: 4 on
    #                                 GPUs, 0 on CPUs, where every core
    #                                 computes and there is no idle one to
    #                                 hide the sums' copies behind (measured:
    #                                 bench/two_workers.py)

    def __post_init__(self):
        def fail(field, expected):
            value = getattr(self, field)
            raise ConfigError(f'{argument(field)} must be {expected}, got '
                              f'{value!r}')

        for name in ('out', 'data_dir'):  # a pathlib.Path is fine too
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        # What the CLI's --devices takes ('0,1', 'cpu:2'), and a list.
        if isinstance(self.devices, str):
            try:
                object.__setattr__(self, 'devices',
                                   parse_devices(self.devices))
            except ConfigError as e:
                raise ConfigError(f'{argument("devices")}: {e}') from None
        elif isinstance(self.devices, list):
            object.__setattr__(self, 'devices', tuple(self.devices))
        for f in dataclasses.fields(self):  # types first: then values
            value = getattr(self, f.name)
            if not _has_type(value, f.type):
                # A bool has a --no-... flag or none: name the field.
                name = f.name if f.type is bool else argument(f.name)
                raise ConfigError(f'{name} must be {_type_words(f.type)}, '
                                  f'got {value!r}')

        def positive(field, allow_none=False):
            value = getattr(self, field)
            if allow_none and value is None:
                return
            if not isinstance(value, int) or isinstance(value, bool) or \
                    value < 1:
                fail(field, 'an int >= 1' + (' or None' if allow_none
                                              else ''))

        if self.model not in MODELS and ':' not in self.model:
            fail('model', f'one of {", ".join(MODELS)}, or your own model '
                          'as path/to/file.py:NAME or package.module:NAME')
        if self.model_args is not None:
            if ':' not in self.model:
                raise ConfigError(f'{argument("model_args")} apply to your '
                                  f'own model ({argument("model")} '
                                  f'file.py:NAME), not to {self.model}')
            try:
                json.dumps(self.model_args)
            except (TypeError, ValueError):
                fail('model_args', 'a dict of JSON values')
        if self.mode not in ('dg', 'ipm'):
            fail('mode', "'dg' or 'ipm'")
        if self.mix_every is not None:
            if self.mode != 'ipm':
                raise ConfigError(f'{argument("mix_every")} applies to '
                                  f'{argument("mode")} ipm only, got '
                                  f'{argument("mix_every")} {self.mix_every} '
                                  f'with {argument("mode")} {self.mode}')
            if self.mix_every != 'epoch':
                positive('mix_every')
        if self.devices is not None:
            if not isinstance(self.devices, tuple) or not self.devices:
                fail('devices', 'a non-empty tuple of device specifiers')
        for field in ('batch_size', 'epochs'):
            positive(field)
        for field in ('train_size', 'test_size', 'early_stop_patience'):
            positive(field, allow_none=True)
        if not self.dataset:
            fail('dataset', 'cifar10, cifar100, npz:PATH or file.py:NAME')
        if self.label_set not in ('fine', 'coarse'):
            fail('label_set', "'fine' or 'coarse'")
        if self.augment not in (True, False, 'auto', 'crop-flip', 'crop',
                                'none'):
            fail('augment', "True, False, 'auto', 'crop-flip', 'crop' or "
                            "'none'")
        if self.exact_warmup != 'epoch' and not (
                isinstance(self.exact_warmup, int) and
                not isinstance(self.exact_warmup, bool) and
                self.exact_warmup >= 0):
            fail('exact_warmup', "an int >= 0 or 'epoch'")
        if self.stale_steps not in ('corrected', 'predicted', 'plain'):
            fail('stale_steps', "'corrected', 'predicted' or 'plain'")
        if self.optimizer not in OPTIMIZERS:
            fail('optimizer', f'one of {", ".join(OPTIMIZERS)}')
        if self.lr is not None and not (_finite(self.lr) and self.lr > 0):
            fail('lr', 'a finite number > 0')
        if not (_finite(self.weight_decay) and self.weight_decay >= 0):
            fail('weight_decay', 'a finite number >= 0')
        monitors = LOG_KEYS + (IPM_KEYS if self.mode == 'ipm' else ())
        if self.early_stop_monitor not in monitors:
            fail('early_stop_monitor', f'a key of the log: one of '
                                       f'{", ".join(monitors)}')
        positive('workers', allow_none=True)
        if self.scheduler is not None and self.workers is None:
            raise ConfigError(f'{argument("scheduler")} applies with '
                              f'{argument("workers")} only, got '
                              f'{argument("scheduler")} {self.scheduler} '
                              f'without {argument("workers")}')
        if self.gpus_per_worker is not None:
            if self.workers is None:
                raise ConfigError(f'{argument("gpus_per_worker")} applies '
                                  f'with {argument("workers")} only')
            if not isinstance(self.gpus_per_worker, int) or \
                    isinstance(self.gpus_per_worker, bool) or \
                    self.gpus_per_worker < 0:
                fail('gpus_per_worker', 'an int >= 0 or None')
        if self.early_stop_mode not in ('auto', 'min', 'max'):
            fail('early_stop_mode', "'auto', 'min' or 'max'")
        if self.on_worker_loss not in ('continue', 'wait'):
            fail('on_worker_loss', "'continue' or 'wait'")
        if self.comm_dtype not in (None, 'float32', 'float16'):
            fail('comm_dtype', "None, 'float32' or 'float16'")
        if self.dtype not in (None,) + DTYPES:
            fail('dtype', "None, 'float32', 'float64' or 'mixed16'")
        if self.dtype == 'mixed16' and self.double_buffering:
            # A stale step's gradient was scaled by another step's loss
            # scale than the one its update divides by.
            raise ConfigError(f'{argument("dtype")} mixed16 scales each '
                              'step\'s loss by its own factor, and '
                              f'{argument("double_buffering")} applies a '
                              'gradient a step late; leave one of them out')
        if self.cudnn not in ('auto', 'off'):
            fail('cudnn', "'auto' or 'off'")
        if self.type_check not in TYPE_CHECKS:
            fail('type_check', "'once' or 'always'")
        if not (isinstance(self.collective_timeout, (int, float)) and
                self.collective_timeout > 0):
            fail('collective_timeout', 'a number of seconds > 0')
        if self.bucket_mb is not None and \
                not self.bucket_mb >= 0:  # also refuses nan
            fail('bucket_mb', 'a number of MiB >= 0')
        if not isinstance(self.tta, int) or not 1 <= self.tta <= \
                MAX_TTA_VIEWS:
            fail('tta', f'an int in 1..{MAX_TTA_VIEWS}')

    @property
    def learning_rate(self):
        """``lr``, or the optimizer's default."""
        if self.lr is not None:
            return self.lr
        return 1e-3 if self.optimizer == 'adam' else 0.05

    def to_json(self):
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text):
        """The config of :meth:`to_json`'s text, or of a run's ``OUT/args``
        (whose ``data`` entry, what the run found in its data, is not a
        setting)."""
        data = json.loads(text)
        data.pop('data', None)
        if 'weight_prediction' in data:  # a job written before stale_steps
            data['stale_steps'] = 'predicted' \
                if data.pop('weight_prediction') else 'plain'
        if data.get('devices') is not None:
            data['devices'] = tuple(data['devices'])
        return cls(**data)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def _finite(value):
    return isinstance(value, numbers.Real) and \
        not isinstance(value, bool) and math.isfinite(value)


def parse_devices(text):
    """``'0,1,2'``, ``'cpu'`` or ``'cpu:N'`` to a tuple of device specifiers.

    >>> parse_devices('0,2')
    ('@cupy:0', '@cupy:2')
    >>> parse_devices('cpu:2')
    ('@numpy', '@numpy')
    """
    text = text.strip()
    if text == 'cpu':
        return ('@numpy',)
    if text.startswith('cpu:'):
        count = text[4:]
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"'cpu:N' needs N >= 1, got {text!r}")
        return ('@numpy',) * int(count)
    parts = [p.strip() for p in text.split(',')]
    if not all(p.isdigit() for p in parts):
        raise ConfigError(f"expected GPU ids like '0,1', 'cpu' or 'cpu:N', "
                          f'got {text!r}')
    return tuple(f'@cupy:{int(p)}' for p in parts)


def better(key):
    """``'max'`` or ``'min'``: which way a log key improves, where its name
    says so unambiguously (accuracies, losses); else None.

    >>> better('validation/main/accuracy'), better('main/loss'), better('lr')
    ('max', 'min', None)
    """
    if key.endswith('accuracy'):
        return 'max'
    if key.endswith('loss'):
        return 'min'
    return None
