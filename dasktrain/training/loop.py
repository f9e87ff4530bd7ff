"""The training loop behind ``dasktrain train`` and ``dasktrain.train``.

Every epoch: train on freshly augmented data (prefetched while the previous
epoch trained), evaluate, append a row to ``OUT/log`` (Chainer LogReport
JSON, readable by ChainerUI), write a checkpoint atomically. All randomness
is a function of (seed, epoch), so ``--resume`` ends exactly where an
uninterrupted run would.
"""
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import chainer
import chainer.functions as F
import numpy as np
from chainer.serializers import DictionarySerializer
from tqdm import tqdm  # plain: tqdm.auto warns in a notebook without ipywidgets

from dasktrain.data.augment import EpochLoader, shard_bounds, tta_views
from dasktrain.parallel.comm import Solo
from dasktrain.config import IPM_KEYS, LOG_KEYS, TrainConfig, better
from dasktrain.data.cifar import load_cifar10
from dasktrain.errors import UserError
from dasktrain.files import atomic_write, write_json
from dasktrain.training.models import get_model, read_npz
from dasktrain.parallel.devices import (available_devices, gpu_count,
                                        nvidia_smi_lines, synchronize,
                                        unused_gpus_message)
from dasktrain.training.outdir import claim, record_args
from dasktrain.parallel.gradient import GPUDistributedGradient

CHECKPOINT = 'checkpoint.npz'
# Steps between reads of the loss to the host: each read waits for the
# GPUs, which would otherwise run ahead of Python. A non-finite loss is
# caught at the next read.
READ_EVERY = 10


class TrainingDiverged(UserError):
    """The loss stopped being finite."""


def default_devices():
    """Every GPU this process sees, else one CPU replica."""
    gpus = [d for d in available_devices() if d.startswith('@cupy')]
    return tuple(gpus) or ('@numpy',)


def describe_devices(devices, chosen=True):
    """One line naming the devices a run trains on; ``chosen``: the user
    named none (so a CPU run says no GPU was found)."""
    devices = [str(d) for d in devices]
    gpus = [d for d in devices if d.startswith('@cupy')]
    if gpus:
        return (f'training on {len(gpus)} GPU{"s" * (len(gpus) > 1)}: '
                f'{", ".join(gpus)}')
    n = len(devices)
    return (f'training on the CPU, {n} replica{"s" * (n > 1)} (@numpy)'
            f'{"; no GPU found" if not chosen else ""}')


def make_optimizer(config):
    if config.optimizer == 'adam':
        return chainer.optimizers.Adam(alpha=config.learning_rate)
    return chainer.optimizers.MomentumSGD(lr=config.learning_rate,
                                          momentum=0.9)


def seed_everything(seed, epoch):
    """Seed NumPy's global RNG from (seed, epoch), for anything drawing from
    it besides the replicas (whose dropout streams ``model.seed`` sets): a
    resumed run re-derives it instead of storing it."""
    state = np.random.SeedSequence([seed, epoch]).generate_state(1)[0]
    np.random.seed(int(state))


class EarlyStopping:
    """Chainer's EarlyStoppingTrigger rule: stop once ``monitor`` has not
    improved for ``patience`` checks. ``mode`` 'max' or 'min' says which way
    it improves; 'auto' reads it off the key's name (accuracies: max,
    losses: min) and refuses any other key rather than guess."""

    def __init__(self, monitor, patience, best=None, count=0, mode='auto'):
        self.monitor, self.patience = monitor, patience
        keys = LOG_KEYS + IPM_KEYS
        if monitor not in keys:
            raise UserError(f'--early-stop-monitor {monitor} is not in the '
                            f'log; choose one of {", ".join(keys)}')
        mode = better(monitor) if mode == 'auto' else mode
        if mode is None:
            raise UserError(f'--early-stop-monitor {monitor}: whether it '
                            'improves up or down is not in its name; pass '
                            '--early-stop-mode max or min')
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
        return self.patience is not None and self.count >= self.patience

    def state(self):
        return {'best': self.best, 'count': self.count}


# ------------------------------------------------------------------ files

# Models and checkpoints are stored uncompressed: float weights hardly
# compress, and zlib would cost seconds per epoch for the seed's network
# (5.5M parameters, three copies with Adam's moments).

def save_model(path, link):
    atomic_write(path, lambda f: chainer.serializers.save_npz(
        f, link, compression=False))


def save_checkpoint(path, model, state):
    """Every replica and optimizer of the job plus the loop's state, in one
    npz written by rank 0. In a multi-process ipm job the other groups'
    replicas are gathered to it (in dg they equal rank 0's)."""
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


def load_checkpoint(path, model, what='this run'):
    """Restore ``model`` from the checkpoint ``path``; its loop state. A
    file that is not a checkpoint of this run is one UserError, and kept."""
    with read_npz(path, what) as npz:
        model.restore(npz, 'model/')
        return json.loads(str(npz['state']))


# ------------------------------------------------------------- evaluation

def evaluate(evaluators, views, labels, batch_size):
    """Mean loss and accuracy on the test set; with several views, softmax
    probabilities are averaged over them first. ``evaluators``: (link,
    device) pairs (:meth:`GPUDistributedGradient.evaluators`); batches go
    to them in turn and are read back once all are queued, so every
    device computes at once."""
    probs = 0
    for view in views:
        parts = []
        for n, i in enumerate(range(0, len(labels), batch_size)):
            chain, device = evaluators[n % len(evaluators)]
            x = device.send(view[i:i + batch_size])
            with chainer.using_config('train', False), \
                    chainer.no_backprop_mode(), chainer.using_device(device):
                parts.append(F.softmax(chain.predictor(x)).array)
        probs = probs + np.concatenate(
            [chainer.backends.cuda.to_cpu(p) for p in parts])
    probs = probs / len(views)
    picked = probs[np.arange(len(labels)), labels]
    loss = float(-np.log(np.maximum(picked, 1e-12)).mean())
    return loss, float((probs.argmax(axis=1) == labels).mean())


# ------------------------------------------------------------------ loop

class _Progress:
    """A tqdm bar on a terminal, a plain line per epoch elsewhere."""

    def __init__(self, enabled, total_epochs):
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.total_epochs = total_epochs
        self.bar = None

    def start(self, epoch, iterations):
        if self.tty:
            self.bar = tqdm(total=iterations, leave=False, unit='it',
                            desc=f'epoch {epoch + 1}/{self.total_epochs}')

    def step(self, loss, accuracy):
        if self.bar is not None:
            self.bar.update()
            if math.isfinite(loss):  # nan until the first read of the loss
                self.bar.set_postfix(loss=f'{loss:.4f}',
                                     acc=f'{accuracy:.4f}')

    def end(self, row):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.enabled:
            tqdm.write(
                f"epoch {row['epoch']:>3}/{self.total_epochs}  "
                f"loss {row['main/loss']:.4f}  acc {row['main/accuracy']:.4f}"
                f"  val/loss {row['validation/main/loss']:.4f}  val/acc "
                f"{row['validation/main/accuracy']:.4f}  "
                f"{row['images_per_sec']:,.0f} img/s  "
                f"{row['elapsed_time']:.1f}s", file=sys.stdout)


def _say_devices(model, chosen):
    """The devices a run trains on, first thing: a GPU server training on
    its CPU must not go unnoticed (with nvidia-smi's GPUs and Chainer's
    reason why it cannot use them)."""
    workers = model.comm.size
    print(describe_devices(model.devices, chosen) +
          (f', on each of {workers} workers' if workers > 1 else ''),
          flush=True)
    if all(d.xp is np for d in model.devices):
        count, reason = gpu_count()
        line = unused_gpus_message(nvidia_smi_lines(), count, reason)
        if line:
            print(f'warning: {line}', file=sys.stderr, flush=True)


@contextlib.contextmanager
def prepare_out(config):
    """Hold ``config.out`` for the run (see :func:`dasktrain.training.outdir.claim`):
    created, writable, locked; removed again if this run created it and
    fails before its first checkpoint. Refuses to overwrite a run without
    --resume."""
    with claim(config.out, keep=lambda out: (out / CHECKPOINT).exists()) \
            as out:
        if (out / CHECKPOINT).exists() and not config.resume:
            raise UserError(f'{out} already holds a run ({CHECKPOINT}); pass'
                            ' --resume to continue it, or choose another '
                            '--out')
        yield out


def train(config=None, callbacks=(), **overrides):
    """Train a model on CIFAR-10 in this process, as ``config`` says; return
    the summary. (``dasktrain.train`` also runs jobs across Dask workers.)

    Parameters
    ----------
    config : TrainConfig, optional
        Default: ``TrainConfig()``; keyword ``overrides`` replace fields.
    callbacks : sequence of callables, default ()
        Each is called as ``callback(row)`` after an epoch's log row and
        checkpoint are written (e.g. to plot live in a notebook).

    Returns
    -------
    dict
        ``log`` (all rows), ``final`` (the last row), ``out``, ``devices``
        and ``stopped_early``.

    Examples
    --------
    >>> summary = train(TrainConfig(model='resnet20', epochs=5))  # doctest: +SKIP
    >>> summary['final']['validation/main/accuracy']  # doctest: +SKIP
    """
    config = (config or TrainConfig()).replace(**overrides)
    if config.workers is not None:
        raise UserError(f'workers={config.workers} runs across Dask workers:'
                        ' call dasktrain.train (dasktrain.cluster.scaleout.train)')
    with prepare_out(config):
        return run_group(config, callbacks=callbacks,
                         progress=_Progress(config.progress, config.epochs))


def run_group(config, comm=None, devices=None, callbacks=(), progress=None):
    """The training loop of one replica group on ``devices`` (default:
    ``config.devices``, else every GPU, else one CPU replica).

    With ``comm`` (see :mod:`dasktrain.parallel.collective`) the group is one rank of
    a job across processes: it reads and augments only its replicas' shards
    of the data and evaluates its share of the test set; metrics are summed
    over all ranks, so every rank computes the same log row, and rank 0
    writes the files.

    With ``config.deterministic``, Chainer's ``cudnn_deterministic`` is on
    (deterministic convolution algorithms) and the models draw dropout
    masks from each replica's seeded CuPy stream instead of cuDNN's, whose
    state is seeded from ``os.urandom`` (see :func:`dasktrain.training.models.dropout`).
    """
    with chainer.using_config('cudnn_deterministic', config.deterministic):
        return _run_group(config, comm, devices, callbacks, progress)


def _run_group(config, comm, devices, callbacks, progress):
    comm = comm or Solo()
    lead = comm.rank == 0
    out = Path(config.out)
    cifar = load_cifar10(config.data_dir, url=config.url, md5=config.md5)
    n_train = min(config.train_size or len(cifar.train_labels),
                  len(cifar.train_labels))
    n_test = min(config.test_size or len(cifar.test_labels),
                 len(cifar.test_labels))
    np.random.seed(config.seed)  # the initial weights
    model = GPUDistributedGradient(
        get_model(config.model), devices or config.devices or
        default_devices(), mode=config.mode, mix_every=config.mix_every,
        mix_optimizer_state=config.mix_optimizer_state, comm=comm,
        comm_dtype=config.comm_dtype,
        double_buffering=config.double_buffering,
        bucket_mb=config.bucket_mb)
    if lead and getattr(progress, 'enabled', False):
        _say_devices(model, chosen=bool(devices or config.devices))
    model.setup(make_optimizer(config))
    if config.weight_decay:
        model.add_hook(chainer.optimizer_hooks.WeightDecay(
            config.weight_decay))
    replicas = model.total_replicas
    if replicas > n_train:
        raise UserError(f'{replicas} replicas need at least as many training '
                        f'images, got --train-size {n_train}')
    if config.early_stop_monitor == 'drift' and \
            not (model.mode == 'ipm' and replicas > 1):
        raise UserError('--early-stop-monitor drift needs --mode ipm with '
                        f'several replicas; this run has {replicas} in '
                        f'mode {model.mode}')
    test_lo, test_hi = shard_bounds(n_test, comm.size)[comm.rank]
    test_labels = cifar.test_labels[test_lo:test_hi].compute(
        scheduler='threads')
    views = [v.compute(scheduler='threads') for v in
             tta_views(cifar.test_images[test_lo:test_hi], config.tta)]
    state = {'epoch': 0, 'log': [], 'elapsed': 0.0,
             'early_stop': {'best': None, 'count': 0}}
    resumed = config.resume and (out / CHECKPOINT).exists()
    if resumed:
        state = load_checkpoint(out / CHECKPOINT, model,
                                f'this run (--model {config.model})')
    if lead:
        record_args(out, json.loads(config.to_json()),
                    state['epoch'] if resumed else None)
    stopper = EarlyStopping(config.early_stop_monitor,
                            config.early_stop_patience,
                            mode=config.early_stop_mode,
                            **state['early_stop'])
    progress = progress or _Progress(False, config.epochs)
    loader = EpochLoader(
        cifar.train_images[:n_train],
        cifar.train_labels[:n_train].compute(scheduler='threads'),
        config.batch_size * replicas, seed=config.seed,
        augment_options={} if config.augment else None,
        epochs=config.epochs, parts=replicas,
        own=range(model.offset, model.offset + len(model)), cache=True,
        # A rank computes in its worker's thread: never on the cluster.
        client=None if isinstance(comm, Solo) else False)
    step_totals = loader.step_totals()
    stopped = state['early_stop']['count'] >= (config.early_stop_patience
                                                 or math.inf)
    started = time.perf_counter() - state['elapsed']
    eval_batch = max(100, config.batch_size)
    with loader:
        for epoch in range(state['epoch'],
                           state['epoch'] if stopped else config.epochs):
            seed_everything(config.seed, epoch)
            model.seed(config.seed, epoch)
            comm_before, began = model.comm_time, time.perf_counter()
            mixes_before = len(model.drifts)
            total = loss_sum = acc_sum = 0.0
            progress.start(epoch, len(loader))
            loss = accuracy = math.nan
            for step, ((x, t), step_total) in enumerate(
                    zip(loader.epoch(epoch), step_totals), 1):
                model.step(x, t, total=step_total, observe=False)
                if step % READ_EVERY == 0 or step == len(step_totals):
                    ls, acs, seen = model.take_metrics()
                    loss_sum, acc_sum, total = (loss_sum + ls,
                                                acc_sum + acs, total + seen)
                    loss, accuracy = ls / (seen or 1), acs / (seen or 1)
                    if not math.isfinite(ls):
                        last = (f'{out / CHECKPOINT} from epoch '
                                f'{state["epoch"]} is kept' if state['epoch']
                                else 'no checkpoint was written yet')
                        raise TrainingDiverged(
                            f'loss became {loss} at epoch {epoch + 1}, '
                            f'iteration {model.iteration}; stopped ({last}).'
                            f' Lower --lr (now {config.learning_rate:g})')
                progress.step(loss, accuracy)
            synchronize(model.devices)  # the epoch's time, not its queuing
            train_time = time.perf_counter() - began
            model.end_epoch()
            evaluators = model.evaluators()
            evaluated = evaluators[0][0]
            val_loss, val_acc = evaluate(evaluators, views, test_labels,
                                         eval_batch)
            n_val = len(test_labels)
            sums = comm.allreduce([np.array([
                loss_sum, acc_sum, total, train_time,
                loader.wait_times.get(epoch, 0.0),
                model.comm_time - comm_before, val_loss * n_val,
                val_acc * n_val, n_val,
                time.perf_counter() - started if lead else 0.0])])[0]
            row = {
                'epoch': epoch + 1,
                'iteration': model.iteration,
                'main/loss': sums[0] / sums[2],
                'main/accuracy': sums[1] / sums[2],
                'validation/main/loss': sums[6] / sums[8],
                'validation/main/accuracy': sums[7] / sums[8],
                'elapsed_time': sums[9],
                # over the ranks' mean time: all train in lock step
                'images_per_sec': sums[2] / (sums[3] / comm.size),
                'data_wait_time': sums[4] / comm.size,
                'comm_time': sums[5] / comm.size,
                'lr': config.learning_rate,
            }
            row = {k: float(v) if isinstance(v, np.floating) else v
                   for k, v in row.items()}
            if model.mode == 'ipm' and replicas > 1:
                # Mean distance before this epoch's mixes; with none (one-
                # shot, or long intervals), how far apart they are now.
                drifts = model.drifts[mixes_before:]
                row['drift'] = (float(np.mean(drifts)) if drifts
                                else model.spread())
            stopped = stopper.update(row)
            if stopper.count == 0 and lead:  # improved on the monitor
                save_model(out / 'model_best.npz', evaluated)
            state.update(epoch=epoch + 1, elapsed=row['elapsed_time'],
                         early_stop=stopper.state())
            state['log'].append(row)
            if lead:
                write_json(out / 'log', state['log'])
            save_checkpoint(out / CHECKPOINT, model, state)
            progress.end(row)
            for callback in callbacks:
                callback(row)
            if stopped:
                break
    model.finalize()
    if lead:
        save_model(out / 'model_final.npz', model.master)
    if model.mode == 'ipm':  # the checkpoint holds the final mix too
        save_checkpoint(out / CHECKPOINT, model, state)
    return {'log': state['log'], 'final': state['log'][-1] if state['log']
            else None, 'out': str(out),
            'devices': [str(d) for d in model.devices],
            'stopped_early': stopped}
