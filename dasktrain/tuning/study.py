"""``dasktrain tune``: an Optuna study over TrainConfig fields whose trials
are jobs on the cluster.

:func:`tune` runs Optuna's ask-and-tell loop: it asks the study for a trial
(Optuna's TPE or random sampler picks the params from the space, see
space.py), submits the trial's TrainConfig as a job with
:func:`dasktrain.jobs.client.submit.submit` (the queue ``dasktrain submit``
uses) and
keeps ``parallel`` trials in flight. So trials wait for GPUs beside
everyone's jobs, show in ``dasktrain jobs``, and resume on another worker
when theirs dies. Each trial reports its epochs, is pruned and tells its
value from inside its own job (trials.py); this loop asks, submits and
watches, polling the job files.

The study lives in its Optuna storage (default: a journal file in
``JOBS_DIR/studies/NAME/``) and in the jobs, not in this process. Run the
same command again after killing it and it carries on: finished trials
stay, running ones are waited for, a trial asked for but never submitted is
submitted now, a job the scheduler lost is handed to it again, and a trial
whose job ended without telling (cancelled, its child killed) is recorded
from the job's files. ``--trials`` counts every trial of the study.
"""
import dataclasses
import json
import logging
import re
import sys
import time
from pathlib import Path

from dasktrain.cluster.local import connect
from dasktrain.config import TrainConfig
from dasktrain.errors import UserError, argument
from dasktrain.files import write_json
from dasktrain.jobs.client.route import shared_queue
from dasktrain.jobs.client.submit import check_resources, submit
from dasktrain.jobs.job import DONE, jobs_dir, list_jobs
from dasktrain.jobs.request import JobRequest, Training, check_devices
from dasktrain.jobs.scheduler.query import scheduler_states
from dasktrain.jobs.scheduler.recovery import requeue
from dasktrain.tuning.checks import (
    TuneError,
    check_metric,
    check_numbers,
    check_same_study,
    read_study_file,
    state_early_stopping,
)
from dasktrain.tuning.space import MODEL_ARG, config_for, load_space, suggest
from dasktrain.tuning.trials import (
    describe_best,
    finish,
    make_pruner,
    open_storage,
    outcome,
    params_text,
)

logger = logging.getLogger(__name__)
PRUNERS = ('median', 'asha', 'none')
SAMPLERS = ('tpe', 'random')
# What makes a study the same study: a rerun that differs is refused.
IDENTITY = ('space', 'base', 'metric', 'direction', 'storage', 'gpus')
PER_JOB = ('out', 'resume', 'progress')  # set by submit for each trial


def make_sampler(name, seed=None):
    import optuna
    if name == 'random':
        return optuna.samplers.RandomSampler(seed=seed)
    import warnings
    with warnings.catch_warnings():  # constant_liar is "experimental"
        warnings.simplefilter('ignore', optuna.exceptions.ExperimentalWarning)
        # Running trials count as bad guesses: parallel trials spread out.
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True)


def _resolved(base, distributions):
    """``base`` with its model and dataset specs checked here, before any
    trial (one line each if wrong), and made absolute for the workers. A
    model whose arguments the space samples is built by its trials."""
    from dasktrain.data.datasets import resolve_spec
    from dasktrain.training.models import resolve_model
    from dasktrain.training.usermodel import absolute_spec, is_spec
    sampled = any(k.startswith(MODEL_ARG) for k in distributions)
    model = absolute_spec(base.model) if sampled and is_spec(base.model) \
        else resolve_model(base.model, base.model_args)
    return base.replace(model=model, dataset=resolve_spec(base.dataset))


def tune(space, base_config=None, trials=20, parallel=2, gpus=1,
         metric='validation/main/accuracy', direction=None, pruner='median',
         sampler='tpe', storage=None, study=None, timeout=None,
         startup_trials=5, warmup_epochs=0, seed=None, client=None,
         scheduler=None, path=None, poll=0.5, out=None):
    """Search hyperparameters: an Optuna study whose trials are cluster jobs.

    Parameters
    ----------
    space : str, Path or dict
        Per TrainConfig field a distribution (YAML/JSON file or dict; see
        :mod:`dasktrain.tuning.space`).
    base_config : TrainConfig, optional
        Every trial's settings besides the space's fields.
    trials : int, default 20
        Trials in the study in total, over every run of this command.
    parallel : int, default 2
        Trials in flight at once (queued or running).
    gpus : int, default 1
        GPUs each trial's job reserves (0: a CPU slot).
    metric : str, default 'validation/main/accuracy'
        Log key reported each epoch; a trial's value is its best epoch's.
    direction : {'maximize', 'minimize'}, optional
        Required where ``metric``'s name does not say.
    pruner : {'median', 'asha', 'none'}, default 'median'
        Optuna's MedianPruner, SuccessiveHalvingPruner or NopPruner.
    sampler : {'tpe', 'random'}, default 'tpe'
    storage : str, optional
        Optuna storage: SQLAlchemy URL or journal file path. Default
        ``PATH/studies/STUDY/journal.log``.
    study : str, optional
        Its name; default the space file's stem, or 'tune'.
    timeout : float, optional
        Seconds after which no new trial starts (running ones finish).
    startup_trials, warmup_epochs : int, default 5, 0
        Median pruner: trials completed before any is pruned; both: epochs
        every trial runs before it may be pruned.
    seed : int, optional
        The sampler's seed.
    client, scheduler, path
        The cluster (default: the recorded one, else a shared cluster's
        queue) and jobs dir, as for
        :func:`dasktrain.jobs.client.submit.submit`. The study's own files
        (``study.json``, the default storage) are in ``PATH/studies``,
        the jobs dir of your own even where the trials go to a shared
        cluster: its trials, run as you, write there.

    Returns
    -------
    optuna.Study
    """
    import optuna
    base = base_config or TrainConfig()
    name = study or ('tune' if isinstance(space, dict) else Path(space).stem)
    if not re.fullmatch(r'[A-Za-z0-9_.-]+', name):
        raise TuneError(f'{argument("study")} must be letters, digits, _ . or '
                        f'-, got {name!r}')
    check_numbers(trials=trials, parallel=parallel, gpus=gpus,
                   startup_trials=startup_trials,
                   warmup_epochs=warmup_epochs)
    for which, value, choices in (('pruner', pruner, PRUNERS),
                                  ('sampler', sampler, SAMPLERS)):
        if value not in choices:
            raise TuneError(f'{argument(which)} must be one of '
                            f'{", ".join(choices)}, got {value!r}')
    if timeout is not None and not timeout > 0:
        raise TuneError(f'{argument("timeout")} must be > 0 seconds, got '
                        f'{timeout!r}')
    distributions = load_space(space, base)
    base = _resolved(base, distributions)
    modes = distributions.get('mode', {}).get('choices', [base.mode])
    direction = check_metric(metric, direction, modes)
    base = state_early_stopping(base, metric, direction)
    check_devices(base, gpus)
    folder = jobs_dir(path).resolve() / 'studies' / name
    default_storage = storage is None
    if default_storage:
        storage = str(folder / 'journal.log')
    elif storage.startswith('sqlite:///') and \
            not storage.startswith('sqlite:////'):  # workers' cwd differs
        storage = f"sqlite:///{Path(storage[len('sqlite:///'):]).resolve()}"
    elif '://' not in storage:
        storage = str(Path(storage).resolve())
    base_fields = {k: v for k, v in dataclasses.asdict(base).items()
                   if k not in PER_JOB}
    settings = json.loads(json.dumps({
        'name': name, 'space': distributions, 'base': base_fields,
        'metric': metric, 'direction': direction, 'storage': storage,
        'gpus': gpus}))
    recorded = read_study_file(folder / 'study.json')
    for key in IDENTITY if recorded else ():
        if recorded.get(key) != settings[key]:
            raise TuneError(f'study {name!r} was started with another {key} '
                            f'({folder / "study.json"}); run it with the same '
                            f'settings, or pass another {argument("study")}')
    door = None if client is not None else shared_queue(scheduler, path)
    owned = client is None and door is None
    client = client or (connect(scheduler) if door is None else None)
    try:
        if door is None:
            check_resources(client, JobRequest(
                Training(json.loads(base.to_json()), {}), gpus))
        # Before anything is written: a study the storage already holds
        # (study.json deleted, or another folder's) must rank the same
        # metric the same way.
        opened = None
        if not default_storage or Path(storage).exists():
            opened = open_storage(storage)
            if name in optuna.get_all_study_names(opened):
                check_same_study(optuna.load_study(
                    study_name=name, storage=opened), metric, direction,
                    storage)
        folder.mkdir(parents=True, exist_ok=True)
        opened = opened or open_storage(storage)
        write_json(folder / 'study.json', settings)
        pruning = {'name': pruner, 'startup_trials': startup_trials,
                   'warmup_epochs': warmup_epochs}
        found = optuna.create_study(
            study_name=name, storage=opened, direction=direction,
            sampler=make_sampler(sampler, seed), pruner=make_pruner(**pruning),
            load_if_exists=True)
        found.set_user_attr('metric', metric)
        search = _Search(found, settings, base, distributions, pruning,
                         client or door, jobs_dir(path).resolve(),
                         out or sys.stdout)
        return search.run(trials, parallel, timeout, poll)
    finally:
        if owned:
            client.close()


class _Search:
    """The ask-and-tell loop of one run of ``tune``; ``queue``: a Dask
    client of a cluster of your own (job folders in ``root``), or a shared
    cluster's :class:`~dasktrain.jobs.client.socket_client.SocketClient`
    (which holds the jobs)."""

    def __init__(self, study, settings, base, distributions, pruning, queue,
                 root, out):
        from distributed import Client
        self.study, self.settings, self.base = study, settings, base
        self.distributions, self.root, self.out = distributions, root, out
        own = isinstance(queue, Client)
        self.client, self.door = (queue, None) if own else (None, queue)
        self.trial = {'study': settings['name'],
                      'storage': settings['storage'],
                      'metric': settings['metric'],
                      'direction': settings['direction'], 'pruner': pruning}
        self.jobs = {}  # trial number -> Job, this study's only
        if self.door is not None:  # the trials name their jobs
            for t in study.get_trials(deepcopy=False):
                if 'job' in t.user_attrs:
                    self.jobs[t.number] = self.door.job(t.user_attrs['job'])
            return
        for job in list_jobs(root):
            spec = job.spec().trial or {}
            if all(spec.get(k) == self.trial[k] for k in ('study', 'storage')):
                self.jobs[spec['number']] = job

    def say(self, line):
        print(line, file=self.out, flush=True)

    def run(self, trials, parallel, timeout, poll):
        from optuna.trial import TrialState
        STARTED = (TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED,
                   TrialState.FAIL)
        done = {t.number for t in self.study.get_trials(deepcopy=False)
                if t.state.is_finished()}
        self.say(f"study {self.settings['name']}: {len(done)} of {trials} "
                 f"trials done; {self.settings['metric']} to "
                 f"{self.settings['direction']}; storage "
                 f"{self.settings['storage']}")
        began = time.monotonic()
        try:
            while True:
                live = self.watch(TrialState.RUNNING)
                self.announce(done)
                total = len(self.study.get_trials(  # not WAITING ones,
                    deepcopy=False, states=STARTED))  # queued by enqueue
                asking = timeout is None or \
                    time.monotonic() - began < timeout
                while asking and total < trials and live < parallel:
                    trial = self.study.ask()
                    self.start(trial.number, trial._trial_id,
                               suggest(trial, self.distributions, self.base))
                    live, total = live + 1, total + 1
                if live == 0 and (total >= trials or not asking):
                    break
                time.sleep(poll)
        except KeyboardInterrupt:
            logger.warning('interrupted: the running trials go on as jobs '
                           '(`dasktrain jobs`); run the same command to carry '
                           'on with the study')
            raise
        # A trial ends (its child tells) a moment before its job does.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(
                j.status()['state'] not in DONE for j in self.jobs.values()):
            time.sleep(poll)
        self.say(describe_best(self.study))
        return self.study

    def start(self, number, trial_id, params):
        """Submit a trial's job."""
        from optuna.trial import TrialState
        try:
            config = config_for(self.base, params)
        except UserError as e:
            return finish(self.study, trial_id, TrialState.FAIL, error=str(e))
        job = submit(config, gpus=self.settings['gpus'],
                     name=f"{self.settings['name']}-{number}",
                     client=self.client,
                     path=None if self.door else self.root, check=False,
                     module='dasktrain.tuning.trials', extra={
                         'trial': dict(self.trial, id=trial_id,
                                       number=number)})
        self.jobs[number] = job
        import optuna
        trial = optuna.trial.Trial(self.study, trial_id)  # to annotate it
        trial.set_user_attr('job', job.id)
        trial.set_user_attr('out', str(job.folder / 'out'))
        # What its value means, beside the value: a study that ranks
        # another metric is refused (_check_same_study).
        trial.set_user_attr('metric', self.settings['metric'])
        trial.set_user_attr('direction', self.settings['direction'])
        self.say(f'trial {number}: job {job.id} ({params_text(params)})')

    def watch(self, running):
        """Trials in flight; settles those whose job ended untold, submits
        those never submitted, requeues jobs the scheduler lost."""
        import optuna
        live = {}
        # Optuna keeps a trial's id private; its Trial(study, id) is public.
        for trial in self.study.get_trials(deepcopy=False, states=(running,)):
            job = self.jobs.get(trial.number)
            if job is None:  # asked, then this process died: sample what
                # it had not (a param already sampled stays as it was)
                again = optuna.trial.Trial(self.study, trial._trial_id)
                self.start(trial.number, trial._trial_id,
                           suggest(again, self.distributions, self.base))
                continue
            status = job.status()
            if status['state'] in DONE:  # its child could not tell
                state, value, attrs = outcome(
                    job, self.trial, status['state'], status.get('error'))
                finish(self.study, trial._trial_id, state, value, **attrs)
            else:
                live[job.key] = job
        for job in self.lost(live):
            if self.door is not None:
                self.door.requeue(job.id)
            else:
                requeue(job, self.client)
        return len(live)

    def lost(self, live):
        """The jobs among ``live`` ({key: job}) their scheduler lost (none
        while it cannot be asked: look again next time)."""
        if self.door is not None:
            return [job for job in live.values() if job.lost_reason()]
        try:
            known = scheduler_states(live, self.client)
        except Exception:  # scheduler unreachable
            return []
        return [job for key, job in live.items() if key not in known]

    def announce(self, done):
        """One line per trial that ended since the last look."""
        for t in self.study.get_trials(deepcopy=False):
            if not t.state.is_finished() or t.number in done:
                continue
            done.add(t.number)
            epoch = t.user_attrs.get('epoch')
            if t.state.name == 'COMPLETE':
                what = (f"{self.settings['metric']} {t.value:.4g} (best, at "
                        f'epoch {epoch})')
            elif t.state.name == 'PRUNED':
                what = f'pruned after epoch {t.last_step}'
            else:
                what = f"failed: {t.user_attrs.get('error', '')}"
            self.say(f'trial {t.number}: {what}')


def load(name, path=None, storage=None):
    """A study started by :func:`tune`, by name (its storage is recorded in
    ``PATH/studies/NAME/study.json``)."""
    import optuna
    folder = jobs_dir(path) / 'studies' / name
    settings = read_study_file(folder / 'study.json')
    if settings is None and storage is None:
        raise TuneError(f'no study {name!r} in {folder.parent}; pass '
                        f'{argument("jobs_dir")} or {argument("storage")}')
    storage = storage or settings['storage']
    try:
        return optuna.load_study(study_name=name,
                                 storage=open_storage(storage))
    except KeyError:
        raise TuneError(f'no study {name!r} in {argument("storage")} '
                        f'{storage}') \
            from None
