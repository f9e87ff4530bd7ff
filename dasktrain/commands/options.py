"""The training options of ``dasktrain train`` (and of ``submit`` and
``tune`` after ``--``): one flag per :class:`~dasktrain.config.TrainConfig`
field, its default the field's, and the data options of ``download``.

Owns the command line's spelling of a run; the run itself is TrainConfig,
which knows nothing of argparse.
"""
import argparse
import json

from dasktrain.config import (
    DTYPES,
    MODELS,
    OPTIMIZERS,
    TYPE_CHECKS,
    ConfigError,
    TrainConfig,
    parse_devices,
)


def add_data_arguments(parser):
    parser.add_argument(
        '--dataset', default='cifar10', metavar='SPEC',
        help='cifar10, cifar100, sample (4,000 Fashion-MNIST images '
             'shipped with dasktrain), npz:PATH (keys x_train, y_train, '
             'x_test, y_test) or your own function returning those four '
             'arrays, as file.py:NAME or package.module:NAME (default: '
             '%(default)s)')
    parser.add_argument('--label-set', choices=('fine', 'coarse'),
                        default='fine',
                        help="cifar100's 100 fine or 20 coarse classes "
                             '(default: %(default)s)')
    parser.add_argument('--data-dir', default='data', metavar='DIR',
                        help='CIFAR cache folder (default: %(default)s)')
    parser.add_argument('--url', default=None,
                        help='archive URL, e.g. a lab mirror (default: '
                             '$DASKTRAIN_CIFAR10_URL, else the official one)')
    parser.add_argument('--md5', default=None,
                        help="expected MD5 of the mirror's archive "
                             '(default: $DASKTRAIN_CIFAR10_MD5, else the '
                             'official archive\'s)')


def _mix_every_type(text):  # also --exact-warmup
    if text == 'epoch':
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an int or 'epoch', got {text!r}") from None


class _ModelArg(argparse.Action):
    """``--model-arg KEY=VALUE``, repeatable, into one dict."""

    def __call__(self, parser, namespace, text, option_string=None):
        key, sep, value = text.partition('=')
        if not sep or not key.isidentifier():
            parser.error(f'argument --model-arg: expected KEY=VALUE, got '
                         f'{text!r}')
        try:
            value = json.loads(value)
        except ValueError:
            pass  # a bare string
        # a dict so far, or the default (None; given_fields' probe: a
        # sentinel that is not one)
        so_far = getattr(namespace, self.dest, None)
        args = dict(so_far) if isinstance(so_far, dict) else {}
        args[key] = value
        setattr(namespace, self.dest, args)


def devices_type(text):
    try:
        return parse_devices(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def given_fields(argv):
    """The TrainConfig fields that ``argv`` (``dasktrain train``'s options)
    names explicitly, whatever their values: a resumed run takes the
    others from ``OUT/args``.

    Examples
    --------
    >>> sorted(given_fields(['--resume', '--out', 'r', '--epochs', '20']))
    ['epochs', 'out', 'resume']
    >>> sorted(given_fields(['--model-arg', 'n=1', '--model-arg', 'm=2']))
    ['model_args']
    """
    import dataclasses

    from dasktrain.commands import Parser
    unset = object()  # no string: argparse would convert it with `type`
    probe = Parser(add_help=False)
    add_arguments(probe)
    probe.set_defaults(**{f.name: unset
                          for f in dataclasses.fields(TrainConfig)})
    known, _ = probe.parse_known_args(argv)
    return {k for k, v in vars(known).items() if v is not unset}


def add_arguments(parser):
    """One flag per TrainConfig field; defaults come from TrainConfig."""
    d = TrainConfig()
    add = parser.add_argument
    add('--model', default=d.model, metavar='MODEL',
        help=f'network: {", ".join(MODELS)} (default: %(default)s, the seed '
             "post's), or your own: path/to/file.py:NAME or "
             'package.module:NAME, a Chain class or a function returning a '
             'link from inputs to class scores (docs/models.md)')
    add('--model-arg', dest='model_args', action=_ModelArg,
        default=d.model_args, metavar='KEY=VALUE',
        help='a keyword argument of your own model, repeatable; VALUE is '
             'JSON (256, 0.5, true, [1,2]) or else a string')
    add('--mode', choices=('dg', 'ipm'), default=d.mode,
        help='dg: average gradients every step; ipm: each replica trains, '
             'parameters are averaged every --mix-every (default: '
             '%(default)s)')
    add('--mix-every', type=_mix_every_type, default=d.mix_every, metavar='K',
        help="ipm: iterations between mixes, or 'epoch' (default: mix only "
             'at the end)')
    add('--mix-optimizer-state', action='store_true',
        help='ipm: average optimizer state (Adam moments) too')
    add('--devices', type=devices_type, default=d.devices, metavar='LIST',
        help="GPU ids '0,1,2,3', 'cpu' or 'cpu:N' replicas (default: all "
             'GPUs, else one CPU replica)')
    add('--batch-size', type=int, default=d.batch_size, metavar='N',
        help='images per replica per step (default: %(default)s)')
    add('--epochs', type=int, default=d.epochs, metavar='N',
        help='(default: %(default)s)')
    add('--optimizer', choices=OPTIMIZERS, default=d.optimizer,
        help='(default: %(default)s)')
    add('--lr', type=float, default=d.lr,
        help='learning rate (default: 1e-3 for adam, 0.05 for momentum-sgd)')
    add('--weight-decay', type=float, default=d.weight_decay, metavar='W',
        help='L2 weight decay (default: %(default)s)')
    add('--seed', type=int, default=d.seed, help='(default: %(default)s)')
    add('--deterministic', action='store_true',
        help='on GPUs: bit-identical runs and resumes for one seed '
             '(deterministic cuDNN, seeded dropout; slower)')
    group = parser.add_argument_group(
        'how a step computes', 'applied on every rank, wherever it runs')
    group.add_argument(
        '--dtype', choices=DTYPES, default=d.dtype,
        help="float32, float64, or mixed16: Chainer's mixed precision "
             '(float16 activations and weights, BatchNorm in float32), '
             'with dynamic loss scaling and float32 master weights in '
             "each update (default: Chainer's, $CHAINER_DTYPE, else "
             'float32)')
    group.add_argument(
        '--tf32', action='store_true',
        help='on GPUs of compute capability 8.0 and newer (Ampere, '
             'Hopper): float32 matrix products and convolutions round '
             "their inputs to TF32's 10-bit mantissa and accumulate in "
             'float32, about 1e-3 relative error per product, on tensor '
             'cores (default: off, full float32, even where CUPY_TF32=1)')
    group.add_argument(
        '--cudnn', choices=('auto', 'off'), default=d.cudnn,
        help="off: no cuDNN for the whole run (Chainer's use_cudnn "
             "'never'); auto: Chainer's own choice (default: "
             '%(default)s)')
    group.add_argument(
        '--type-check', choices=TYPE_CHECKS, default=d.type_check,
        help="Chainer's type checks of every function: once for each "
             "input signature (the batch's shapes and dtypes), off for "
             'later steps of one already checked; always: every step '
             '(default: %(default)s)')
    add('--out', default=d.out, metavar='DIR',
        help='log, args, checkpoint and models (default: a new folder '
             'runs/train-YYYYmmdd-HHMMSS; a queued job: its own out/)')
    add_data_arguments(parser)
    add('--augment', choices=('auto', 'crop-flip', 'crop', 'none'),
        default=d.augment,
        help='crop-flip: random crop after padding (4 pixels at 32, in '
             'proportion elsewhere) and horizontal flip; crop: no flip; '
             'none: normalisation only; auto: crop-flip for images, none '
             'for other inputs (default: %(default)s)')
    add('--no-augment', dest='augment', action='store_const', const='none',
        help='the same as --augment none')
    add('--train-size', type=int, default=d.train_size, metavar='N',
        help='train on the first N images only (quick runs)')
    add('--test-size', type=int, default=d.test_size, metavar='N',
        help='evaluate on the first N test images only')
    add('--tta', type=int, default=d.tta, metavar='K',
        help='test-time augmentation views (default: %(default)s = none)')
    add('--early-stop-patience', type=int, default=d.early_stop_patience,
        metavar='P', help='stop after P epochs without improvement')
    add('--early-stop-monitor', default=d.early_stop_monitor, metavar='KEY',
        help='log key watched for early stopping and the best model '
             '(default: %(default)s)')
    add('--early-stop-mode', choices=('auto', 'min', 'max'),
        default=d.early_stop_mode,
        help='whether the monitor improves going down (min) or up (max); '
             'auto: max for accuracies, min for losses, any other key must '
             'say (default: %(default)s)')
    add('--resume', action='store_true',
        help='continue the run in --out from its last checkpoint')
    add('--no-progress', dest='progress', action='store_false',
        help='print nothing while training')
    add('--in-process', action='store_true',
        help='several devices: every replica in this one process (the seed '
             "post's design) rather than one worker process per device")
    group = parser.add_argument_group(
        'across Dask workers', 'one job as N replica groups, one per worker '
        '(each on its own --devices); --out and --data-dir must be paths '
        'every worker sees')
    group.add_argument(
        '--workers', type=int, default=d.workers, metavar='N',
        help='replica groups, one per Dask worker (default: this process)')
    group.add_argument(
        '--scheduler', default=d.scheduler, metavar='ADDR',
        help='Dask scheduler address (default: the cluster of `dasktrain '
             'cluster start`)')
    group.add_argument(
        '--gpus-per-worker', type=int, default=d.gpus_per_worker,
        metavar='K', help='GPUs each rank holds on its worker, 0 for none '
        '(default: as many as --devices names, else 1 where the workers '
        'have GPUs); `submit --gpus K` sets it')
    group.add_argument(
        '--on-worker-loss', choices=('continue', 'wait'),
        default=d.on_worker_loss,
        help='when a worker dies: go on from the last checkpoint with the '
             'workers left, or wait for a replacement (default: %(default)s)')
    group.add_argument(
        '--comm-dtype', choices=('float32', 'float16'), default=d.comm_dtype,
        help='dg: dtype the gradients travel and are summed in; float16 '
             'halves the bytes (default: float32, exact)')
    group.add_argument(
        '--double-buffering', action='store_true',
        help="dg: each step's all-reduce travels while the next step "
             'computes, so the summed gradient lands a step late (see '
             '--stale-steps)')
    group.add_argument(
        '--exact-warmup', type=_mix_every_type, default=d.exact_warmup,
        metavar='STEPS',
        help='with --double-buffering: exact steps before the stale ones, '
             "or 'epoch' for the whole first epoch (default: %(default)s)")
    group.add_argument(
        '--stale-steps', choices=('corrected', 'predicted', 'plain'),
        default=d.stale_steps,
        help="with --double-buffering: 'corrected', each replica applies "
             "its own gradient at once and the job's mean a step late in "
             "its place; 'predicted', the mean a step late, computed one "
             "update ahead; 'plain', ChainerMN's (momentum and Adam may "
             'stall) (default: %(default)s)')
    group.add_argument(
        '--bucket-mb', type=float, default=d.bucket_mb, metavar='MB',
        help='dg with one device per worker: all-reduce the gradients in '
             'buckets of MB MiB during the backward pass, overlapping '
             'communication with computation (0: after it; default: 4 '
             'on GPUs, 0 on CPUs, where every core computes)')
    group.add_argument(
        '--collective-timeout', type=float, default=d.collective_timeout,
        metavar='S', help='seconds a worker waits for the others before '
                          'the job fails (default: %(default)s)')
