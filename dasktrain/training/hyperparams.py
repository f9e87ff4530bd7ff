"""The optimizer hyperparameters a command may change:
:class:`Hyperparameters`, in a run's words (``lr`` is the run's learning
rate: Adam's ``alpha``, as ``--lr`` is), checked before any changes.

Owns what an ``adjust_hyperparams`` request may ask and the values it may
take; when it acts is :mod:`~dasktrain.training.steering`'s.
"""
import json
import math

from dasktrain.training.commandfile import Refused

# Hyperparameters whose values lie in [0, 1), > 0 or >= 0; others: finite.
_FRACTIONS = ('momentum', 'beta1', 'beta2', 'beta', 'rho', 'alpha')
_POSITIVE = ('eps', 'eta', 'final_lr')
_NON_NEGATIVE = ('weight_decay_rate',)


class Hyperparameters:
    """The optimizer hyperparameters an ``adjust_hyperparams`` request may
    change, in the run's words: the optimizer's own float hyperparameters
    (``optimizer.hyperparam``) and ``lr``, the run's learning rate (Adam's
    ``alpha``, as ``--lr`` is). A change applies to every optimizer of the
    run (one per replica in ipm).

    Parameters
    ----------
    optimizers : sequence of chainer.Optimizer
        The run's, the master's first; they share their hyperparameters.

    Examples
    --------
    >>> import chainer
    >>> hp = Hyperparameters([chainer.optimizers.Adam(alpha=0.001)])
    >>> hp.check({'hyperparam': {'lr': 0.01, 'beta1': None}})
    {'lr': 0.01}
    >>> hp.check({'hyperparam': {'momentum': 0.5}})
    Traceback (most recent call last):
    ...
    dasktrain.training.commandfile.Refused: this run's optimizer is Adam, \
which has no momentum; it takes lr (its alpha), alpha, beta1, beta2, eps, \
eta, weight_decay_rate
    """

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)
        master = self.optimizers[0]
        self.name = type(master).__name__
        values = master.hyperparam.get_dict()
        # Floats, but AdaBound's (final_lr, gamma: Adam's, unused unless
        # adabound): what a request may change.
        self.native = [k for k, v in values.items()
                       if isinstance(v, (int, float)) and
                       not isinstance(v, bool) and
                       k not in ('final_lr', 'gamma')]
        self.rate = 'lr' if 'lr' in values else \
            'alpha' if 'alpha' in values else None

    def _native(self, name):
        return self.rate if name == 'lr' else name

    def names(self):
        """The names a request may use, in words."""
        names = list(self.native)
        if self.rate not in (None, 'lr'):
            names.insert(0, f'lr (its {self.rate})')
        return ', '.join(names)

    def values(self):
        """The values in force, by the names a request may use."""
        values = self.optimizers[0].hyperparam.get_dict()
        found = {k: values[k] for k in self.native}
        if self.rate is not None:
            found['lr'] = values[self.rate]
        return found

    def check(self, body):
        """``{name: value}`` that ``body`` (``adjust_hyperparams``'s)
        asks to change, in the run's words (``lr`` for the learning rate);
        Refused with the reason for a request the run cannot do. Values
        given as null are not changed (ChainerUI's form sends its empty
        fields so)."""
        if not isinstance(body, dict) or \
                not isinstance(body.get('hyperparam'), dict):
            raise Refused('its body must be {"optimizer": NAME, '
                          '"hyperparam": {"lr": 0.01, ...}}')
        asked = {k: v for k, v in body['hyperparam'].items()
                 if v is not None}
        named = body.get('optimizer')
        other = named is not None and named != self.name
        changes = {}
        for name, value in asked.items():
            native = self._native(name)
            if native is None or native not in self.native:
                raise Refused(f"this run's optimizer is {self.name}, "
                              f'which has no {name}; it takes '
                              f'{self.names()}')
            if other and name != 'lr':
                raise Refused(f"this run's optimizer is {self.name}, not "
                              f'{named}: only lr, the learning rate every '
                              f'run has, applies across optimizers')
            changes['lr' if native == self.rate else name] = \
                _checked(name if native != self.rate else 'lr', value)
        if not changes:
            raise Refused(f'it asks for no change; give a value for one of '
                          f'{self.names()}')
        return changes

    def apply(self, changes):
        """Set ``changes`` (as :meth:`check` returns them) on every
        optimizer; the values in force before, by the same names."""
        before = self.values()
        for optimizer in self.optimizers:
            for name, value in changes.items():
                setattr(optimizer.hyperparam, self._native(name), value)
        return {k: before[k] for k in changes}

    def answer(self):
        """The response body ChainerUI shows ("last value" of each)."""
        return {'optimizer': self.name, 'hyperparam': self.values()}


def _checked(name, value):
    """``value`` for the hyperparameter ``name``, or Refused naming both.

    >>> _checked('momentum', 0.5), _checked('lr', 1)
    (0.5, 1.0)
    >>> _checked('lr', 0)
    Traceback (most recent call last):
    ...
    dasktrain.training.commandfile.Refused: lr must be a finite number > 0, \
got 0
    """
    def wrong(expected):
        return Refused(f'{name} must be {expected}, got {json.dumps(value)}')
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        raise wrong('a finite number')
    if name in _FRACTIONS and not 0 <= value < 1:
        raise wrong('a number in [0, 1)')
    if (name == 'lr' or name in _POSITIVE) and not value > 0:
        raise wrong('a finite number > 0')
    if name in _NON_NEGATIVE and value < 0:
        raise wrong('a number >= 0')
    return float(value)
