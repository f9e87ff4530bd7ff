"""Fetch and unpack the CIFAR-10 (or CIFAR-100) archive: resumable,
verified, safe.

The archive is streamed to a ``.part`` file (resumed with an HTTP Range
request after a break), its MD5 checked, and only then renamed into place;
members are checked before extraction into a temporary folder that is
renamed into place when complete.
"""
import contextlib
import dataclasses
import errno
import hashlib
import os
import shutil
import socket
import ssl
import tarfile
import tempfile
import time
import zlib
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import requests
import urllib3.exceptions
from requests.adapters import HTTPAdapter

# The plain bar: tqdm.auto wants ipywidgets in a notebook and warns without.
from tqdm import tqdm
from urllib3.util.retry import Retry

from dasktrain.errors import DataError, argument

CIFAR10_URL = 'https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz'
CIFAR10_MD5 = 'c58f30108f718f92721af3b95e74349a'
URL_ENV = 'DASKTRAIN_CIFAR10_URL'
MD5_ENV = 'DASKTRAIN_CIFAR10_MD5'
ARCHIVE_NAME = 'cifar-10-python.tar.gz'
BATCHES_DIR = 'cifar-10-batches-py'


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one of the Toronto archives comes from and what it holds."""
    title: str
    url: str
    md5: str
    url_env: str
    md5_env: str
    archive: str
    folder: str


CIFAR10 = Source('CIFAR-10', CIFAR10_URL, CIFAR10_MD5, URL_ENV, MD5_ENV,
                 ARCHIVE_NAME, BATCHES_DIR)
CIFAR100 = Source('CIFAR-100',
                  'https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz',
                  'eb9058c3a382ffc7106e4002c42a8d85',
                  'DASKTRAIN_CIFAR100_URL', 'DASKTRAIN_CIFAR100_MD5',
                  'cifar-100-python.tar.gz', 'cifar-100-python')


def _mirror_hint(source=CIFAR10, mirror=None):
    """What to do after a failed download: name a mirror, or, where one
    was named, check it."""
    if mirror:
        return (f'check the mirror ({argument("url")} or '
                f'${source.url_env}), or put {source.archive} into the '
                'data dir')
    return (f'use a mirror ({argument("url")}, or ${source.url_env}) or put '
            f'{source.archive} into the data dir')

_CHUNK = 1 << 16


def download_cifar10(data_dir='data', url=None, md5=None, *, retries=5,
                     backoff=0.5, timeout=30.0, progress=True,
                     source=CIFAR10):
    """Make sure ``data_dir`` holds extracted CIFAR-10 (or ``source``'s
    archive) and return its folder.

    An extracted ``cifar-10-batches-py/`` or a ``cifar-10-python.tar.gz``
    already in ``data_dir`` is used without any network. Otherwise the
    archive is streamed to a ``.part`` file (resumed with an HTTP Range
    request when one is left from an interrupted run), verified and only
    then renamed into place.

    Parameters
    ----------
    data_dir : str or Path, default 'data'
        Cache folder; created if missing.
    url : str, optional
        Where to fetch the archive. Default: ``$DASKTRAIN_CIFAR10_URL``, else
        the official Toronto URL.
    md5 : str, optional
        Expected MD5 of the archive, for a mirror serving another file.
        Default: ``$DASKTRAIN_CIFAR10_MD5``, else the official archive's
        ``c58f30108f718f92721af3b95e74349a``.
    retries : int, default 5
        Attempts for connection failures, 5xx answers and broken streams.
    backoff : float, default 0.5
        Seconds of the first back-off; each retry doubles it.
    timeout : float, default 30.0
        Seconds to wait for the server to connect or send more bytes.
    progress : bool, default True
        Show a tqdm progress bar.
    source : Source, default CIFAR10
        The archive: :data:`CIFAR100` fetches CIFAR-100 the same way
        (``$DASKTRAIN_CIFAR100_URL``, ``cifar-100-python/``).

    Returns
    -------
    Path
        ``data_dir / 'cifar-10-batches-py'``.

    Examples
    --------
    >>> mirror = 'http://mirror.lab/cifar-10-python.tar.gz'
    >>> download_cifar10('data', url=mirror)  # doctest: +SKIP
    PosixPath('data/cifar-10-batches-py')
    """
    if retries < 0:
        raise ValueError(f'retries must be >= 0, got {retries!r}')
    data_dir = Path(data_dir)
    batches = data_dir / source.folder
    if batches.is_dir():  # nothing to write: a read-only folder is fine
        return batches
    made = not data_dir.exists()
    _make_dir(data_dir)
    try:
        return _download(data_dir, url, md5, retries, backoff, timeout,
                         progress, source)
    except BaseException:
        if made:  # a failed first download leaves no empty folder behind
            with contextlib.suppress(OSError):
                data_dir.rmdir()
        raise


def _download(data_dir, url, md5, retries, backoff, timeout, progress,
              source):
    batches = data_dir / source.folder
    archive = data_dir / source.archive
    # Something else in the place of either: say so, before any download.
    if batches.exists() or batches.is_symlink():  # and not a folder
        raise DataError(f'{batches} is not a folder; move it away, or put '
                        f'the extracted {source.title} folder there')
    if (archive.exists() or archive.is_symlink()) and not archive.is_file():
        raise DataError(f'{archive} is not a file; move it away, or put the '
                        f'{source.title} archive there')
    md5 = (md5 or os.environ.get(source.md5_env) or source.md5).lower()
    if archive.exists():
        got = _md5sum(archive)
        if got != md5:
            raise DataError(
                f'{archive}: MD5 {got} does not match the expected {md5}; '
                'delete the file to download it again, or pass '
                f'{argument("md5")} (or set {source.md5_env}) if it comes '
                'from a mirror with another archive')
    else:
        mirror = url or os.environ.get(source.url_env)
        _fetch(mirror or source.url, archive, md5, retries=retries,
               backoff=backoff, timeout=timeout, progress=progress,
               source=source, mirror=mirror)
    extract_archive(archive, data_dir, source)
    return batches


def _make_dir(path):
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix='.probe-')
        probe.close()
    except OSError as e:
        raise DataError(f'data dir {path} is not writable ({e.strerror}); '
                        f'pass {argument("data_dir")} with a folder you can '
                        'write to'
                        ) from None


def _md5sum(path):
    digest = hashlib.md5()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            digest.update(block)
    return digest.hexdigest()


def _session(retries, backoff):
    # urllib3 retries connection failures and 5xx answers before any byte of
    # the body arrives; _fetch itself resumes streams that break later.
    retry = Retry(total=retries, connect=retries, read=retries,
                  status=retries, backoff_factor=backoff,
                  status_forcelist=(429, 500, 502, 503, 504),
                  allowed_methods=frozenset({'GET'}), raise_on_status=True)
    session = requests.Session()
    session.mount('http://', HTTPAdapter(max_retries=retry))
    session.mount('https://', HTTPAdapter(max_retries=retry))
    return session


class _BrokenStream(Exception):
    pass


def _fetch(url, dest, md5, *, retries, backoff, timeout, progress,
           source=CIFAR10, mirror=None):
    part = dest.with_name(dest.name + '.part')
    with _session(retries, backoff) as session:
        for attempt in range(retries + 1):
            try:
                _stream_once(session, url, part, timeout, progress, source,
                             mirror)
                break
            except _BrokenStream as e:
                failure = e
            if attempt < retries:
                time.sleep(backoff * 2 ** attempt)
        else:
            raise DataError(f'download of {url} kept breaking off '
                            f'({failure}); {_mirror_hint(source, mirror)}')
    got = _md5sum(part)
    if got != md5:
        part.unlink()
        raise DataError(f'{url}: MD5 {got} does not match the expected {md5}; '
                        f'the file was removed. Pass {argument("md5")} (or '
                        f'set {source.md5_env}) if the mirror serves another '
                        'archive on purpose')
    os.replace(part, dest)


def _stream_once(session, url, part, timeout, progress, source=CIFAR10,
                 mirror=None):
    """Append the rest of ``url`` to ``part``; raise _BrokenStream to retry."""
    offset = part.stat().st_size if part.exists() else 0
    headers = {'Range': f'bytes={offset}-'} if offset else {}
    try:
        response = session.get(url, stream=True, timeout=timeout,
                               headers=headers)
    except requests.RequestException as e:
        raise DataError(f'cannot download {url}: {_reason(e, url, timeout)}; '
                        f'{_mirror_hint(source, mirror)}') from None
    with response:
        if response.status_code == 416:  # the .part is not a prefix we know
            part.unlink()
            raise _BrokenStream('server refused to resume; starting over')
        if response.status_code >= 400:
            raise DataError(f'cannot download {url} (HTTP '
                            f'{response.status_code} {response.reason}); '
                            f'{_mirror_hint(source, mirror)}')
        resumed = (offset and response.status_code == 206 and
                   response.headers.get('Content-Range', '')
                   .startswith(f'bytes {offset}-'))
        if not resumed:
            offset = 0
        length = response.headers.get('Content-Length')
        total = offset + int(length) if length and length.isdigit() else None
        written = offset
        # Keep the bytes of a body cut short (urllib3 would drop them with an
        # IncompleteRead); the length check below catches the short read.
        response.raw.enforce_content_length = False
        with open(part, 'ab' if resumed else 'wb') as f, \
                tqdm(total=total, initial=offset, unit='B', unit_scale=True,
                     desc=source.archive, disable=not progress) as bar:
            try:
                for block in response.iter_content(_CHUNK):
                    f.write(block)
                    written += len(block)
                    bar.update(len(block))
            except requests.RequestException as e:
                raise _BrokenStream(_reason(e, url, timeout)) from None
        if total is not None and written != total:
            raise _BrokenStream(f'got {written} of {total} bytes')


def _causes(error):
    """``error`` and every exception it wraps (urllib3 nests them in
    ``args``, ``reason``, ``__cause__`` and ``__context__``)."""
    seen, todo = [], [error]
    while todo:
        e = todo.pop(0)
        if isinstance(e, BaseException) and all(e is not s for s in seen):
            seen.append(e)
            todo += [*e.args, getattr(e, 'reason', None), e.__cause__,
                     e.__context__]
    return seen


def _reason(error, url, timeout):
    """What failed, in words, for a requests/urllib3 error (whose own text
    nests the reprs of four exceptions)."""
    parts = urlsplit(url)
    host = parts.hostname or url
    where = f'{host}:{parts.port}' if parts.port else host
    x = urllib3.exceptions
    causes = _causes(error)
    # Most specific first: urllib3's NewConnectionError (and its
    # NameResolutionError) subclass ConnectTimeoutError.
    rules = [
        ((x.NameResolutionError, socket.gaierror),
         f'the name {host} cannot be resolved (offline, or no DNS)'),
        (ConnectionRefusedError,
         f'{where} refused the connection'),
        ((x.ProxyError,),
         'the HTTP proxy failed (see $https_proxy and $http_proxy)'),
        ((ssl.SSLError, x.SSLError),
         f'the TLS handshake with {host} failed'),
        (lambda e: isinstance(e, OSError) and e.errno in (
            errno.ENETUNREACH, errno.EHOSTUNREACH),
         f'{where} is unreachable (no route: offline?)'),
        (lambda e: isinstance(e, (x.ConnectTimeoutError, x.ReadTimeoutError,
                                  socket.timeout))
         and not isinstance(e, x.NewConnectionError),
         f'{where} did not answer within {timeout:g} s'),
        ((x.ProtocolError,), f'the connection to {where} broke off'),
    ]
    for test, words in rules:
        check = test if callable(test) and not isinstance(test, type) \
            else (lambda e, kinds=test: isinstance(e, kinds))
        if any(check(e) for e in causes):
            return words
    for e in causes:
        if isinstance(e, x.ResponseError):  # 'too many 503 error responses'
            return f'the server kept failing ({e})'
    innermost = causes[-1]
    text = str(innermost).splitlines()[0] if str(innermost) else ''
    return f'{type(innermost).__name__}: {text[:80]}'.rstrip(': ')


# --------------------------------------------------------------------------
# extraction

def _refusal(member):
    """Why ``member`` may not be extracted, or None."""
    path = PurePosixPath(member.name)
    if member.name.startswith(('/', '\\')) or path.is_absolute():
        return 'absolute path'
    if '..' in path.parts:
        return 'path leaves the target folder'
    if member.issym() or member.islnk():
        return 'links are not allowed'
    if not (member.isfile() or member.isdir()):
        return 'only regular files and folders are allowed'
    return None


def extract_archive(archive, data_dir, source=CIFAR10):
    """Extract ``source``'s folder (``cifar-10-batches-py/``) from
    ``archive`` into ``data_dir``.

    Every member is checked first: absolute paths, ``..``, links and device
    files are refused. Extraction goes to a temporary folder that is renamed
    into place only when complete.
    """
    archive, data_dir = Path(archive), Path(data_dir)
    target = data_dir / source.folder
    scratch = Path(tempfile.mkdtemp(prefix='.extract-', dir=data_dir))
    try:
        try:
            with tarfile.open(archive, 'r:*') as tar:
                members = tar.getmembers()
                for member in members:
                    reason = _refusal(member)
                    if reason:
                        raise DataError(
                            f'{archive}: refusing member {member.name!r} '
                            f'({reason}); this is not a {source.title} '
                            'archive')
                if hasattr(tarfile, 'data_filter'):
                    tar.extractall(scratch, members, filter='data')
                else:  # Python < 3.10.12: the checks above stand in
                    tar.extractall(scratch, members)
        except (tarfile.TarError, EOFError, zlib.error) as e:
            # tarfile lists every compression it tried, a line each: the
            # gzip one tells.
            lines = [line.strip('- ') for line in str(e).splitlines()]
            reason = next((line for line in lines if 'method gz' in line),
                          lines[0] if lines else type(e).__name__)
            size = archive.stat().st_size
            raise DataError(f'{archive} ({size} bytes) is corrupt or '
                            f'truncated ({reason}); delete it and download '
                            'again') from None
        if not (scratch / source.folder).is_dir():
            raise DataError(f'{archive} has no {source.folder}/ folder; '
                            f'this is not the {source.title} python archive')
        os.replace(scratch / source.folder, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
