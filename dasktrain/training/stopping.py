"""Early stopping: when a run stops before its last epoch.

Chainer's EarlyStoppingTrigger rule on the log's rows; its state (best
value, epochs without improvement) goes in the checkpoint, so a resumed
run stops where an uninterrupted one would.

Owns the rule; may not touch the loop or files.
"""
import math

from dasktrain.config import IPM_KEYS, LOG_KEYS, better
from dasktrain.errors import UserError, argument


class EarlyStopping:
    """Stop once ``monitor`` has not improved for ``patience`` checks.

    ``mode`` 'max' or 'min' says which way it improves; 'auto' reads it
    off the key's name (accuracies: max, losses: min) and refuses any
    other key rather than guess. ``best`` and ``count`` restore the state
    of :meth:`state`.

    Examples
    --------
    >>> stopper = EarlyStopping('main/loss', patience=1)
    >>> stopper.update({'main/loss': 0.5}), stopper.update({'main/loss': 0.7})
    (False, True)
    """

    def __init__(self, monitor, patience, best=None, count=0, mode='auto'):
        self.monitor, self.patience = monitor, patience
        keys = LOG_KEYS + IPM_KEYS
        if monitor not in keys:
            raise UserError(f'{argument("early_stop_monitor")} {monitor} is '
                            f'not in the log; choose one of {", ".join(keys)}')
        mode = better(monitor) if mode == 'auto' else mode
        if mode is None:
            raise UserError(f'{argument("early_stop_monitor")} {monitor}: '
                            'whether it '
                            'improves up or down is not in its name; pass '
                            f'{argument("early_stop_mode")} max or min')
        self.maximize = mode == 'max'
        self.best = best if best is not None else \
            (-math.inf if self.maximize else math.inf)
        self.count = count

    def improved(self, value):
        return value > self.best if self.maximize else value < self.best

    def update(self, row):
        """Record an epoch's row; True when training should stop."""
        if self.monitor not in row:
            raise UserError(f'early_stop_monitor {self.monitor!r} is not in '
                            f'the log; choose one of {", ".join(row)}')
        value = row[self.monitor]
        if self.improved(value):
            self.best, self.count = value, 0
        else:
            self.count += 1
        return self.stopped()

    def stopped(self):
        """Whether ``patience`` checks in a row brought no improvement (also
        true of the state of a run that stopped early, restored)."""
        return self.patience is not None and self.count >= self.patience

    def state(self):
        return {'best': self.best, 'count': self.count}
