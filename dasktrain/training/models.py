"""CIFAR-10 models, by name, and their weight files.

``get_model(name)`` returns the network wrapped in
``chainer.links.Classifier``, which reports ``main/loss`` and
``main/accuracy`` as Chainer's own training loop does. ``load_model`` reads
a saved ``model_*.npz`` into one. A weight file is something others can hand
you, and NumPy's pickles run code when loaded: :func:`read_npz` opens it
with ``allow_pickle=False`` (unlike ``chainer.serializers.load_npz``), and
turns a file that is damaged or of another model into one line.
"""
import contextlib
import zipfile
import zlib

import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np

from dasktrain.errors import UserError, argument
from dasktrain.training.usermodel import absolute_spec, build, is_spec


def dropout(x, ratio):
    """``F.dropout``; under ``chainer.config.cudnn_deterministic`` its mask
    is drawn from CuPy's generator (each replica's own seeded stream, see
    ``GPUDistributedGradient.seed``) rather than by cuDNN, whose dropout
    state Chainer seeds from ``os.urandom`` and shares among the replicas of
    a thread (``cuda.get_cudnn_dropout_states``): a seeded run then repeats
    bit for bit, also after a resume."""
    if chainer.config.cudnn_deterministic:
        with chainer.using_config('use_cudnn', 'never'):
            return F.dropout(x, ratio=ratio)
    return F.dropout(x, ratio=ratio)


class Cifar10(chainer.Chain):
    """The seed post's network (after mitmul's chainer-cifar10 ``Cifar10``).

    Three 5x5 convolutions with max pooling, a 3-level spatial pyramid
    pooling to 64 * (1 + 4 + 16) = 1344 features, then fc 4096 with ReLU
    and dropout 0.5, and fc to the classes.
    """

    def __init__(self, n_classes=10):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, 32, 5, stride=1, pad=2)
            self.conv2 = L.Convolution2D(32, 32, 5, stride=1, pad=2)
            self.conv3 = L.Convolution2D(32, 64, 5, stride=1, pad=2)
            self.fc4 = L.Linear(1344, 4096)
            self.fc5 = L.Linear(4096, n_classes)

    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.conv1(x)), 3, stride=2)
        h = F.max_pooling_2d(F.relu(self.conv2(h)), 3, stride=2)
        h = F.relu(self.conv3(h))
        h = F.spatial_pyramid_pooling_2d(h, 3, pooling='max')
        h = dropout(F.relu(self.fc4(h)), ratio=0.5)
        return self.fc5(h)


class _BasicBlock(chainer.Chain):
    """Two 3x3 conv-BN layers plus an identity shortcut (He et al. option A:
    a strided subsample padded with zero channels, so it adds no weights)."""

    def __init__(self, in_channels, out_channels, stride):
        super().__init__()
        self.stride = stride
        self.extra = out_channels - in_channels
        init = chainer.initializers.HeNormal()
        with self.init_scope():
            self.conv1 = L.Convolution2D(in_channels, out_channels, 3, stride,
                                         1, nobias=True, initialW=init)
            self.bn1 = L.BatchNormalization(out_channels)
            self.conv2 = L.Convolution2D(out_channels, out_channels, 3, 1, 1,
                                         nobias=True, initialW=init)
            self.bn2 = L.BatchNormalization(out_channels)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        shortcut = x
        if self.stride > 1:
            shortcut = shortcut[:, :, ::self.stride, ::self.stride]
        if self.extra:
            shortcut = F.pad(shortcut, ((0, 0), (0, self.extra), (0, 0),
                                        (0, 0)), 'constant')
        return F.relu(h + shortcut)


class ResNet(chainer.Chain):
    """CIFAR ResNet of He et al. (2016), depth = 6n + 2.

    A 3x3 conv to 16 channels, three stages of n basic blocks with 16, 32
    and 64 channels (the 2nd and 3rd halve the resolution), global average
    pooling and a linear classifier.
    """

    def __init__(self, depth=20, n_classes=10):
        if (depth - 2) % 6 or depth < 8:
            raise ValueError(f'depth must be 6n + 2 with n >= 1, got {depth}')
        super().__init__()
        n = (depth - 2) // 6
        self.depth = depth
        with self.init_scope():
            self.conv = L.Convolution2D(3, 16, 3, 1, 1, nobias=True,
                                        initialW=chainer.initializers
                                        .HeNormal())
            self.bn = L.BatchNormalization(16)
            self.blocks = chainer.ChainList()
            channels = 16
            for stage, width in enumerate((16, 32, 64)):
                for i in range(n):
                    stride = 2 if stage > 0 and i == 0 else 1
                    self.blocks.append(_BasicBlock(channels, width, stride))
                    channels = width
            self.fc = L.Linear(64, n_classes)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        for block in self.blocks:
            h = block(h)
        return self.fc(F.average(h, axis=(2, 3)))


class Tiny(chainer.Chain):
    """A small deterministic convnet (no dropout, no BatchNorm) for quick
    runs and tests: conv 3->16, pool, conv 16->32, pool, fc to classes."""

    def __init__(self, n_classes=10):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, 16, 3, pad=1)
            self.conv2 = L.Convolution2D(16, 32, 3, pad=1)
            self.fc = L.Linear(32 * 8 * 8, n_classes)

    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.conv1(x)), 2)
        h = F.max_pooling_2d(F.relu(self.conv2(h)), 2)
        return self.fc(h)


MODELS = {
    'cifar10': Cifar10,
    'resnet20': lambda n_classes=10: ResNet(20, n_classes),
    'resnet32': lambda n_classes=10: ResNet(32, n_classes),
    'resnet56': lambda n_classes=10: ResNet(56, n_classes),
    'tiny': Tiny,
}


def get_model(name, n_classes=10, model_args=None):
    """A fresh ``L.Classifier`` around the model registered as ``name``,
    or the user's own model ``name`` names (``file.py:NAME``,
    ``package.module:NAME``: :mod:`~dasktrain.training.usermodel`),
    called with ``model_args``."""
    if is_spec(name):
        return build(name, n_classes, model_args)
    if name not in MODELS:
        raise ValueError(f'model must be one of {", ".join(MODELS)}, or '
                         f'file.py:NAME or package.module:NAME, got '
                         f'{name!r}')
    return L.Classifier(MODELS[name](n_classes))


def check_built_in(model, data):
    """A built-in network takes 3-channel images (``tiny``: 32 x 32); for
    other inputs, one :class:`~dasktrain.errors.UserError` line pointing to
    the user's own model. ``data``: a
    :class:`~dasktrain.data.datasets.Dataset`."""
    if is_spec(model):
        return
    shape = tuple(data.train_images.shape[1:])
    needs, words = ((3, 32, 32), '3 x 32 x 32') if model == 'tiny' else \
        ((3,), '3 x H x W')
    if not data.images or shape[:len(needs)] != needs:
        raise UserError(
            f'{argument("model")} {model} takes images of {words}; '
            f'{data.name} holds inputs of {" x ".join(map(str, shape))}: '
            f'use your own model ({argument("model")} file.py:NAME)')


def resolve_model(model, model_args=None):
    """``model`` as processes elsewhere must name it: a built-in name as
    it is; the user's spec checked here first, by building it once (one
    line naming the spec as typed if it is wrong), then with a relative
    file made absolute."""
    if not is_spec(model):
        return model
    get_model(model, model_args=model_args)
    return absolute_spec(model)


def load_model(path, model='cifar10', model_args=None):
    """The model saved in ``path`` (``OUT/model_final.npz`` or
    ``model_best.npz``), in a fresh ``get_model(model)``: an
    ``L.Classifier`` whose ``.predictor`` is the bare network. Never
    unpickles.

    Examples
    --------
    >>> chain = load_model('results/model_best.npz',
    ...                    'resnet20')  # doctest: +SKIP
    >>> chain.predictor(x)  # doctest: +SKIP
    """
    chain = get_model(model, model_args=model_args)
    with read_npz(path, f'{argument("model")} {model}') as npz:
        chainer.serializers.NpzDeserializer(npz).load(chain)
    return chain


class _Entries:
    """An npz file's entries as a deserializer reads them; remembers the
    last one asked for, to name it when its value does not fit."""

    def __init__(self, npz, path, what):
        self.npz, self.path, self.what = npz, path, what
        self.files = npz.files
        self.last = None

    def __contains__(self, key):
        return key in self.npz

    def __getitem__(self, key):
        self.last = key
        if key not in self.npz:
            raise UserError(f'{self.path} does not match {self.what}: it has '
                            f'no {key!r} (it holds {len(self.files)} '
                            'other arrays); the file is left as it is')
        try:
            return self.npz[key]
        except ValueError as e:
            if 'allow_pickle' not in str(e):
                raise
            raise UserError(f'{self.path}: {key!r} holds pickled Python '
                            'objects, which can run code when loaded; '
                            'refused (dasktrain never writes any)') from None


@contextlib.contextmanager
def read_npz(path, what):
    """Open ``path`` with ``allow_pickle=False`` for the block; any error
    reading it there becomes one UserError naming the file, the entry, and
    ``what`` it was read for."""
    try:
        npz = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise UserError(f'{path} not found') from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise UserError(f'{path} is not a readable .npz file '
                        f'({type(e).__name__}: {e}); the file is left as it '
                        'is') from None
    entries = _Entries(npz, path, what)
    try:
        with npz:
            yield entries
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise UserError(f'{path} is damaged ({type(e).__name__}: {e}); the '
                        'file is left as it is') from None
    except (ValueError, TypeError) as e:  # a shape, a dtype, a pickle
        raise UserError(f'{path} does not match {what}: {entries.last!r}: '
                        f'{e}; the file is left as it is') from None
