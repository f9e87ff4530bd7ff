"""The built-in sample (``--dataset sample``): real images shipped inside
the package, for a first run where CIFAR-10 cannot be had.

``fashion_sample.npz`` beside this module holds 4,000 training and 1,000
test images of Fashion-MNIST (Zalando's 28 x 28 grey photographs of 10
kinds of clothing; MIT licence, ``fashion_sample.LICENSE``), 400 (100) of
each class. :func:`load_sample` hands them over as CIFAR-10 is: uint8
``N x 3 x 32 x 32`` (the grey value in all three channels, a 2-pixel black
border), so every built-in network and augmentation takes them unchanged.

:func:`cifar10_unavailable` says why CIFAR-10 cannot be had here (not in
the data folder, no mirror named, the official host unreachable), which
``dasktrain train`` turns into a run on the sample instead of a stop.

Owns the sample and the decision to fall back to it; reading CIFAR is
:mod:`~dasktrain.data.cifar`'s, fetching it
:mod:`~dasktrain.data.download`'s.
"""
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from dasktrain.data.download import ARCHIVE_NAME, BATCHES_DIR, CIFAR10_URL
from dasktrain.data.download import URL_ENV as CIFAR10_URL_ENV

SAMPLE = 'sample'
SAMPLE_FILE = Path(__file__).with_name('fashion_sample.npz')
LABEL_NAMES = ('T-shirt/top', 'trouser', 'pullover', 'dress', 'coat',
               'sandal', 'shirt', 'sneaker', 'bag', 'ankle boot')
PAD = 2  # 28 + 2 * 2 = 32, CIFAR's side


def as_cifar_images(grey):
    """``N x 28 x 28`` grey uint8 images as ``N x 3 x 32 x 32``: the grey
    value in each channel, ``PAD`` black pixels around.

    >>> as_cifar_images(np.full((2, 28, 28), 7, np.uint8)).shape
    (2, 3, 32, 32)
    """
    grey = np.pad(grey, ((0, 0), (PAD, PAD), (PAD, PAD)))
    return np.repeat(grey[:, None], 3, axis=1)


def load_sample():
    """``(x_train, y_train, x_test, y_test)`` of the sample: images uint8
    ``N x 3 x 32 x 32``, labels int32 in ``0..9`` (:data:`LABEL_NAMES`).

    Examples
    --------
    >>> x_train, y_train, x_test, y_test = load_sample()
    >>> x_train.shape, x_test.shape, int(y_train.max())
    ((4000, 3, 32, 32), (1000, 3, 32, 32), 9)
    """
    with np.load(SAMPLE_FILE, allow_pickle=False) as npz:
        return (as_cifar_images(npz['x_train']),
                npz['y_train'].astype(np.int32),
                as_cifar_images(npz['x_test']),
                npz['y_test'].astype(np.int32))


def reachable(url, timeout=3.0):
    """None if a TCP connection to ``url``'s host opens within
    ``timeout`` seconds (name lookup included), else why not, in words."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == 'https' else 80)
    found = {}

    def probe():
        try:
            socket.create_connection((parts.hostname, port),
                                     timeout=timeout).close()
            found['ok'] = True
        except socket.gaierror:
            found['why'] = (f'the name {parts.hostname} cannot be resolved '
                            '(offline, or no DNS)')
        except OSError as e:
            found['why'] = f'{parts.hostname}:{port}: {e.strerror or e}'

    # getaddrinfo takes no timeout: the lookup runs in a thread let go.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    if found.get('ok'):
        return None
    return found.get('why', f'{parts.hostname}:{port} did not answer '
                            f'within {timeout:g} s')


def cifar10_unavailable(data_dir='data', url=None, env=None, probe=None):
    """Why CIFAR-10 cannot be had for a run that did not ask for it by
    name, or None when it can (or when a mirror was named: its failure is
    the user's to see).

    CIFAR-10 can be had when ``data_dir`` holds it (extracted or the
    archive), when a mirror is named (``url``, ``$DASKTRAIN_CIFAR10_URL``
    in ``env``), or when the official host answers ``probe(url)`` (default
    :func:`reachable`: a TCP connection within 3 s).

    Examples
    --------
    >>> cifar10_unavailable('/nowhere', env={}, probe=lambda url: 'offline')
    'CIFAR-10 is not in /nowhere and offline'
    >>> cifar10_unavailable('/nowhere', env={}, probe=lambda url: None)
    >>> cifar10_unavailable('/nowhere', url='http://mirror.lab/c.tgz',
    ...                     env={}, probe=lambda url: 'offline')
    """
    env = os.environ if env is None else env
    data_dir = Path(data_dir)
    if (data_dir / BATCHES_DIR).is_dir() or \
            (data_dir / ARCHIVE_NAME).is_file():
        return None
    if url or env.get(CIFAR10_URL_ENV):
        return None
    why = (probe or reachable)(CIFAR10_URL)
    if why is None:
        return None
    return f'CIFAR-10 is not in {data_dir} and {why}'


def fallback_line(why, data_dir='data'):
    """The first line of a run on the sample instead of CIFAR-10: why, and
    how to get the real set.

    >>> fallback_line('CIFAR-10 is not in data and offline')[:60]
    'CIFAR-10 is not in data and offline: training on the built-i'
    """
    return (f'{why}: training on the built-in sample instead (4,000 '
            'Fashion-MNIST images, --dataset sample). For CIFAR-10, copy '
            f'{ARCHIVE_NAME} into {data_dir}/ or name a mirror (--url, or '
            f'${CIFAR10_URL_ENV}), then run again')
