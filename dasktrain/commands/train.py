"""``dasktrain download`` and ``dasktrain train``: the data, and one run
here or across ``--workers N`` Dask workers."""
import dataclasses
import json

from dasktrain.commands import Command, config_from_args
from dasktrain.commands.options import (
    add_arguments,
    add_data_arguments,
    given_fields,
)


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


class Train(Command):
    name = 'train'
    help = ('train a model on CIFAR-10 (or --dataset) on every GPU found '
            '(else the CPU), or across --workers N Dask workers, '
            'downloading the data if needed')

    def add_arguments(self, parser):
        add_arguments(parser)

    def run(self, args):
        from dasktrain.run.train import train
        config = config_from_args(args)
        if config.resume:
            config = self.resumed(config, args)
        summary = train(config)
        final = summary['final']
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
    def curves(out):
        """OUT/curves.png, where matplotlib is installed."""
        try:
            from dasktrain.results import save_curves
            path = save_curves(out)
        except ImportError:
            print('curves: `pip install matplotlib` (or dasktrain'
                  '[notebooks]) to get OUT/curves.png; or open OUT/log in '
                  'ChainerUI')
            return
        if path is not None:
            print(f'curves: {path}')

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
    if 'workers' not in summary:
        return devices
    attempts = summary['attempts']
    return (f"{len(summary['workers'])} workers ({devices} each"
            f"{f', {attempts} attempts' if attempts > 1 else ''})")
