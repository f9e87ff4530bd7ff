"""Files written atomically: a reader sees the old file or the new one,
never half of either, and a failed write leaves nothing behind; files
read from a place someone else controls (:func:`read_regular`: never
through a symlink, never a FIFO, only a regular file of the owner
expected), and decoded a chunk at a time (:func:`decode_upto`). And
where the checkout's own folders are (``data/``, ``runs/``), from
anywhere."""
import codecs
import errno
import json
import os
import stat
import tempfile
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
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK |
                 os.O_CLOEXEC)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise OSError(errno.EINVAL, 'not a regular file', str(path))
        if owner is not None and found.st_uid != owner:
            raise OSError(errno.EPERM, f'owned by uid {found.st_uid}, not '
                          f'{owner}', str(path))
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        chunks, left = [], limit
        while left is None or left > 0:
            chunk = os.read(fd, 1 << 20 if left is None else
                            min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left = None if left is None else left - len(chunk)
        return b''.join(chunks)
    finally:
        os.close(fd)


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
