"""Files written atomically: a reader sees the old file or the new one,
never half of either, and a failed write leaves nothing behind. And where
the checkout's own folders are (``data/``, ``runs/``), from anywhere."""
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
