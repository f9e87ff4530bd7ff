"""Files written atomically: a reader sees the old file or the new one,
never half of either, and a failed write leaves nothing behind."""
import json
import os
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


def write_json(path, obj, indent=4):
    atomic_write(path, lambda f: f.write(
        json.dumps(obj, indent=indent).encode() + b'\n'))
