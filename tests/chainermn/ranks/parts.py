"""What the rank scripts of tests/chainermn/test_chainermn_model.py and the
one-process references they are compared with share: the same models from
the same seeds, the same data. Imported by the scripts (their folder is
on their path) and by the tests (by path)."""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np

N_IN, N_UNITS, N_OUT = 12, 9, 4


class MLP(chainer.Chain):
    """The whole model: the one process's."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(N_IN, N_UNITS)
            self.l2 = L.Linear(N_UNITS, N_UNITS)
            self.l3 = L.Linear(N_UNITS, N_OUT)

    def forward(self, x):
        return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))


def mlp(seed=0):
    """The MLP every rank and the one process start from."""
    np.random.seed(seed)
    return MLP()


class First(chainer.Chain):
    """The MLP's first layer (rank 0 of a model-parallel pair)."""

    def __init__(self, whole):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(N_IN, N_UNITS)
        self.l1.copyparams(whole.l1)

    def forward(self, x):
        return F.relu(self.l1(x))


class Rest(chainer.Chain):
    """The MLP's later layers (rank 1 of a model-parallel pair)."""

    def __init__(self, whole):
        super().__init__()
        with self.init_scope():
            self.l2 = L.Linear(N_UNITS, N_UNITS)
            self.l3 = L.Linear(N_UNITS, N_OUT)
        self.l2.copyparams(whole.l2)
        self.l3.copyparams(whole.l3)

    def forward(self, h):
        return self.l3(F.relu(self.l2(h)))


class Identity(chainer.Chain):
    def forward(self, y):
        return y


def batches(steps, batch, seed=1):
    """``steps`` batches of ``batch`` samples (x, labels)."""
    rng = np.random.RandomState(seed)
    dtype = chainer.get_dtype()
    return [(rng.normal(size=(batch, N_IN)).astype(dtype),
             rng.randint(0, N_OUT, batch).astype(np.int32))
            for _ in range(steps)]


def params(link):
    """``link``'s parameters by path, as host arrays."""
    return {name: chainer.backend.CpuDevice().send(p.array).copy()
            for name, p in link.namedparams()}


def train_whole(steps, batch, skip_first=False):
    """The one process: the whole MLP trained with Adam on the batches;
    ``skip_first``: the first update only broadcasts (ChainerMN's
    multi-node optimizer), no step."""
    model = L.Classifier(mlp())
    optimizer = chainer.optimizers.Adam()
    optimizer.setup(model)
    for i, (x, t) in enumerate(batches(steps, batch)):
        model.cleargrads()
        model(x, t).backward()
        if not (skip_first and i == 0):
            optimizer.update()
    return params(model.predictor)


# ----------------------------------------------------------- seq2seq

VOCAB, EMBED, LAYERS = 7, 5, 2


class Encoder(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.embed = L.EmbedID(VOCAB, EMBED)
            self.rnn = L.NStepLSTM(LAYERS, EMBED, EMBED, 0.0)


class Decoder(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.embed = L.EmbedID(VOCAB, EMBED)
            self.rnn = L.NStepLSTM(LAYERS, EMBED, EMBED, 0.0)
            self.out = L.Linear(EMBED, VOCAB)

    def loss(self, hx, cx, ys):
        """Teacher-forced cross entropy of the target sequences ``ys``
        from the encoder's final states."""
        inputs = [self.embed(y[:-1]) for y in ys]
        _, _, os = self.rnn(hx, cx, inputs)
        return F.softmax_cross_entropy(self.out(F.concat(os, axis=0)),
                                       np.concatenate([y[1:] for y in ys]))


def seq2seq(seed=2):
    np.random.seed(seed)
    return Encoder(), Decoder()


def pairs(n, seed=3):
    """``n`` (source, target) sequences of words, varying lengths."""
    rng = np.random.RandomState(seed)
    return [(rng.randint(0, VOCAB, rng.randint(2, 6)).astype(np.int32),
             rng.randint(0, VOCAB, rng.randint(3, 7)).astype(np.int32))
            for _ in range(n)]


def train_seq2seq(batches_of_pairs):
    """The one process: encoder and decoder trained together with Adam."""
    encoder, decoder = seq2seq()
    optimizers = []
    for part in (encoder, decoder):
        optimizer = chainer.optimizers.Adam()
        optimizer.setup(part)
        optimizers.append(optimizer)
    for batch in batches_of_pairs:
        xs = [encoder.embed(x) for x, _ in batch]
        hx, cx, _ = encoder.rnn(None, None, xs)
        loss = decoder.loss(hx, cx, [y for _, y in batch])
        encoder.cleargrads()
        decoder.cleargrads()
        loss.backward()
        for optimizer in optimizers:
            optimizer.update()
    return params(encoder), params(decoder)


# ------------------------------------------------- parallel convolution

IN_CHANNELS, CLASSES, SIDE = 4, 7, 5


def conv(seed=4):
    """The whole convolution: CLASSES output channels, one per class."""
    np.random.seed(seed)
    return L.Convolution2D(IN_CHANNELS, CLASSES, ksize=3, pad=1)


def channels(rank, size, n=CLASSES):
    """Rank ``rank``'s block of ``n`` output channels (ChainerMN's
    example's split: the first ``n % size`` ranks one more)."""
    sizes = [n // size + (1 if r < n % size else 0) for r in range(size)]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def images(steps, batch, seed=5):
    rng = np.random.RandomState(seed)
    dtype = chainer.get_dtype()
    return [(rng.normal(size=(batch, IN_CHANNELS, SIDE, SIDE)).astype(dtype),
             rng.randint(0, CLASSES, batch).astype(np.int32))
            for _ in range(steps)]


def conv_loss(y, t):
    """Class scores: each output channel's mean over the image."""
    return F.softmax_cross_entropy(F.mean(F.relu(y), axis=(2, 3)), t)


def train_conv(steps, batch):
    """The one process: the whole convolution trained with Adam; its
    parameters and its first output."""
    link = conv()
    optimizer = chainer.optimizers.Adam()
    optimizer.setup(link)
    first = None
    for x, t in images(steps, batch):
        y = link(x)
        first = np.array(y.array) if first is None else first
        link.cleargrads()
        conv_loss(y, t).backward()
        optimizer.update()
    return params(link), first
