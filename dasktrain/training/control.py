"""What a running run does for the commands it is sent
(:class:`RunControl`): change the optimizers' hyperparameters, write a
checkpoint as a snapshot, stop after a final one; when each acts, the same
on every rank, is :mod:`~dasktrain.training.steering`'s.

A snapshot or a stop within an epoch is a checkpoint there: the epoch's
sums so far and where it stands go in it (``partial``), a gradient in
flight (double buffering) is applied first, and the replicas' random
streams start again from (seed, epoch, iteration) (:func:`reseed`), in
the run as in any run resumed from it, so that ``resume`` continues it bit
for bit. A hyperparameter changed by request is in force until changed
again: in the log's rows, in ``OUT/args``'s history ``steered``, and in
the checkpoint, whose values a resumed run takes back (unless given
another ``lr`` then).

Owns those actions; the loop (:mod:`~dasktrain.training.loop`) calls
them between its steps and at each epoch's end.
"""
import time

import numpy as np

from dasktrain.errors import argument, plural
from dasktrain.training.checkpoint import CHECKPOINT, keep_as, save_checkpoint
from dasktrain.training.commandfile import FAILURE, SUCCESS, snapshot_name
from dasktrain.training.hyperparams import Hyperparameters
from dasktrain.training.outdir import record_steering
from dasktrain.training.steering import Steering


def reseed(seed, model, epoch, iteration):
    """At a checkpoint within an epoch: NumPy's global RNG and the
    replicas' streams start again from (seed, epoch, iteration), in the
    run that writes it and in a run resumed from it (a GPU's stream cannot
    be saved), so that both go on alike."""
    derived = int(np.random.SeedSequence(
        [seed, epoch, iteration, 0x57ee]).generate_state(1)[0])
    np.random.seed(int(np.random.SeedSequence(  # as seed_everything
        [derived, epoch]).generate_state(1)[0]))
    model.seed(derived, epoch)


class RunControl:
    """What the run does for each command of ``OUT/commands``
    (:mod:`~dasktrain.training.steering` decides when, the same on every
    rank): change the optimizers' hyperparameters, write a checkpoint as
    a snapshot, stop after a final one. ``state``: the loop's (its
    ``hyperparams`` in force, changed by request, are kept here);
    ``started``: the run's clock (``time.perf_counter``)."""

    def __init__(self, config, model, out, state, progress, started):
        self.config, self.model, self.out = config, model, out
        self.state, self.progress, self.started = state, progress, started
        self.lead = model.comm.rank == 0
        self.hyper = Hyperparameters(model.optimizers)
        # Double buffering's ranks have a sum in flight between steps: no
        # collective of ours there.
        self.steer = Steering(out, model.comm, self.hyper.check,
                              progress.warn,
                              between_steps=not config.double_buffering)
        self.stop = None  # {'epoch', 'iteration'} once stopped by request
        state.setdefault('hyperparams', {})
        state['lr_configured'] = config.learning_rate

    def __enter__(self):
        """Apply the hyperparameters in force at the checkpoint (those
        changed by request), unless the run is given another ``lr`` now;
        tell ChainerUI the run takes commands."""
        kept = dict(self.state['hyperparams'])
        configured = self.state.pop('lr_configured_before', None)
        if 'lr' in kept and configured not in (None,
                                               self.config.learning_rate):
            del kept['lr']  # given anew: that wins
            if self.lead:
                self.progress.warn(
                    f'{argument("lr")} {self.config.learning_rate:g} given '
                    'now replaces the lr set by request '
                    f"({self.state['hyperparams']['lr']:g})")
            self.state['hyperparams'].pop('lr')
        if kept:
            self.hyper.apply(kept)
            if self.lead:
                self.progress.warn(
                    'resuming with what was set by request: ' +
                    ', '.join(f'{k} {v:g}' for k, v in kept.items()))
        self.steer.start()
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is not None:  # ended by an error: ChainerUI is told
            self.steer.stopped()
        return False

    def due(self, iteration):
        return self.steer.due(iteration)

    def elapsed(self):
        return time.perf_counter() - self.started

    def poll(self, epoch, so_far=None, boundary=True):
        """Carry out what is due after ``epoch`` completed epochs;
        ``so_far``: within an epoch, a callable returning the epoch's
        state so far (for a checkpoint here); ``boundary``: at an epoch's
        end or the run's start (else between two steps). True once
        stopped."""
        model, iteration = self.model, self.model.iteration
        actions = self.steer.poll(epoch, iteration, self.elapsed(),
                                  boundary)
        if not actions:
            return False
        where = f'epoch {epoch + 1}, iteration {iteration}' if so_far \
            else f'after epoch {epoch}, iteration {iteration}'
        partial = None
        if so_far is not None and any(a.name != 'adjust_hyperparams'
                                      for a in actions):
            if self.config.double_buffering:
                model.flush()  # no step in flight in a checkpoint
            partial = so_far()
            reseed(self.config.seed, model, epoch, iteration)
        stops = []
        for action in actions:
            if action.name == 'adjust_hyperparams':
                before = self.hyper.apply(action.changes)
                self.state['hyperparams'].update(action.changes)
                if self.lead:
                    record_steering(self.out, epoch, iteration,
                                    action.changes)
                    self.progress.warn(f'{where}: ' + ', '.join(
                        f'{k} {before[k]:g} -> {v:g}'
                        for k, v in action.changes.items()) +
                        ', by request')
                self.steer.answer(action, SUCCESS, {
                    **self.hyper.answer(),
                    'changed': {k: [before[k], v]
                                for k, v in action.changes.items()}},
                    epoch, iteration, self.elapsed())
            elif action.name == 'take_snapshot':
                path = self.out / snapshot_name(iteration)
                status, body = self._checkpoint(path, epoch, partial)
                if self.lead and status == SUCCESS:
                    self.progress.warn(f'{where}: snapshot {path}, by '
                                       'request')
                self.steer.answer(action, status, body, epoch, iteration,
                                  self.elapsed())
            else:
                stops.append(action)
        if not stops:
            return False
        path = self.out / CHECKPOINT
        status, body = self._checkpoint(path, epoch, partial)
        self.stop = {'epoch': epoch, 'iteration': iteration,
                     'checkpoint': str(path), 'saved': status == SUCCESS}
        if self.lead:
            self.progress.warn(f'{where}: stopping by request; '
                               + (f'final checkpoint {path}'
                                  if status == SUCCESS else
                                  body['message']))
        for action in stops:
            self.steer.answer(action, SUCCESS, {**body, 'stopped': True}
                              if status == SUCCESS else body, epoch,
                              iteration, self.elapsed())
        return True

    def _checkpoint(self, path, epoch, partial):
        """A checkpoint of the run now at ``path`` (every rank takes
        part), which ``OUT/checkpoint.npz`` then is too; (status, the
        response's body)."""
        state = {**self.state, 'partial': partial}
        if partial is not None:
            state['elapsed'] = self.elapsed()
        try:
            save_checkpoint(path, self.model, state)
            if self.lead and path.name != CHECKPOINT:
                keep_as(path, self.out / CHECKPOINT)
        except OSError as e:  # a full disk: the run goes on
            reason = f'cannot write {path} ({e.strerror or e})'
            if self.lead:
                self.progress.warn(f'warning: {reason}')
            return FAILURE, {'message': reason}
        return SUCCESS, {'path': str(path), 'epoch': epoch,
                         'iteration': self.model.iteration,
                         'within_epoch': partial is not None}

    def finish(self, stopped_early, epochs):
        """The run ended: the commands still waiting are answered."""
        done = self.state['epoch']
        why = ('stopped by request' if self.stop else
               'early stopping' if stopped_early else
               f'its {plural(epochs, "epoch")} done')
        self.steer.finish(done if not self.stop else self.stop['epoch'],
                          self.model.iteration, why, self.elapsed())
