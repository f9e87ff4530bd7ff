"""What a double-buffered dg step does while its sum travels: the
``stale`` recipes, in one place.

With double buffering (:mod:`~dasktrain.parallel.exchange.gradients`) the job's
mean gradient of a step arrives one step late. :class:`StaleSteps` holds the
recipe a run chose and calls into its pieces at the points of a step:

- ``'corrected'`` (the default, :mod:`~dasktrain.parallel.stale.correction`):
  every replica keeps its own gradient before the replicas are merged,
  and updates itself with it plus the late mean in place of its last one,
  faded in after an exact warm-up; an epoch's end averages the replicas.
- ``'predicted'`` (:mod:`~dasktrain.parallel.stale.prediction`): the forward
  and backward passes of a step whose sum will land one update late run at
  the weights one update ahead; the master applies the late mean.
- ``'plain'``: the master applies the late mean, as ChainerMN does.

Owns the choice and the calls; the maths is in those modules, the
exchange's and the update's in :mod:`~dasktrain.parallel.exchange.gradients`
and :mod:`~dasktrain.parallel.gradient`. Without double buffering (or in
ipm) every method does nothing.
"""
import contextlib

from dasktrain.parallel.stale.correction import LocalCorrection, fade_in
from dasktrain.parallel.stale.prediction import WeightPrediction

RECIPES = ('corrected', 'predicted', 'plain')


def check_recipe(stale):
    """Validate GPUDistributedGradient's ``stale`` option."""
    if stale not in RECIPES:
        raise ValueError(f"stale must be one of {', '.join(RECIPES)}, got "
                         f'{stale!r}')
    return stale


class StaleSteps:
    """The recipe ``recipe`` (one of :data:`RECIPES`, or None: no double
    buffering) for the replicas ``group`` whose sums ``exchange`` carries.
    """

    def __init__(self, group, exchange, recipe):
        self.exchange, self.recipe = exchange, recipe
        self.ahead = WeightPrediction(group, recipe == 'predicted')
        self.local = LocalCorrection(group) if recipe == 'corrected' \
            else None

    @property
    def own_optimizers(self):
        """Whether every replica updates itself with its own optimizer."""
        return self.local is not None

    def corrected(self, iteration):
        """Whether the step of ``iteration`` is a corrected one."""
        return self.local is not None and self.exchange.stale(iteration)

    def shifted(self, iteration):
        """Around a step's forward and backward passes: the weights one
        update ahead where that update lands late (predicted)."""
        if self.recipe != 'predicted':
            return contextlib.nullcontext(False)
        return self.ahead.shifted(self.exchange.stale(iteration) and
                                  self.exchange.pending)

    def keep(self, iteration, sizes, total):
        """After the backward passes, before the replicas' gradients are
        merged: each replica's own (corrected)."""
        if self.corrected(iteration):
            self.local.keep(sizes, total)

    def update(self, iteration, optimizers, summed):
        """A corrected step's updates, after the exchange handed back
        ``summed`` (None on a first stale step)."""
        self.local.update(
            optimizers, None if summed is None else self.exchange.grads(),
            fade_in(iteration, self.exchange.stale_from))

    def before_master_update(self):
        """The master is about to apply a sum alone (an exact step, or a
        late one): prediction saves the weights it moves from; the other
        replicas' optimizers fall behind the master's."""
        self.ahead.before_update()
        if self.local is not None:
            self.local.master_moved()

    def end_epoch(self, apply, average):
        """At an epoch's end, once the sum in flight arrived: after
        corrected steps ``average()`` the replicas (their mean has taken
        that sum already), else ``apply()`` it. Then what a resumed run
        cannot know is forgotten, so it continues as an uninterrupted one.
        """
        if self.local is not None and self.local.active:
            self.local.forget()
            average()
        else:
            apply()
        self.ahead.forget()
