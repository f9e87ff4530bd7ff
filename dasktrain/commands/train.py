"""``dasktrain download`` and ``dasktrain train``: the data, and one run
here or across ``--workers N`` Dask workers.

A first run works anywhere: without ``--dataset``, where CIFAR-10 cannot
be had (not in ``--data-dir``, no mirror, the official host unreachable)
``train`` trains on the built-in sample (:mod:`dasktrain.data.sample`),
saying so first; without a GPU and without ``--epochs``,
``--train-size`` or ``--test-size`` it trains a short run
(:data:`SHORT_CPU_RUN`, :func:`short_cpu_run`), saying how to ask for the
full one. Without ``--out`` each run trains into a new folder of its own
(``runs/train-YYYYmmdd-HHMMSS``); what the run would refuse (a device not
there, an ``--out`` another run holds or one holding a run without
``--resume``) is refused in one line before anything else is said.
"""
import dataclasses
import json

from dasktrain.commands import Command, config_from_args
from dasktrain.commands.options import (
    add_arguments,
    add_data_arguments,
    given_fields,
)
from dasktrain.errors import UserError, plural


class Download(Command):
    name = 'download'
    help = 'download, verify and extract CIFAR-10 (or --dataset cifar100)'

    def add_arguments(self, parser):
        add_data_arguments(parser)

    def run(self, args):
        if args.dataset == 'cifar10':
            from dasktrain.data.cifar import load_cifar10
            cifar = load_cifar10(args.data_dir, url=args.url, md5=args.md5)
            print(f'CIFAR-10 ready in {args.data_dir}: '
                  f'{len(cifar.train_labels)} training and '
                  f'{len(cifar.test_labels)} test images, classes '
                  f'{", ".join(cifar.label_names)}')
            return 0
        from dasktrain.data.datasets import load_dataset
        data = load_dataset(args.dataset, args.data_dir, url=args.url,
                            md5=args.md5, label_set=args.label_set)
        print(f'ready: {data.describe()}')
        return 0


# A CPU trains the seed post's network at about 100 to 200 images/s on 2
# cores: the full default (20 epochs of 50,000 images) takes hours.
SHORT_CPU_RUN = dict(epochs=2, train_size=2000, test_size=1000)


def short_cpu_run(config, given, has_gpu):
    """The sizes of a short run for ``config`` (a dict of TrainConfig
    fields), or None to train as asked: a run that trains on the CPU
    (``devices`` all CPU, or none named and ``has_gpu()`` false), here
    (not ``--workers``), new (not ``--resume``), whose size the user did
    not give (none of ``--epochs``, ``--train-size``, ``--test-size`` in
    ``given``). ``has_gpu`` is asked only when needed.

    Examples
    --------
    >>> from dasktrain.config import TrainConfig
    >>> short_cpu_run(TrainConfig(), set(), lambda: False)
    {'epochs': 2, 'train_size': 2000, 'test_size': 1000}
    >>> short_cpu_run(TrainConfig(), {'epochs'}, lambda: False)
    >>> short_cpu_run(TrainConfig(), set(), lambda: True)
    >>> short_cpu_run(TrainConfig(devices='cpu:2'), set(), lambda: True)
    {'epochs': 2, 'train_size': 2000, 'test_size': 1000}
    """
    if config.workers is not None or config.resume or \
            given & {'epochs', 'train_size', 'test_size'}:
        return None
    if config.devices is not None:
        on_cpu = all(d == '@numpy' for d in config.devices)
    else:
        on_cpu = not has_gpu()
    return dict(SHORT_CPU_RUN) if on_cpu else None


def short_run_line(sizes, full_epochs):
    """What a short CPU run says first.

    >>> print(short_run_line(SHORT_CPU_RUN, 20))  # doctest: +ELLIPSIS
    no GPU: a short run, 2 epochs of 2,000 training images (--epochs 2 ...
    """
    return (f"no GPU: a short run, {sizes['epochs']} epochs of "
            f"{sizes['train_size']:,} training images (--epochs "
            f"{sizes['epochs']} --train-size {sizes['train_size']} "
            f"--test-size {sizes['test_size']}), a minute or a few; for "
            f'the full run ({full_epochs} epochs of every image, hours on '
            f'a CPU) pass --epochs {full_epochs}')


def _has_gpu():
    from dasktrain.parallel.placement import default_devices
    return default_devices() != ('@numpy',)


class Train(Command):
    name = 'train'
    help = ('train a model on CIFAR-10 (or --dataset) on every GPU found '
            '(else the CPU), or across --workers N Dask workers, '
            'downloading the data if needed')

    def add_arguments(self, parser):
        add_arguments(parser)

    def run(self, args):
        from dasktrain.cluster.start_lock import signals_raise
        from dasktrain.run.train import train
        config = config_from_args(args)
        given = given_fields(args.argv[1:])
        config = self.out(config, given)
        if config.resume:
            config = self.resumed(config, args)
        self.check(config)  # before a first run's lines: one line
        if not config.resume:
            config = self.first_run(config, given)
        # A SIGTERM (kill, a closed terminal's SIGHUP) ends the run as
        # Ctrl-C does: a folder it created and holds nothing of is gone.
        with signals_raise():
            summary = train(config)
        if summary.get('rank'):  # a rank of a launch: rank 0 tells
            return 0
        final, stop = summary['final'], summary.get('stopped_by_request')
        if stop:
            print(f"stopped by request at iteration {stop['iteration']} "
                  f"({plural(stop['epoch'], 'epoch')} done); `dasktrain train "
                  f"--resume --out {config.out}` continues from "
                  f"{stop['checkpoint']}")
        if final is None and stop:
            return 0
        if final is None:
            print(f'nothing to do: {config.out} already finished '
                  f'{config.epochs} epochs')
        else:
            print(f"done: epoch {final['epoch']}, test accuracy "
                  f"{final['validation/main/accuracy']:.4f}, on "
                  f"{_where(summary)}; outputs in "
                  f"{summary['out']}")
            self.curves(summary['out'])
        return 0

    @staticmethod
    def out(config, given):
        """``config`` with its ``--out``: as given, else a new folder of
        its own under ``runs/`` (each ``dasktrain train`` its own: a
        second one never meets the first's checkpoint). ``--resume``
        needs the folder named."""
        from dasktrain.training.outdir import new_run_folder, newest_run
        if 'out' in given:
            return config
        if config.resume:
            newest = newest_run()
            hint = f'pass --out {newest} (the newest run here)' if newest \
                else 'pass --out DIR, the folder of the run to continue'
            raise UserError(f'--resume continues the run in --out: {hint}')
        return config.replace(out=str(new_run_folder()))

    @staticmethod
    def check(config):
        """Refuse, in one line and before anything is said, what the run
        would refuse later: its devices (here), its ``--out`` (another
        run's, or a run's without ``--resume``)."""
        from dasktrain.parallel.comm.rendezvous import launched
        from dasktrain.training.checkpoint import check_out
        if config.workers is None:
            from dasktrain.parallel.cuda_check import check_gpus_usable
            check_gpus_usable(config.devices)
        if launched():  # a rank: its devices are the launch's, its
            return      # --out rank 0's, which holds it as the others run
        if config.workers is None and config.devices:
            from dasktrain.parallel.devices import check_available
            from dasktrain.parallel.gpus import gpu_ids
            if gpu_ids(config.devices):
                check_available(config.devices)
        check_out(config.out, config.resume)

    @staticmethod
    def curves(out):
        """OUT/curves.png, where matplotlib is installed."""
        try:
            from dasktrain.training.curves import save_curves
            path = save_curves(out)
        except ImportError:
            print('curves: `pip install matplotlib` (or dasktrain'
                  '[notebooks]) to get OUT/curves.png; or open OUT/log in '
                  'ChainerUI')
            return
        if path is not None:
            print(f'curves: {path}')

    @staticmethod
    def first_run(config, given):
        """The built-in sample where CIFAR-10 was not named and cannot be
        had; a short run on a CPU where no size was given. Each says so
        in one line, first."""
        if 'dataset' not in given and config.dataset == 'cifar10':
            from dasktrain.data.sample import (
                SAMPLE,
                cifar10_unavailable,
                fallback_line,
            )
            why = cifar10_unavailable(config.data_dir, config.url)
            if why is not None:
                if config.progress:
                    print(fallback_line(why, config.data_dir), flush=True)
                config = config.replace(dataset=SAMPLE)
        sizes = short_cpu_run(config, given, _has_gpu)
        if sizes is not None:
            if config.progress:
                print(short_run_line(sizes, config.epochs), flush=True)
            config = config.replace(**sizes)
        return config

    @staticmethod
    def resumed(config, args):
        """``--resume``: every option from ``OUT/args`` (the run as it was
        started and last resumed), those given now overriding them."""
        from dasktrain.config import ConfigError, TrainConfig
        from dasktrain.training.outdir import recorded_settings
        recorded = recorded_settings(config.out)
        if recorded is None:
            return config
        given = given_fields(args.argv[1:])
        names = {f.name for f in dataclasses.fields(TrainConfig)}
        values = {k: v for k, v in recorded.items()
                  if k in names and k not in given}
        try:
            kept = TrainConfig.from_json(json.dumps(values))
        except (ConfigError, TypeError) as e:
            raise ConfigError(f'{config.out}/args cannot be resumed from '
                              f'({e}); give every option again') from None
        return kept.replace(**{k: getattr(config, k) for k in given
                               if k in names})


def _where(summary):
    devices = ', '.join(summary['devices'])
    if 'ranks' in summary:
        return f"{summary['ranks']} launched ranks ({devices} each)"
    if 'workers' not in summary:
        return devices
    attempts = summary['attempts']
    return (f"{len(summary['workers'])} workers ({devices} each"
            f"{f', {attempts} attempts' if attempts > 1 else ''})")
