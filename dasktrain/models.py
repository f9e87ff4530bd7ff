"""CIFAR-10 models, by name.

``get_model(name)`` returns the network wrapped in
``chainer.links.Classifier``, which reports ``main/loss`` and
``main/accuracy`` as Chainer's own training loop does.
"""
import chainer
import chainer.functions as F
import chainer.links as L


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


def get_model(name, n_classes=10):
    """A fresh ``L.Classifier`` around the model registered as ``name``."""
    if name not in MODELS:
        raise ValueError(f'model must be one of {", ".join(MODELS)}, got '
                         f'{name!r}')
    return L.Classifier(MODELS[name](n_classes))
