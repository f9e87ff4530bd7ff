"""What a run shows while it trains: :class:`Progress`.

A tqdm bar per epoch on a terminal, one line per finished epoch, and the
run's few lines for the user (where it trains, a warning). The caller
chooses the display (``progress=True`` shows it); the loop only reports
to it, so the same loop runs under a command, in a notebook, or as a rank
whose display is the driver's (:mod:`dasktrain.run.train` relays it).

Owns the display; may not touch files.
"""
import logging
import math
import sys
import time

# plain tqdm: tqdm.auto warns in a notebook without ipywidgets
from tqdm import tqdm

logger = logging.getLogger(__name__)


def describe_devices(devices, named=True):
    """One line naming the devices a run trains on; ``named``: the user
    named them (else a CPU run says that no GPU was found).

    Examples
    --------
    >>> describe_devices(['@cupy:0', '@cupy:1'])
    'training on 2 GPUs: @cupy:0, @cupy:1'
    >>> describe_devices(['@numpy'], named=False)
    'training on the CPU, 1 replica (@numpy); no GPU found'
    """
    devices = [str(d) for d in devices]
    gpus = [d for d in devices if d.startswith('@cupy')]
    if gpus:
        return (f'training on {len(gpus)} GPU{"s" * (len(gpus) > 1)}: '
                f'{", ".join(gpus)}')
    n = len(devices)
    return (f'training on the CPU, {n} replica{"s" * (n > 1)} (@numpy)'
            f'{"; no GPU found" if not named else ""}')


class Progress:
    """The display of a run: a tqdm bar on a terminal, a plain line per
    epoch elsewhere, nothing when not ``enabled`` (but warnings).

    Parameters
    ----------
    enabled : bool
        Show the run (the CLI's ``--no-progress`` turns it off).
    total_epochs : int
        The run's epochs, for "epoch 3/10".

    Examples
    --------
    >>> progress = Progress(True, total_epochs=2)
    >>> progress.say('training on the CPU, 1 replica (@numpy)')
    training on the CPU, 1 replica (@numpy)
    """

    def __init__(self, enabled, total_epochs):
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.total_epochs = total_epochs
        self.bar = None
        self.began = None  # monotonic time of this session's first epoch
        self.ended = 0  # epochs ended in this session

    def say(self, line):
        """One line for the user on stdout (where the run trains), when
        the display is on."""
        if self.enabled:
            print(line, file=sys.stdout, flush=True)

    def warn(self, line):
        """A warning for the user, shown even without the display: logged
        (the CLI shows the ``dasktrain`` logger's lines on stderr)."""
        logger.warning(line)

    def start(self, epoch, iterations):
        """Epoch ``epoch`` (from 0) of ``iterations`` steps begins."""
        if self.began is None:
            self.began = time.monotonic()
        if self.tty:
            self.bar = tqdm(total=iterations, leave=False, unit='it',
                            desc=f'epoch {epoch + 1}/{self.total_epochs}')

    def step(self, loss, accuracy, done=None):
        """A step ended, with the loss and accuracy last read (nan until
        the first read); ``done``: the steps of the epoch done so far,
        where steps are reported in jumps (relayed from a rank)."""
        if self.bar is not None:
            if done is not None:
                self.bar.n = done - 1
            self.bar.update()
            if math.isfinite(loss):
                self.bar.set_postfix(loss=f'{loss:.4f}',
                                     acc=f'{accuracy:.4f}')

    def end(self, row):
        """The epoch ended with log row ``row``: one line, with the time
        the run still needs from the first epoch on."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.ended += 1
        left = None
        if self.began is not None and self.total_epochs:
            per_epoch = (time.monotonic() - self.began) / self.ended
            left = per_epoch * max(self.total_epochs - row['epoch'], 0)
        if self.enabled:
            tqdm.write(
                f"epoch {row['epoch']:>3}/{self.total_epochs}  "
                f"loss {row['main/loss']:.4f}  acc {row['main/accuracy']:.4f}"
                f"  val/loss {row['validation/main/loss']:.4f}  val/acc "
                f"{row['validation/main/accuracy']:.4f}  "
                f"{row['images_per_sec']:,.0f} img/s  "
                f"{row['elapsed_time']:.1f}s{eta(left)}", file=sys.stdout)


def eta(seconds):
    """``'  ETA 3m20s'`` for a run with ``seconds`` left, ``''`` for none.

    >>> eta(200.4), eta(4000), eta(12), eta(0), eta(None)
    ('  ETA 3m20s', '  ETA 1h06m', '  ETA 12s', '', '')
    """
    if not seconds or seconds < 0.5:
        return ''
    s = round(seconds)
    if s >= 3600:
        return f'  ETA {s // 3600}h{s % 3600 // 60:02d}m'
    if s >= 60:
        return f'  ETA {s // 60}m{s % 60:02d}s'
    return f'  ETA {s}s'
