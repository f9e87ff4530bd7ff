"""A run's files of weights: the checkpoint it resumes from and the model
files it leaves (``model_best.npz``, ``model_final.npz``).

The checkpoint holds every replica and optimizer of the job and the
loop's state (epoch, log, elapsed time, early stopping) in one npz that
rank 0 writes atomically; it never holds pickled objects, so a checkpoint
someone handed over cannot run code. :func:`prepare_out` holds the run's
folder and refuses to overwrite a run without ``resume``.

Owns the files' format; may not touch the loop (what goes in the state
is the loop's).
"""
import contextlib
import json
import os
import shutil
import tempfile

import chainer
import numpy as np
from chainer.serializers import DictionarySerializer

from dasktrain.errors import UserError, argument
from dasktrain.files import atomic_write
from dasktrain.training.models import read_npz
from dasktrain.training.outdir import check_free, claim

CHECKPOINT = 'checkpoint.npz'

# Models and checkpoints are stored uncompressed: float weights hardly
# compress, and zlib would cost seconds per epoch for the seed's network
# (5.5M parameters, three copies with Adam's moments).


def save_model(path, link):
    """Write ``link``'s parameters to the npz ``path``, atomically
    (readable by :func:`dasktrain.load_model`)."""
    atomic_write(path, lambda f: chainer.serializers.save_npz(
        f, link, compression=False))


def save_checkpoint(path, model, state):
    """Every replica and optimizer of the job plus the loop's ``state``
    (JSON-able), in one npz written by rank 0. In a multi-process ipm job
    the other groups' replicas are gathered to it (in dg they equal rank
    0's); every rank must call it."""
    serializer = DictionarySerializer()
    model.serialize(serializer['model'])
    arrays = serializer.target
    if model.comm.size > 1 and model.mode == 'ipm':
        parts = model.comm.gather(arrays)
        if parts is None:
            return
        arrays = {k: v for part in parts for k, v in part.items()}
    elif model.comm.rank != 0:
        return
    arrays['state'] = np.array(json.dumps(state))
    atomic_write(path, lambda f: np.savez(f, **arrays))


def keep_as(path, other):
    """``other`` becomes the file ``path`` is (a hard link where the
    filesystem makes one, else a copy), atomically: a snapshot that is
    also the checkpoint ``--resume`` continues from."""
    other = os.fspath(other)
    fd, tmp = tempfile.mkstemp(prefix=f'.{os.path.basename(other)}.',
                               dir=os.path.dirname(other) or '.')
    os.close(fd)
    try:
        os.unlink(tmp)
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)
        os.replace(tmp, other)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load_checkpoint(path, model, what='this run'):
    """Restore ``model`` from the checkpoint ``path``; return the loop's
    state. A file that is not a checkpoint of ``what`` is one UserError,
    and kept."""
    with read_npz(path, what) as npz:
        model.restore(npz, 'model/')
        return json.loads(str(npz['state']))


@contextlib.contextmanager
def prepare_out(config):
    """Hold ``config.out`` for the run (see
    :func:`dasktrain.training.outdir.claim`): created, writable, locked;
    removed again if this run created it and fails before its first
    checkpoint. Refuses to overwrite a run without ``config.resume``."""
    with claim(config.out, keep=lambda out: (out / CHECKPOINT).exists()) \
            as out:
        _refuse_another(out, config.resume)
        yield out


def check_out(out, resume):
    """Refuse (UserError, one line) what :func:`prepare_out` would refuse
    of ``out`` now, before a command says anything else: another run's,
    or holding a run and not ``resume``d."""
    check_free(out)
    _refuse_another(out, resume)


def _refuse_another(out, resume):
    if os.path.exists(os.path.join(out, CHECKPOINT)) and not resume:
        raise UserError(f'{out} already holds a run ({CHECKPOINT}); pass '
                        f'{argument("resume")} to continue it, or choose '
                        f'another {argument("out")}')
