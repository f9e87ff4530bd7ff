"""CIFAR-10 on Dask: lazy arrays of the batch files, read safely.

The archive (fetched by :mod:`dasktrain.data.download`, re-exported here) holds
six Python 2 pickles, five training batches and one test batch, plus
``batches.meta``. Pickles can run code when loaded, so they are read with
an unpickler that knows only what a CIFAR batch holds.
"""
import dataclasses
import io
import os
import pickle
from pathlib import Path

import dask
import dask.array as da
import numpy as np

# Re-exported: dasktrain.data is where users look for the whole data layer.
from dasktrain.data.download import (
    ARCHIVE_NAME,
    BATCHES_DIR,
    CIFAR10_MD5,
    CIFAR10_URL,
    URL_ENV,
    download_cifar10,
    extract_archive,
)

__all__ = ['ARCHIVE_NAME', 'BATCHES_DIR', 'CIFAR10', 'CIFAR10_MD5',
           'CIFAR10_URL', 'DataError', 'URL_ENV', 'download_cifar10',
           'extract_archive', 'load_cifar10']
from dasktrain.errors import DataError, argument

TRAIN_BATCHES = tuple(f'data_batch_{i}' for i in range(1, 6))
TEST_BATCH = 'test_batch'
META_FILE = 'batches.meta'
NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)


@dataclasses.dataclass(frozen=True)
class CIFAR10:
    """CIFAR-10 as lazy dask arrays, one chunk per batch file.

    Images are uint8 of shape (N, 3, 32, 32); labels are int32 in 0..9.
    """
    train_images: da.Array
    train_labels: da.Array
    test_images: da.Array
    test_labels: da.Array
    label_names: tuple


# --------------------------------------------------------------------------
# safe pickle loading

def _numpy_reconstruct():
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


_ALLOWED_GLOBALS = {
    ('numpy.core.multiarray', '_reconstruct'): _numpy_reconstruct,
    ('numpy._core.multiarray', '_reconstruct'): _numpy_reconstruct,
    ('numpy', 'ndarray'): lambda: np.ndarray,
    ('numpy', 'dtype'): lambda: np.dtype,
}


class _Refused(pickle.UnpicklingError):
    pass


class _BatchUnpickler(pickle.Unpickler):
    """Allows NumPy array reconstruction and plain containers, nothing else."""

    def find_class(self, module, name):
        factory = _ALLOWED_GLOBALS.get((module, name))
        if factory is None:
            raise _Refused(
                f'refusing to load {module}.{name}; a CIFAR batch holds only '
                'NumPy arrays, lists, ints and strings')
        return factory()


class _SkipPayloads(io.RawIOBase):
    """A file view that skips large payloads, for reading a batch's metadata.

    The image bytes of a batch are one large string in the pickle stream;
    returning zeros instead of reading them gives the array's shape and the
    labels without touching the disk for the pixels.
    """
    _LARGE = 1 << 20

    def __init__(self, f):
        self._f = f
        self._size = os.fstat(f.fileno()).st_size

    def readable(self):
        return True

    def readinto(self, buffer):
        n = len(buffer)
        if n >= self._LARGE and self._f.tell() + n <= self._size:
            self._f.seek(n, os.SEEK_CUR)
            return n  # contents left as allocated: ignored by the caller
        return self._f.readinto(buffer)

    def read(self, n=-1):
        if n is not None and n >= self._LARGE and \
                self._f.tell() + n <= self._size:
            self._f.seek(n, os.SEEK_CUR)
            return bytes(n)
        return self._f.read(n)

    def readline(self, size=-1):
        return self._f.readline(size)


def _text(value):
    return value.decode('latin-1') if isinstance(value, bytes) else value


def _unpickle(path, skip_pixels=False):
    """Load one batch file into a dict with str keys; DataError if unusable."""
    hint = (f'delete {path.parent} and run `dasktrain download` again to '
            're-extract it')
    if not path.is_file():
        raise DataError(f'missing batch file {path}; {hint}')
    try:
        with open(path, 'rb') as raw:
            source = _SkipPayloads(raw) if skip_pixels else raw
            obj = _BatchUnpickler(source, encoding='bytes').load()
    except _Refused as e:
        raise DataError(f'{path}: {e}; {hint}') from None
    except Exception as e:  # any other failure means a corrupt pickle
        raise DataError(f'{path} is not a valid CIFAR pickle '
                        f'({type(e).__name__}: {e}); {hint}') from None
    if not isinstance(obj, dict):
        raise DataError(f'{path} holds a {type(obj).__name__}, not a CIFAR '
                        f'batch dict; {hint}')
    return {_text(k): v for k, v in obj.items()}


def _batch_arrays(path, skip_pixels=False, label_key='labels',
                  classes=NUM_CLASSES):
    """Validated (images (N, 3, 32, 32) uint8, labels (N,) int32) of a
    batch (CIFAR-100's: ``label_key`` 'fine_labels', 100 ``classes``)."""
    batch = _unpickle(path, skip_pixels)
    for key in ('data', label_key):
        if key not in batch:
            raise DataError(f'{path} has no {key!r} entry; it is not a '
                            'CIFAR batch file')
    data = batch['data']
    size = int(np.prod(IMAGE_SHAPE))
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or \
            data.ndim != 2 or data.shape[1] != size:
        shape = getattr(data, 'shape', None)
        dtype = getattr(data, 'dtype', type(data).__name__)
        raise DataError(f'{path}: data must be a uint8 array of shape '
                        f'(N, {size}), got {dtype} {shape}')
    try:
        labels = np.asarray(batch[label_key], dtype=np.int64)
    except (TypeError, ValueError):
        raise DataError(f'{path}: labels must be a list of ints') from None
    if labels.shape != (len(data),):
        raise DataError(f'{path}: {labels.size} labels for {len(data)} '
                        'images; they must match one to one')
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise DataError(f'{path}: labels must lie in 0..{classes - 1}, '
                        f'found {labels.min()}..{labels.max()}')
    return data.reshape((-1,) + IMAGE_SHAPE), labels.astype(np.int32)


def _load_images(path, count, label_key='labels', classes=NUM_CLASSES):
    """Task body: read one batch file's images (the only pixel read)."""
    images, _ = _batch_arrays(Path(path), False, label_key, classes)
    if len(images) != count:
        raise DataError(f'{path} changed while in use: it held {count} '
                        f'images and now holds {len(images)}')
    return images


def _lazy_split(batches_dir, names, label_key='labels',
                classes=NUM_CLASSES):
    """Images and labels of several batch files as dask arrays."""
    images, labels = [], []
    for name in names:
        path = batches_dir / name
        _, meta_labels = _batch_arrays(path, True, label_key, classes)
        count = len(meta_labels)
        token = dask.base.tokenize(str(path.resolve()),
                                   path.stat().st_mtime_ns)
        task = dask.delayed(_load_images, pure=True)(
            str(path), count, label_key, classes,
            dask_key_name=f'cifar-{name}-{token}')
        images.append(da.from_delayed(task, (count,) + IMAGE_SHAPE,
                                      dtype=np.uint8,
                                      name=f'cifar-images-{name}-{token}'))
        labels.append(da.from_array(meta_labels, chunks=count,
                                    name=f'cifar-labels-{name}-{token}'))
    return da.concatenate(images), da.concatenate(labels)


def load_cifar10(data_dir='data', download=True, url=None, md5=None):
    """CIFAR-10 as lazy dask arrays, downloading it first if needed.

    Only the labels and array headers are read here; the pixels of each
    batch file are read by one task when the arrays are computed.

    Parameters
    ----------
    data_dir : str or Path, default 'data'
        Folder holding ``cifar-10-batches-py/`` or the archive.
    download : bool, default True
        Fetch and extract the archive when ``data_dir`` lacks it.
    url, md5 : str, optional
        Passed to :func:`download_cifar10`.

    Returns
    -------
    CIFAR10

    Examples
    --------
    >>> cifar = load_cifar10('data')  # doctest: +SKIP
    >>> cifar.train_images
    dask.array<concatenate, shape=(50000, 3, 32, 32), dtype=uint8, ...>
    """
    data_dir = Path(data_dir)
    batches = data_dir / BATCHES_DIR
    if download:
        batches = download_cifar10(data_dir, url=url, md5=md5)
    elif not batches.is_dir():
        raise DataError(f'{batches} not found; run `dasktrain download '
                        f'{argument("data_dir")} {data_dir}` or pass '
                        'download=True')
    meta = _unpickle(batches / META_FILE)
    names = meta.get('label_names')
    if not isinstance(names, list) or len(names) != NUM_CLASSES:
        raise DataError(f'{batches / META_FILE} must list {NUM_CLASSES} '
                        'label_names; it is not a CIFAR-10 meta file')
    train_images, train_labels = _lazy_split(batches, TRAIN_BATCHES)
    test_images, test_labels = _lazy_split(batches, (TEST_BATCH,))
    return CIFAR10(train_images, train_labels, test_images, test_labels,
                   tuple(_text(n) for n in names))


def load_cifar100(data_dir='data', download=True, url=None, md5=None,
                  label_set='fine'):
    """CIFAR-100 as lazy dask arrays ``(train images, train labels, test
    images, test labels)``, downloading it first if needed (the Toronto
    archive, MD5-checked; ``$DASKTRAIN_CIFAR100_URL`` for a mirror), read
    as safely as CIFAR-10. ``label_set``: the 100 'fine' classes or the 20
    'coarse' ones."""
    from dasktrain.data.download import CIFAR100
    data_dir = Path(data_dir)
    folder = data_dir / CIFAR100.folder
    if download:
        folder = download_cifar10(data_dir, url=url, md5=md5,
                                  source=CIFAR100)
    elif not folder.is_dir():
        raise DataError(f'{folder} not found; run `dasktrain download '
                        f'{argument("dataset")} cifar100` first')
    key, classes = (('fine_labels', 100) if label_set == 'fine' else
                    ('coarse_labels', 20))
    train = _lazy_split(folder, ('train',), key, classes)
    test = _lazy_split(folder, ('test',), key, classes)
    return train + test
