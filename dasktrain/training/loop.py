"""THE per-rank training loop: :func:`run`.

One rank trains its replicas (a
:class:`~dasktrain.parallel.gradient.GPUDistributedGradient` on its
devices) on their shards of CIFAR-10. Every epoch: train on freshly
augmented data (prefetched while the previous epoch trained), evaluate on
the rank's share of the test set, sum the metrics over the ranks (every
rank computes the same log row), append the row to ``OUT/log`` (Chainer
LogReport JSON, readable by ChainerUI), write a checkpoint atomically.
All randomness is a function of (seed, epoch), so ``resume`` ends exactly
where an uninterrupted run would.

Between its steps and at each epoch's end it carries out the commands
ChainerUI or ``dasktrain ctl`` sent (:mod:`~dasktrain.training.control`),
and goes on from a checkpoint written within an epoch.

Owns the epochs, the metrics, early stopping and the log rows; may not
decide where it runs (which process, which devices, how many ranks:
:mod:`dasktrain.run.train` decides, and calls :func:`run` on every rank).
"""
import dataclasses
import itertools
import json
import math
import time
import warnings
from pathlib import Path

import chainer
import numpy as np

from dasktrain.data.datasets import load_dataset
from dasktrain.data.loader import EpochLoader
from dasktrain.errors import UserError, argument
from dasktrain.files import write_json
from dasktrain.numerics import computing
from dasktrain.parallel.comm import Solo
from dasktrain.parallel.devices import resolve_devices, synchronize
from dasktrain.parallel.gpus import gpu_ids
from dasktrain.parallel.gradient import GPUDistributedGradient
from dasktrain.parallel.placement import default_bucket_mb, default_devices
from dasktrain.training.checkpoint import (
    CHECKPOINT,
    load_checkpoint,
    save_checkpoint,
    save_model,
)
from dasktrain.training.control import RunControl, reseed
from dasktrain.training.evaluate import evaluate, load_test_share
from dasktrain.training.hyperparams import Hyperparameters
from dasktrain.training.metrics import EpochSums
from dasktrain.training.models import check_built_in, get_model
from dasktrain.training.outdir import record_args
from dasktrain.training.progress import Progress, describe_devices
from dasktrain.training.stopping import EarlyStopping

# Steps between reads of the loss to the host: each read waits for the
# GPUs, which would otherwise run ahead of Python. A non-finite loss is
# caught at the next read.
READ_EVERY = 10


class TrainingDiverged(UserError):
    """The loss stopped being finite."""


def make_optimizer(config):
    """The optimizer ``config.optimizer`` names, at ``config.learning_rate``
    (Adam's alpha; momentum SGD with momentum 0.9). Under ``dtype``
    mixed16, Chainer's dynamic loss scaling (``loss_scaling()``: the loss
    scaled up before the backward pass, each gradient divided back before
    its update, a step whose gradients overflowed skipped and the scale
    halved) and float32 master weights in the update
    (``use_fp32_update()``: a float16 weight would lose every step smaller
    than its last bit)."""
    if config.optimizer == 'adam':
        optimizer = chainer.optimizers.Adam(alpha=config.learning_rate)
    else:
        optimizer = chainer.optimizers.MomentumSGD(lr=config.learning_rate,
                                                   momentum=0.9)
    if config.dtype == 'mixed16':
        optimizer.loss_scaling()
        optimizer.use_fp32_update()
        # A step skipped for an overflow is the scaling at work: Chainer
        # warns for every parameter of it, a burst of lines each time.
        warnings.filterwarnings('ignore', category=UserWarning,
                                message='Non finite number found in param')
    return optimizer


def seed_everything(seed, epoch):
    """Seed NumPy's global RNG from (seed, epoch), for anything drawing from
    it besides the replicas (whose dropout streams ``model.seed`` sets): a
    resumed run re-derives it instead of storing it."""
    state = np.random.SeedSequence([seed, epoch]).generate_state(1)[0]
    np.random.seed(int(state))


def run(config, comm=None, devices=None, callbacks=(), progress=None):
    """Train as ``config`` says: the loop of one rank; return the summary.

    Parameters
    ----------
    config : TrainConfig
        The run; ``config.out`` must be held already
        (:func:`~dasktrain.training.checkpoint.prepare_out`).
    comm : communicator, optional
        This rank's, in a job across processes (see
        :mod:`dasktrain.parallel.comm`): the rank reads and augments
        only its replicas' shards of the data and evaluates its share of
        the test set; rank 0 writes the files. Default: a run in this
        process alone, whose data may be computed on the active Dask
        client.
    devices : sequence of str, optional
        This rank's devices; default ``config.devices``, else every GPU,
        else one CPU replica.
    callbacks : sequence of callables, default ()
        Each is called as ``callback(row)`` after an epoch's log row and
        checkpoint are written (e.g. to plot live in a notebook).
    progress : Progress, optional
        The display (:class:`~dasktrain.training.progress.Progress`);
        default none.

    Returns
    -------
    dict
        ``log`` (all rows), ``final`` (the last row, None if no epoch was
        left), ``out``, ``devices``, ``stopped_early`` and
        ``stopped_by_request`` (None, or ``epoch``, ``iteration``,
        ``checkpoint``, ``saved``: a ``stop`` command ended the run).

    Notes
    -----
    The rank computes as ``config`` says (:func:`dasktrain.numerics.
    computing`: ``dtype``, ``tf32``, ``cudnn``, ``deterministic``) for the
    whole run, the model built and every step and evaluation run under it.
    With ``config.deterministic``, Chainer's ``cudnn_deterministic`` is on
    (deterministic convolution algorithms) and the models draw dropout
    masks from each replica's seeded CuPy stream instead of cuDNN's, whose
    state is seeded from ``os.urandom`` (see
    :func:`dasktrain.training.models.dropout`).

    Examples
    --------
    >>> with prepare_out(config):  # doctest: +SKIP
    ...     summary = run(config, progress=Progress(True, config.epochs))
    """
    devices = devices or config.devices or default_devices()
    gpus = gpu_ids(str(d) for d in resolve_devices(devices))
    with computing(config.dtype, config.tf32, config.cudnn,
                   config.deterministic, gpus):
        return _run(config, comm, devices, callbacks,
                    progress or Progress(False, config.epochs))


def _run(config, comm, devices, callbacks, progress):
    # A rank computes in its worker's thread: never on the cluster.
    client = None if comm is None else False
    comm = comm or Solo()
    lead = comm.rank == 0
    out = Path(config.out)
    data = load_dataset(config.dataset, config.data_dir, url=config.url,
                        md5=config.md5, label_set=config.label_set,
                        train_size=config.train_size)
    n_train = min(config.train_size or len(data.train_labels),
                  len(data.train_labels))
    n_test = min(config.test_size or len(data.test_labels),
                 len(data.test_labels))
    check_built_in(config.model, data)
    model = _model(config, comm, devices, data.n_classes)
    if lead and progress.enabled:
        _say_devices(progress, model, named=bool(config.devices))
        if config.dataset != 'cifar10':
            progress.say(data.describe())
        progress.say(data.augmentation_words(config.augment))
    _check(config, model, n_train)
    test = load_test_share(data, n_test, config.tta, comm.rank, comm.size)
    state = _start(config, model, out, lead, data)
    stopper = EarlyStopping(config.early_stop_monitor,
                            config.early_stop_patience,
                            mode=config.early_stop_mode,
                            **state['early_stop'])
    stopped = stopper.stopped()
    partial = state.pop('partial', None)
    # The run's clock, as it stood at its last checkpoint; the data read
    # into memory, not counted.
    with _loader(config, data, n_train, model, client) as loader, \
            RunControl(config, model, out, state, progress, time.perf_counter()
                       - state['elapsed']) as commands:
        if not stopped:
            commands.poll(state['epoch'], partial and (lambda: partial))
        for epoch in range(state['epoch'], state['epoch']
                           if stopped or commands.stop else config.epochs):
            row, evaluated = _epoch(config, model, loader, test, epoch,
                                    progress, commands.started,
                                    (out / CHECKPOINT, state['epoch']),
                                    commands, partial)
            partial = None
            if row is None:  # stopped by request within the epoch
                break
            stopped = stopper.update(row)
            _save(out, model, state, row, stopper, evaluated)
            progress.end(row)
            for callback in callbacks:
                callback(row)
            if stopped or commands.poll(row['epoch']):
                break
        commands.finish(stopped, config.epochs)
    return _finish(model, out, state, stopped, commands.stop)


def _model(config, comm, devices, n_classes=10):
    """The rank's replicas on ``devices``, from rank 0's initial weights,
    with their optimizers."""
    np.random.seed(config.seed)  # the initial weights
    model = GPUDistributedGradient(
        get_model(config.model, n_classes, config.model_args), devices,
        mode=config.mode,
        mix_every=config.mix_every,
        mix_optimizer_state=config.mix_optimizer_state, comm=comm,
        comm_dtype=config.comm_dtype,
        double_buffering=config.double_buffering,
        warmup=config.exact_warmup,
        bucket_mb=default_bucket_mb(devices) if config.bucket_mb is None
        else config.bucket_mb,
        stale=config.stale_steps, type_check=config.type_check)
    model.setup(make_optimizer(config))
    if config.weight_decay:
        model.add_hook(chainer.optimizer_hooks.WeightDecay(
            config.weight_decay))
    return model


def _say_devices(progress, model, named):
    """The devices a run trains on, first thing. (A GPU server whose GPUs
    CuPy cannot use was refused before, unless the CPU was asked for:
    :func:`~dasktrain.parallel.cuda_check.check_gpus_usable`.)"""
    ranks = model.comm.size
    progress.say(describe_devices(model.devices, named) +
                 (f', on each of {ranks} ranks' if ranks > 1 else ''))


def _check(config, model, n_train):
    """What the config asks that this model cannot do, as one UserError."""
    replicas = model.total_replicas
    if replicas > n_train:
        raise UserError(f'{replicas} replicas need at least as many training '
                        f'images, got {argument("train_size")} {n_train}')
    if config.early_stop_monitor == 'drift' and \
            not (model.mode == 'ipm' and replicas > 1):
        raise UserError(f'{argument("early_stop_monitor")} drift needs '
                        f'{argument("mode")} ipm with several replicas; this '
                        f'run has {replicas} in mode {model.mode}')


def _start(config, model, out, lead, data):
    """The loop's state to start from: a new run's, or the checkpoint's
    (restoring ``model``) on resume; rank 0 records the run's args."""
    state = {'epoch': 0, 'log': [], 'elapsed': 0.0,
             'early_stop': {'best': None, 'count': 0}}
    resumed = config.resume and (out / CHECKPOINT).exists()
    if resumed:
        state = load_checkpoint(out / CHECKPOINT, model,
                                f'this run ({argument("model")} '
                                f'{config.model})')
        # The lr the run was given when the checkpoint was written.
        state['lr_configured_before'] = state.pop('lr_configured', None)
    if lead:
        partial = state.get('partial')
        record_args(out, {**json.loads(config.to_json()),
                          'data': data.statistics()},
                    state['epoch'] if resumed else None,
                    model.iteration if partial else None)
    return state


def _loader(config, data, n_train, model, client):
    """The loader of the shards of the first ``n_train`` training inputs
    that the rank's replicas own; ``client``: see :class:`EpochLoader`."""
    return EpochLoader(
        data.train_images[:n_train],
        data.train_labels[:n_train].compute(scheduler='threads'),
        config.batch_size * model.total_replicas, seed=config.seed,
        augment_options=data.augmentation(config.augment),
        normalization=data.normalization(),
        epochs=config.epochs, parts=model.total_replicas,
        own=range(model.offset, model.offset + len(model)), cache=True,
        client=client)


def _epoch(config, model, loader, test, epoch, progress, started, last,
           commands, partial=None):
    """Train and evaluate ``epoch``: its log row, the same on every rank,
    and the link evaluated; (None, None) when stopped by request within
    it. ``test``: (views, labels) of the rank's test images; ``started``:
    when the run began (``time.perf_counter``); ``partial``: where a
    checkpoint within the epoch left it."""
    if partial is not None:  # ipm's mixes of the epoch before it
        model.drifts.extend(partial['drifts'])
    mixes = len(model.drifts) - len(partial['drifts'] if partial else ())
    sums = _train_epoch(config, model, loader, epoch, progress, last,
                        commands, mixes, partial)
    if sums is None:
        return None, None
    evaluators = model.evaluators()
    views, labels = test
    loss, accuracy = evaluate(evaluators, views, labels,
                              max(100, config.batch_size))
    sums.val_loss = loss * len(labels)
    sums.val_accuracy = accuracy * len(labels)
    sums.val_images = len(labels)
    if model.comm.rank == 0:
        sums.elapsed = time.perf_counter() - started
    row = _row(config, model, sums.summed(model.comm), epoch,
               model.drifts[mixes:], commands)
    return row, evaluators[0][0]


def _train_epoch(config, model, loader, epoch, progress, last, commands,
                 mixes, partial=None):
    """Train ``epoch``; its training sums (loss, accuracy, images, times),
    or None when stopped by request within it. ``last``: (checkpoint
    path, its epoch), named if the loss diverges; ``mixes``: ipm's before
    the epoch; ``partial``: where a checkpoint within the epoch left it,
    to go on from."""
    seed_everything(config.seed, epoch)
    model.seed(config.seed, epoch)
    first, sums = 0, EpochSums()
    if partial is not None:
        first, sums = partial['step'], EpochSums(**partial['sums'])
        reseed(config.seed, model, epoch, model.iteration)
    comm_before, began = model.comm_time, time.perf_counter()
    step_totals = loader.step_totals()
    progress.start(epoch, len(loader))
    loss = accuracy = math.nan

    def read():
        """The loss and accuracy since the last read, into the sums."""
        ls, acs, seen = model.take_metrics()
        sums.loss, sums.accuracy, sums.images = (
            sums.loss + ls, sums.accuracy + acs, sums.images + seen)
        if not math.isfinite(ls):
            raise _diverged(config, model, epoch, ls / (seen or 1), *last)
        return ls / (seen or 1), acs / (seen or 1)

    def so_far():
        """The epoch as it stands after ``step``, for a checkpoint."""
        read()
        now = dataclasses.replace(
            sums, train_time=sums.train_time + time.perf_counter() - began,
            comm_time=sums.comm_time + model.comm_time - comm_before)
        return {'step': step, 'sums': dataclasses.asdict(now),
                'drifts': [float(d) for d in model.drifts[mixes:]]}

    batches = itertools.islice(zip(loader.epoch(epoch), step_totals), first,
                               None)
    for step, ((x, t), step_total) in enumerate(batches, first + 1):
        model.step(x, t, total=step_total, observe=False)
        if step % READ_EVERY == 0 or step == len(step_totals):
            loss, accuracy = read()
        progress.step(loss, accuracy)
        # After an epoch's last step, the epoch's end polls.
        if step < len(step_totals) and commands.due(model.iteration) and \
                commands.poll(epoch, so_far, boundary=False):
            return None
    synchronize(model.devices)  # the epoch's time, not its queuing
    sums.train_time += time.perf_counter() - began
    sums.comm_time += model.comm_time - comm_before
    sums.data_wait += loader.wait_times.get(epoch, 0.0)
    model.end_epoch()
    return sums


def _diverged(config, model, epoch, loss, checkpoint, saved):
    kept = (f'{checkpoint} from epoch {saved} is kept' if saved
            else 'no checkpoint was written yet')
    lr = Hyperparameters(model.optimizers).values().get(
        'lr', config.learning_rate)
    return TrainingDiverged(
        f'loss became {loss} at epoch {epoch + 1}, iteration '
        f'{model.iteration}; stopped ({kept}). Lower {argument("lr")} (now '
        f'{lr:g})')


def _row(config, model, sums, epoch, drifts, commands):
    """Epoch ``epoch``'s log row, from the sums over all ranks;
    ``drifts``: the replicas' distances before this epoch's ipm mixes.
    ``lr`` is the learning rate in force, and every other hyperparameter
    changed by request is there too (ChainerUI draws them)."""
    values = commands.hyper.values()
    row = {'epoch': epoch + 1, 'iteration': model.iteration,
           **sums.row(model.comm.size),
           'lr': values.get('lr', config.learning_rate),
           **{k: values[k] for k in commands.state['hyperparams']
              if k != 'lr'}}
    if model.mode == 'ipm' and model.total_replicas > 1:
        # Mean distance before this epoch's mixes; with none (one-shot,
        # or long intervals), how far apart they are now.
        row['drift'] = (float(np.mean(drifts)) if drifts
                        else model.spread())
    return row


def _save(out, model, state, row, stopper, evaluated):
    """After an epoch: the model evaluated as the best (when the monitor
    improved), the log and the checkpoint; rank 0 writes them."""
    lead = model.comm.rank == 0
    if stopper.count == 0 and lead:  # improved on the monitor
        save_model(out / 'model_best.npz', evaluated)
    state.update(epoch=row['epoch'], elapsed=row['elapsed_time'],
                 early_stop=stopper.state())
    state['log'].append(row)
    if lead:
        write_json(out / 'log', state['log'])
    save_checkpoint(out / CHECKPOINT, model, state)


def _finish(model, out, state, stopped, by_request=None):
    """The final mix, the final model (and, in ipm, the checkpoint with
    it, unless stopped by request: that run goes on from its checkpoint as
    if never stopped); the run's summary."""
    model.finalize()
    if model.comm.rank == 0:
        save_model(out / 'model_final.npz', model.master)
    if model.mode == 'ipm' and not by_request:  # the final mix too
        save_checkpoint(out / CHECKPOINT, model, state)
    log = state['log']
    return {'log': log, 'final': log[-1] if log else None, 'out': str(out),
            'devices': [str(d) for d in model.devices],
            'stopped_early': stopped, 'stopped_by_request': by_request}
