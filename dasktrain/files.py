"""Files written atomically: a reader sees the old file or the new one,
never half of either, and a failed write leaves nothing behind; a log
opened for writing never through a symlink (:func:`open_for_writing`);
files read from a place someone else controls (:func:`read_regular`:
never through a symlink, never a FIFO, only a regular file of the owner
expected), decoded a chunk at a time (:func:`decode_upto`), and JSON
read with bounds on its size and its nesting (:func:`read_json`,
:func:`loads_bounded`), whatever the file holds: a reader fails in one
line (``OSError`` or ``ValueError``), never with a ``RecursionError``,
never blocked, never out of memory. And where the checkout's own
folders are (``data/``, ``runs/``), from anywhere."""
import codecs
import collections
import errno
import json
import os
import re
import stat
import tempfile
import threading
import time
from pathlib import Path

# Read once: os.umask can only be read by setting it.
_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write(path, write, mode=None):
    """Call ``write(file)`` on a temp file beside ``path``, then rename;
    the file gets ``mode`` (default: what ``open`` would give)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f'.{path.name}.', dir=path.parent)
    try:
        # mkstemp's 0600 would hide results; secrets ask for it.
        os.chmod(tmp, 0o666 & ~_UMASK if mode is None else mode)
        with os.fdopen(fd, 'wb') as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path, obj, indent=4, mode=None):
    atomic_write(path, lambda f: f.write(
        json.dumps(obj, indent=indent).encode() + b'\n'), mode=mode)


def open_for_writing(path):
    """``path`` open for binary writing, made if missing (``0666`` less
    the umask) and emptied, never through a symlink at its last
    component (OSError ELOOP where one was planted: a log written
    through ``rank0.log -> ~/.bashrc`` would overwrite it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, 'wb')


def read_regular(path, owner=None, offset=0, limit=None):
    """The bytes of ``path`` from ``offset`` (at most ``limit``), only if
    it is a regular file and, where ``owner`` (a uid) is given, that
    user's: never through a symlink at its last component (a user may
    plant ``out/log -> /etc/shadow`` where root reads), never blocking on
    a FIFO. OSError otherwise (ELOOP for a symlink, EINVAL for another
    kind of file, EPERM for another owner).

    Examples
    --------
    >>> read_regular('/etc/hostname', owner=0)  # doctest: +SKIP
    b'gpu-server\\n'
    """
    fd = _open_regular(path, owner)
    try:
        return _read_fd(fd, offset, limit)
    finally:
        os.close(fd)


def _open_regular(path, owner):
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK |
                 os.O_CLOEXEC)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise OSError(errno.EINVAL, 'not a regular file', str(path))
        if owner is not None and found.st_uid != owner:
            raise OSError(errno.EPERM, f'owned by uid {found.st_uid}, not '
                          f'{owner}', str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_fd(fd, offset, limit):
    if offset:
        os.lseek(fd, offset, os.SEEK_SET)
    chunks, left = [], limit
    while left is None or left > 0:
        chunk = os.read(fd, 1 << 20 if left is None else min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left = None if left is None else left - len(chunk)
    return b''.join(chunks)


MAX_JSON = 1 << 20  # bytes of a JSON file read by default
MAX_DEPTH = 16      # nesting of a JSON file read by default
# A JSON string (escapes included), and the bytes that are not brackets.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b'[]{}')
# ... and the brackets as steps of the depth: +1 for [ {, -1 for ] }
_STEPS = bytes(1 if chr(b) in '[{' else 255 if chr(b) in ']}' else 0
               for b in range(256))


def nests_within(data, depth):
    """Whether the arrays and objects of JSON ``data`` (bytes), strings
    aside, nest at most ``depth`` deep, counted without decoding (nothing
    recurses): a running sum over the brackets, in NumPy.

    >>> nests_within(b'[{"a": "[[["}, [1]]', 2)
    True
    >>> nests_within(b'[' * 100000 + b']' * 100000, 16)
    False
    """
    import numpy as np
    steps = _STRING.sub(b'', data).translate(_STEPS, _NOT_BRACKETS)
    if not steps:
        return True
    return int(np.frombuffer(steps, np.int8).cumsum(dtype=np.int32).max()
               ) <= depth


def loads_bounded(data, limit=MAX_JSON, depth=MAX_DEPTH, name='the file'):
    """The JSON value in ``data`` (bytes), if it is at most ``limit`` bytes
    and nests at most ``depth`` deep; ValueError in one line naming
    ``name`` otherwise (too large, too deep, not UTF-8, not JSON).

    >>> loads_bounded(b'{"a": [1, 2]}')
    {'a': [1, 2]}
    >>> loads_bounded(b'[' * 100000 + b']' * 100000, name='out/log')
    Traceback (most recent call last):
    ...
    ValueError: out/log nests more than 16 deep, or is not JSON
    """
    if len(data) > limit:
        raise ValueError(f'{name} is over {_size(limit)}')
    if not nests_within(data, depth):
        raise ValueError(f'{name} nests more than {depth} deep, or is not '
                         'JSON')
    try:
        return json.loads(data.decode('utf-8'))
    except UnicodeDecodeError:
        raise ValueError(f'{name} is not UTF-8 text') from None
    except (ValueError, RecursionError) as e:  # ints of 5,000 digits too
        raise ValueError(f'{name} is not valid JSON ({str(e)[:200]})'
                         ) from None


def _size(n):
    return f'{n / 2 ** 20:g} MiB' if n >= 2 ** 20 else f'{n:,} bytes'


class _Parsed:
    """The values :func:`read_json` decoded, by path and by what ``fstat``
    said of the file (a file replaced, even at the same size, is read
    again); the least recently used go first."""

    def __init__(self, entries=20000):
        self.entries, self.found = entries, collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, key, seen):
        with self.lock:
            hit = self.found.get(key)
            if hit is None or hit[0] != seen:
                return None
            self.found.move_to_end(key)
            return hit[1]

    def recent(self, key, seconds):
        with self.lock:
            hit = self.found.get(key)
            if hit is None or time.monotonic() - hit[2] > seconds:
                return None
            return hit[1]

    def put(self, key, seen, value):
        with self.lock:
            self.found[key] = (seen, value, time.monotonic())
            self.found.move_to_end(key)
            while len(self.found) > self.entries:
                self.found.popitem(last=False)


_parsed = _Parsed()


def _seen(found):
    return (found.st_ino, found.st_dev, found.st_size, found.st_mtime_ns,
            found.st_ctime_ns)


def read_json(path, owner=None, limit=MAX_JSON, depth=MAX_DEPTH,
              cached=False, stale=0.0):
    """The JSON value in the file ``path``, read as :func:`read_regular`
    reads (no symlink, no FIFO, only ``owner``'s where given: OSError)
    and decoded by :func:`loads_bounded` (ValueError).

    With ``cached``, a file unchanged since this process last decoded it
    (same inode, size and times) is not read again: the value is shared,
    so a caller copies before changing it; with ``stale`` (seconds), a
    value decoded less than that long ago is not even looked at again
    (a file someone rewrites every second costs one decoding per
    ``stale`` seconds).

    Examples
    --------
    >>> read_json('job.json', limit=2 ** 20, depth=8)  # doctest: +SKIP
    {'id': 'r20-...', ...}
    """
    name = Path(path).name
    key = (str(path), owner, limit, depth)
    if cached and stale > 0:
        value = _parsed.recent(key, stale)
        if value is not None:
            return value
    if cached:
        try:
            found = os.lstat(path)
        except OSError:
            found = None
        if found is not None and stat.S_ISREG(found.st_mode):
            value = _parsed.get(key, _seen(found))
            if value is not None:
                return value
    fd = _open_regular(path, owner)
    try:
        found = os.fstat(fd)
        data = _read_fd(fd, 0, limit + 1)
    finally:
        os.close(fd)
    value = loads_bounded(data, limit, depth, name)
    if cached:
        _parsed.put(key, _seen(found), value)
    return value


def decode_upto(data, offset):
    """``(text, offset + bytes decoded)`` of UTF-8 ``data`` read at
    ``offset``, leaving a character cut at its end for the next read.

    >>> decode_upto('é'.encode()[:1], 10), decode_upto(b'ok', 10)
    (('', 10), ('ok', 12))
    """
    decoder = codecs.getincrementaldecoder('utf-8')('replace')
    text = decoder.decode(data, final=False)
    left = len(decoder.getstate()[0])
    return text, offset + len(data) - left


def _is_checkout(folder):
    return (folder / 'pyproject.toml').is_file() and \
        (folder / 'dasktrain' / '__init__.py').is_file()


def repository_path(*parts):
    """An absolute path in the dasktrain checkout, whatever the working
    directory: ``repository_path('data')`` is where ``make train`` keeps
    CIFAR-10 also for a notebook, whose kernel runs in ``notebooks/``.

    The checkout is the nearest folder at or above the working directory
    that holds dasktrain's ``pyproject.toml``, else the one dasktrain is
    imported from (an editable install); without either, the working
    directory.
    """
    here = Path.cwd()
    package = Path(__file__).resolve().parents[1]
    root = next((f for f in (here, *here.parents) if _is_checkout(f)),
                package if _is_checkout(package) else here)
    return root.joinpath(*parts)
