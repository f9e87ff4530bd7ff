"""A run's data, named by ``--dataset``: CIFAR-10 (the default), CIFAR-100,
the built-in ``sample`` (:mod:`~dasktrain.data.sample`), an ``npz:PATH``
file, or the user's own function (``file.py:NAME``,
``package.module:NAME``) returning ``(x_train, y_train, x_test, y_test)``
as NumPy or Dask arrays.

:func:`load_dataset` checks the arrays (one :class:`~dasktrain.errors.
DataError` line per mistake: a missing key, labels that do not match the
inputs or lie outside ``0..K-1``, NaN or inf, an empty split), finds their
layout (images ``N x C x H x W`` or ``N x H x W x C``, or ``N x H x W``
grey, with C in {1, 3}, become ``N x C x H x W``; anything else is fed
to the model as it is) and, for images other than CIFAR-10's, the
per-channel mean and standard deviation of the training images, computed
with Dask. Dask inputs stay lazy: nothing is copied into this process but
the labels.

Owns naming, checking and describing a run's data; reading CIFAR's files
is :mod:`~dasktrain.data.cifar`'s, transforming images
:mod:`~dasktrain.data.augment`'s.
"""
import dataclasses
from pathlib import Path

import dask
import dask.array as da
import numpy as np

from dasktrain.data.augment import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    DEFAULT_CHUNK,
    scaled_pad,
    tta_views,
)
from dasktrain.errors import DataError, argument
from dasktrain.userspec import SpecError, is_spec, load_attribute

BUILT_IN = ('cifar10', 'cifar100', 'sample')
# --augment: 'auto' is crop-flip for the built-in sets (natural images,
# clothes: a mirror image means the same), crop for a user's own (a flip
# can change what an image means: digits, text, scans) and nothing for
# other inputs
AUGMENTS = ('auto', 'crop-flip', 'crop', 'none')
NPZ_KEYS = ('x_train', 'y_train', 'x_test', 'y_test')
LABEL_SETS = ('fine', 'coarse')


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Training and test arrays of one run, checked.

    ``train_images``/``test_images`` are Dask arrays: images as
    ``(N, C, H, W)`` uint8 or float when ``images`` (C in {1, 3}), else the
    inputs as given. Labels are int32 in ``0..n_classes - 1``. ``mean`` and
    ``std`` are per channel, in the images' units (None for other inputs);
    ``layout`` says how the images were found.
    """
    name: str
    train_images: da.Array
    train_labels: da.Array
    test_images: da.Array
    test_labels: da.Array
    n_classes: int
    images: bool = True
    mean: tuple | None = CIFAR10_MEAN
    std: tuple | None = CIFAR10_STD
    layout: str = 'N x C x H x W'

    def describe(self):
        """One line: what the run trains on."""
        shape = ' x '.join(map(str, self.train_images.shape[1:]))
        what = f'images {shape} ({self.layout})' if self.images else \
            f'inputs {shape or "scalars"} (not images: no augmentation)'
        return (f'dataset {self.name}: {len(self.train_labels)} training '
                f'and {len(self.test_labels)} test {what}, '
                f'{self.n_classes} classes')

    def test_views(self, lo, hi, k=1):
        """Test inputs ``lo:hi`` as ``k`` lazy test-time views (images;
        other inputs: one, as they are, floats as float32)."""
        x = self.test_images[lo:hi]
        if not self.images:
            if k != 1:
                raise DataError(f'{argument("tta")} views are of images; '
                                f'{self.name} holds other inputs: pass '
                                f'{argument("tta")} 1')
            return [x.astype(np.float32) if x.dtype.kind == 'f' else x]
        return tta_views(x, k, mean=self.mean, std=self.std)

    def normalization(self):
        """(mean, std) for the loader; False for inputs that are not
        images."""
        return (self.mean, self.std) if self.images else False

    def augmentation(self, augment='auto'):
        """Keyword arguments of :func:`~dasktrain.data.augment.augment`
        for ``augment`` (True: 'auto', False: 'none'), None for none: a
        random crop after padding by 4 pixels at 32 (in proportion for
        other sizes) and, with 'crop-flip', a horizontal flip. 'auto' is
        'crop-flip' for the built-in sets of natural images (CIFAR), 'crop'
        for other images (a flip may change what they mean), 'none' for
        inputs that are not images."""
        options, _ = augmentation_plan(
            self.name, self.images, self.train_images.shape[2:3], augment)
        if options is False:
            raise DataError(f'{argument("augment")} {augment} crops and '
                            f'flips images; {self.name} holds inputs of '
                            f'shape {tuple(self.train_images.shape[1:])}: '
                            f'pass {argument("augment")} none')
        return options

    def augmentation_words(self, augment='auto'):
        """One line: the augmentation a run applies, and why
        (:func:`augmentation_plan`)."""
        self.augmentation(augment)  # one line if it cannot be
        return augmentation_plan(self.name, self.images,
                                 self.train_images.shape[2:3], augment)[1]

    def statistics(self):
        """What OUT/args records of the data."""
        return dict(dataset=self.name, n_classes=self.n_classes,
                    input_shape=list(self.train_images.shape[1:]),
                    layout=self.layout, images=self.images,
                    mean=None if self.mean is None else list(self.mean),
                    std=None if self.std is None else list(self.std))


def augmentation_plan(name, images, size, augment='auto'):
    """``(options, line)``: the keyword arguments of
    :func:`~dasktrain.data.augment.augment` that ``augment`` comes to for
    the dataset ``name`` (None: none; False: it asks to crop inputs that
    are not ``images``), and one line saying what the run applies and why.
    ``size``: the images' height, as a 1-tuple (none for other inputs).

    Examples
    --------
    >>> augmentation_plan('cifar10', True, (32,))[1]
    "augmentation: random crop (padding 4), horizontal flip: augment auto, \
on cifar10's natural images"
    >>> augmentation_plan('npz:digits.npz', True, (8,))[0]
    {'pad': 1, 'flip': False}
    """
    augment = {True: 'auto', False: 'none'}.get(augment, augment)
    if augment not in AUGMENTS:
        raise DataError(f'{argument("augment")} must be one of '
                        f'{", ".join(AUGMENTS)}, got {augment!r}')
    flag = f'{argument("augment")} {augment}'
    chosen, why = augment, flag
    if augment == 'auto' and not images:
        chosen, why = 'none', f'{flag}, on inputs that are not images'
    elif augment == 'auto' and name in BUILT_IN:
        chosen, why = 'crop-flip', f"{flag}, on {name}'s " + (
            'natural images' if name != 'sample' else 'clothes')
    elif augment == 'auto':
        chosen, why = 'crop', (
            f'{flag}, on your own images, whose meaning a flip may change '
            f'(digits, text); {argument("augment")} crop-flip flips them')
    if chosen == 'none':
        what = 'none, normalisation only' if images else 'none'
        return None, f'augmentation: {what}: {why}'
    if not images:
        return False, None
    options = dict(pad=scaled_pad(size[0]), flip=chosen != 'crop')
    what = f"random crop (padding {options['pad']}), " + \
        ('horizontal flip' if options['flip'] else 'no flip')
    return options, f'augmentation: {what}: {why}'


def check_spec(spec):
    """Validate the form of a ``--dataset`` value (not its contents)."""
    if not isinstance(spec, str) or not spec:
        raise DataError(f'{argument("dataset")} must be cifar10, cifar100, '
                        f'sample, npz:PATH or file.py:NAME, got {spec!r}')
    if spec in BUILT_IN or spec.startswith('npz:'):
        if spec == 'npz:':
            raise DataError(f'{argument("dataset")} npz: needs a path, '
                            'e.g. npz:data/mine.npz')
        return
    if not is_spec(spec):
        raise DataError(f'{argument("dataset")} must be cifar10, cifar100, '
                        'sample, npz:PATH, or your own function as '
                        f'file.py:NAME or package.module:NAME, got {spec!r}')


def resolve_spec(spec, cwd=None):
    """``spec`` as processes elsewhere must name it: checked, with a
    relative npz path or file made absolute (from ``cwd``, default the
    working directory)."""
    import os

    from dasktrain.userspec import absolute_spec
    check_spec(spec)
    if spec.startswith('npz:'):
        path = os.path.join(cwd or os.getcwd(),
                            os.path.expanduser(spec[len('npz:'):]))
        if not os.path.isfile(path):  # as typed, before it is made whole
            raise DataError(f'{argument("dataset")} {spec}: no file '
                            f'{spec[len("npz:"):]}')
        return 'npz:' + path
    if spec in BUILT_IN:
        return spec
    try:
        return absolute_spec(spec, cwd)
    except SpecError as e:
        raise DataError(str(e)) from None


def spec_file(spec):
    """The Python file a ``file.py:NAME`` dataset spec names, else None."""
    from dasktrain.userspec import spec_file as file_of
    return None if spec in BUILT_IN or spec.startswith('npz:') else \
        file_of(spec)


def load_dataset(spec='cifar10', data_dir='data', url=None, md5=None,
                 label_set='fine', train_size=None, download=True):
    """The run's data as a checked :class:`Dataset`.

    Parameters
    ----------
    spec : str, default 'cifar10'
        ``cifar10``, ``cifar100``, ``sample``, ``npz:PATH`` (keys ``x_train``,
        ``y_train``, ``x_test``, ``y_test``) or ``file.py:NAME`` /
        ``package.module:NAME`` (a function returning those four arrays).
    data_dir, url, md5 : optional
        CIFAR's cache folder and mirror (see
        :func:`~dasktrain.data.download.download_cifar10`).
    label_set : {'fine', 'coarse'}, default 'fine'
        CIFAR-100's 100 fine or 20 coarse classes.
    train_size : int, optional
        Only the first ``train_size`` training images count for the
        normalisation statistics (the ones a quick run trains on).
    download : bool, default True
        Fetch CIFAR when ``data_dir`` lacks it.

    Examples
    --------
    >>> data = load_dataset('npz:digits.npz')  # doctest: +SKIP
    >>> data.describe()  # doctest: +SKIP
    'dataset npz:digits.npz: 1500 training and 297 test images 1 x 8 x 8
    (N x H x W, a channel added), 10 classes'
    """
    check_spec(spec)
    if label_set not in LABEL_SETS:
        raise DataError(f'{argument("label_set")} must be fine or coarse, '
                        f'got {label_set!r}')
    if spec == 'cifar10':
        from dasktrain.data.cifar import load_cifar10
        cifar = load_cifar10(data_dir, download=download, url=url, md5=md5)
        return Dataset(spec, cifar.train_images, cifar.train_labels,
                       cifar.test_images, cifar.test_labels,
                       len(cifar.label_names))
    if spec == 'cifar100':
        from dasktrain.data.cifar import load_cifar100
        arrays = load_cifar100(data_dir, download=download, url=url, md5=md5,
                               label_set=label_set)
    elif spec == 'sample':
        from dasktrain.data.sample import load_sample
        arrays = load_sample()
    elif spec.startswith('npz:'):
        arrays = _npz(spec)
    else:
        arrays = _call(spec)
    return from_arrays(spec, *arrays, train_size=train_size)


def _npz(spec):
    path = Path(spec[len('npz:'):]).expanduser()
    if not path.is_file():
        raise DataError(f'{argument("dataset")} {spec}: no file {path}')
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in NPZ_KEYS if k not in npz.files]
            if missing:
                raise DataError(
                    f'{argument("dataset")} {spec}: {path.name} has no '
                    f'{", ".join(missing)} (it holds '
                    f'{", ".join(npz.files) or "nothing"}); save it with '
                    'numpy.savez(path, x_train=..., y_train=..., '
                    'x_test=..., y_test=...)')
            return tuple(npz[k] for k in NPZ_KEYS)
    except DataError:
        raise
    except ValueError as e:  # object arrays: pickles are refused
        raise DataError(f'{argument("dataset")} {spec}: {e}') from None
    except OSError as e:
        raise DataError(f'{argument("dataset")} {spec}: {path} is not an '
                        f'npz file ({e})') from None


def _call(spec):
    from dasktrain.userspec import theirs
    try:
        function = load_attribute(spec, 'dataset')
    except SpecError as e:
        raise DataError(str(e)) from None
    if not callable(function):
        raise DataError(f'{argument("dataset")} {spec}: it names a '
                        f'{type(function).__name__}, not a function')
    try:
        arrays = function()
    except Exception as e:
        raise DataError(f'{argument("dataset")} {spec}: calling it '
                        f'failed:\n{theirs(e)}') from None
    if not (isinstance(arrays, (tuple, list)) and len(arrays) == 4):
        got = f'{type(arrays).__name__} of {len(arrays)}' if isinstance(
            arrays, (tuple, list)) else type(arrays).__name__
        raise DataError(f'{argument("dataset")} {spec}: it must return '
                        f'(x_train, y_train, x_test, y_test), got {got}')
    return tuple(arrays)


def _lazy(a, name, spec):
    if isinstance(a, da.Array):
        return a
    try:
        a = np.asarray(a)
    except Exception as e:
        raise DataError(f'{argument("dataset")} {spec}: {name} is not an '
                        f'array ({e})') from None
    if a.dtype == object:
        raise DataError(f'{argument("dataset")} {spec}: {name} holds Python '
                        'objects; give a numeric array')
    return da.from_array(a, chunks=(DEFAULT_CHUNK,) + a.shape[1:]
                         if a.ndim else -1)


def _layout(x, name, spec):
    """(images N x C x H x W or the inputs as given, is_image, words)."""
    if x.ndim == 4 and x.shape[1] in (1, 3):
        layout = (x, True, 'N x C x H x W')
    elif x.ndim == 4 and x.shape[3] in (1, 3):
        layout = (x.transpose(0, 3, 1, 2), True,
                  'N x H x W x C, transposed')
    elif x.ndim == 3 and x.shape[1] > 3 and x.shape[2] > 3:
        layout = (x[:, None], True, 'N x H x W, a channel added')
    else:
        return x, False, 'not images'
    if layout[0].dtype != np.uint8 and layout[0].dtype.kind != 'f':
        raise DataError(f'{argument("dataset")} {spec}: {name} looks like '
                        f'images but is {x.dtype}; images must be uint8 or '
                        'float')
    return layout


def from_arrays(name, x_train, y_train, x_test, y_test, train_size=None):
    """A checked :class:`Dataset` of four arrays (see the module)."""
    arrays = {}
    for key, a in zip(NPZ_KEYS, (x_train, y_train, x_test, y_test)):
        arrays[key] = _lazy(a, key, name)
    xs = {}
    for split in ('train', 'test'):
        x, y = arrays[f'x_{split}'], arrays[f'y_{split}']
        if x.ndim == 0 or len(x) == 0:
            raise DataError(f'{argument("dataset")} {name}: x_{split} is '
                            'empty')
        if y.ndim != 1 or len(y) != len(x):
            raise DataError(f'{argument("dataset")} {name}: y_{split} has '
                            f'shape {tuple(y.shape)} for {len(x)} inputs; '
                            'give one label per input')
        if y.dtype.kind not in 'iu':
            raise DataError(f'{argument("dataset")} {name}: y_{split} must '
                            f'hold integer class labels, got {y.dtype}')
        xs[split] = _layout(x, f'x_{split}', name)
    (train, image, layout), (test, _, _) = xs['train'], xs['test']
    if train.shape[1:] != test.shape[1:]:
        raise DataError(f'{argument("dataset")} {name}: x_train inputs are '
                        f'{tuple(train.shape[1:])} but x_test inputs '
                        f'{tuple(test.shape[1:])}')
    n = min(train_size or len(train), len(train))
    checks = {'y_train': arrays['y_train'], 'y_test': arrays['y_test']}
    for split, x in (('train', train), ('test', test)):
        if x.dtype.kind == 'f':
            checks[f'bad_{split}'] = (~da.isfinite(x)).sum()
    if image:
        sample = train[:n].astype(np.float64)
        checks['mean'] = sample.mean(axis=(0, 2, 3))
        checks['std'] = sample.std(axis=(0, 2, 3))
    found = dict(zip(checks, dask.compute(*checks.values(),
                                          scheduler='threads')))
    for split in ('train', 'test'):
        if found.get(f'bad_{split}', 0):
            raise DataError(f'{argument("dataset")} {name}: x_{split} '
                            f'holds {found[f"bad_{split}"]} NaN or inf '
                            'values; clean them first')
    labels = found['y_train']
    if labels.min() < 0:
        raise DataError(f'{argument("dataset")} {name}: y_train holds '
                        f'label {labels.min()}; labels are 0..K-1')
    k = int(labels.max()) + 1
    test_labels = found['y_test']
    if test_labels.min() < 0 or test_labels.max() >= k:
        bad = test_labels[(test_labels < 0) | (test_labels >= k)][0]
        raise DataError(f'{argument("dataset")} {name}: y_test holds label '
                        f'{bad}, outside 0..{k - 1} (the classes y_train '
                        'holds)')
    mean = std = None
    if image:
        mean = tuple(float(v) for v in found['mean'])
        std = tuple(max(float(v), 1e-6) for v in found['std'])
    return Dataset(name, train, da.from_array(labels.astype(np.int32)),
                   test, da.from_array(test_labels.astype(np.int32)), k,
                   image, mean, std, layout)
