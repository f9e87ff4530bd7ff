"""``dasktrain tune``: an Optuna study whose trials are queued jobs, or a
study's trials and its best (``--status``)."""
import argparse

from dasktrain.commands import (
    Command,
    add_jobs_dir,
    add_scheduler,
    printable,
    train_config,
)


class Tune(Command):
    name = 'tune'
    help = ('search hyperparameters: an Optuna study whose trials are queued '
            'jobs: dasktrain tune --space FILE [options] -- <dasktrain train '
            'options>; dasktrain tune --status STUDY')

    def add_arguments(self, parser):
        add = parser.add_argument
        add('--space', metavar='FILE', help='YAML or JSON: per TrainConfig '
            'field a distribution (float/int with low, high, log; '
            'categorical with choices)')
        add('--status', metavar='STUDY', help="print a study's trials and "
            'its best trial, then exit')
        add('--trials', type=int, default=20, metavar='N',
            help='trials in the study in total (default: %(default)s)')
        add('--parallel', type=int, default=2, metavar='K',
            help='trials queued or running at once (default: %(default)s)')
        add('--gpus', type=int, default=1, help='GPUs each trial reserves; '
            '0: a CPU slot (default: %(default)s)')
        add('--metric', default='validation/main/accuracy', metavar='KEY',
            help='log key reported each epoch; a trial is worth its best '
                 "epoch's (default: %(default)s)")
        add('--direction', choices=('maximize', 'minimize'), help='default: '
            'from the metric\'s name (accuracy: maximize, loss: minimize)')
        add('--pruner', choices=('median', 'asha', 'none'), default='median',
            help='(default: %(default)s)')
        add('--startup-trials', type=int, default=5, metavar='N',
            help='median: trials completed before any is pruned (default: '
                 '%(default)s)')
        add('--warmup-epochs', type=int, default=0, metavar='E',
            help='epochs every trial runs before it may be pruned (default: '
                 '%(default)s)')
        add('--sampler', choices=('tpe', 'random'), default='tpe',
            help='(default: %(default)s)')
        add('--sampler-seed', type=int, default=None, metavar='S')
        add('--storage', metavar='URL', help='Optuna storage: SQLAlchemy URL '
            'or journal file (default: JOBS_DIR/studies/STUDY/journal.log)')
        add('--study', metavar='NAME', help="default: the space file's name")
        add('--timeout', type=float, default=None, metavar='S',
            help='start no trial after S seconds (running ones finish)')
        add_scheduler(parser)
        add_jobs_dir(parser)
        add('train_args', nargs=argparse.REMAINDER,
            help='options of `dasktrain train` every trial shares, after --')

    def run(self, args):
        import optuna

        from dasktrain.results import trials_table
        from dasktrain.tuning import study as tuning
        from dasktrain.tuning import trials
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # ours instead
        if args.status:
            study = tuning.load(args.status, args.jobs_dir, args.storage)
            print(printable(trials_table(study).to_text(), keep='\n'))
            print(printable(trials.describe_best(study), keep='\n'))
            return 0
        if not args.space:
            args.command_parser.error('give --space FILE, or --status STUDY')
        tuning.tune(
            args.space, train_config(args.train_args, 'dasktrain tune -- '),
            trials=args.trials, parallel=args.parallel, gpus=args.gpus,
            metric=args.metric, direction=args.direction, pruner=args.pruner,
            sampler=args.sampler, storage=args.storage, study=args.study,
            timeout=args.timeout, startup_trials=args.startup_trials,
            warmup_epochs=args.warmup_epochs, seed=args.sampler_seed,
            scheduler=args.scheduler, path=args.jobs_dir)
        return 0
