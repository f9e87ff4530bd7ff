"""One trial of a study, run as a dasktrain job, and what it tells Optuna.

A trial's job runs this module as its program (``python -m
dasktrain.tuning.trials FOLDER``, see
:func:`dasktrain.jobs.client.submit.submit`'s ``module``).
The training calls :class:`Reporter` after every epoch: it reports the
metric to the study's storage (``trial.report(value, epoch)``) and asks the
study's pruner (``trial.should_prune()``); when the pruner says so it
raises :class:`dasktrain.jobs.job.Pruned`, the training stops at once (its
checkpoint is already written), the job ends ``pruned`` and its GPUs go
back to the queue. When the training ends the trial's program tells the study
itself (:func:`finish`), so a study's record does not depend on the
process that asked for the trial staying alive.

The value told is the *best* value of the metric over the trial's epochs,
and the epoch it came from is the trial's user attribute ``epoch``: Optuna
ranks trials by the value told, never by the values reported, so telling
the last epoch's value would rank a trial that overfits late below one that
never got as good. (A pruned trial's value is Optuna's: its last epoch's.)

:func:`describe_best` and :func:`trial_jobs` read a study's trials back,
for ``dasktrain tune --status`` and notebooks (their table is
:func:`dasktrain.results.trials_table`).
"""
import math
import sys
from pathlib import Path

from dasktrain.errors import UserError, argument
from dasktrain.jobs.job import Job, Pruned
from dasktrain.jobs.worker.train_job import read_spec, train_job


class StorageError(UserError):
    """An Optuna storage that cannot be opened."""


def open_storage(url):
    """An Optuna storage: an SQLAlchemy URL (``sqlite:///abs/path.db``,
    ``postgresql://...``) or the path of a journal file (Optuna's
    ``JournalFileBackend``, safe on NFS). Opening it connects."""
    import optuna
    try:
        if '://' in url:
            return optuna.storages.RDBStorage(url)
        if not Path(url).parent.is_dir():
            raise OSError(f'no folder {Path(url).parent}')
        from optuna.storages.journal import JournalFileBackend
        return optuna.storages.JournalStorage(JournalFileBackend(url))
    except Exception as e:  # drivers, paths, servers: all mean unreachable
        lines = str(e).strip().splitlines() or ['']
        raise StorageError(f'cannot open {argument("storage")} {url} '
                           f'({type(e).__name__}: {lines[0]})') from None


def make_pruner(name, startup_trials=5, warmup_epochs=0):
    """Optuna's pruner for ``--pruner``: never None, which Optuna would
    read as its MedianPruner. No trial is pruned in its first
    ``warmup_epochs`` epochs (epochs are Optuna's steps, from 1)."""
    import optuna
    if name == 'median':
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials,
                                           n_warmup_steps=warmup_epochs + 1)
    if name == 'asha':
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=warmup_epochs + 1)
    return optuna.pruners.NopPruner()


def load_study(trial_spec):
    """The study a trial's job belongs to, with the pruner it was run with
    (Optuna keeps pruners out of its storage)."""
    import optuna
    return optuna.load_study(
        study_name=trial_spec['study'],
        storage=open_storage(trial_spec['storage']),
        pruner=make_pruner(**trial_spec['pruner']))


def best_epoch(rows, metric, maximize):
    """(value, epoch) of the best row for ``metric``; (None, None) if none."""
    rows = [r for r in rows if math.isfinite(r.get(metric, math.nan))]
    if not rows:
        return None, None
    pick = max if maximize else min
    row = pick(rows, key=lambda r: r[metric])  # the first of equal ones
    return row[metric], row['epoch']


def finish(study, trial_id, state, value=None, **attrs):
    """Record a trial's end (and user attributes) unless it has one:
    the trial's program and the study may both try; the first one wins."""
    import optuna
    from optuna.exceptions import UpdateFinishedTrialError
    trial = optuna.trial.Trial(study, trial_id)
    try:
        for key, attr in attrs.items():
            trial.set_user_attr(key, attr)
        study.tell(trial, value if state == optuna.trial.TrialState.COMPLETE
                   else None, state=state, skip_if_finished=True)
    except UpdateFinishedTrialError:
        pass


def outcome(job, trial_spec, state, error=None):
    """What a job that ended in ``state`` means for its trial: Optuna's
    (state, value, user attributes)."""
    from optuna.trial import TrialState
    rows = job.log_rows()
    value, epoch = best_epoch(rows, trial_spec['metric'],
                              trial_spec['direction'] == 'maximize')
    attrs = {'epoch': epoch, 'job': job.id, 'out': str(job.folder / 'out')}
    if state == 'finished' and value is not None:
        return TrialState.COMPLETE, value, attrs
    if state == 'pruned':  # Optuna's value for it is its last epoch's
        attrs['epoch'] = rows[-1]['epoch'] if rows else None
        return TrialState.PRUNED, None, attrs
    attrs['error'] = error or f'job {state}'
    return TrialState.FAIL, None, attrs


class Reporter:
    """The epoch callback of a trial's training: report, then prune."""

    def __init__(self, trial, metric):
        self.trial, self.metric = trial, metric

    def __call__(self, row):
        value = row.get(self.metric)
        if value is None:
            raise UserError(f'{argument("metric")} {self.metric} is not in '
                            f'the log; it has {", ".join(row)}')
        if not math.isfinite(value):
            raise UserError(f'{argument("metric")} {self.metric} became '
                            f'{value} at '
                            f"epoch {row['epoch']}")
        self.trial.report(value, row['epoch'])
        if self.trial.should_prune():
            raise Pruned(f"the pruner stopped it after epoch {row['epoch']} "
                         f'({self.metric} {value:.4g})')


def main(folder, spec=None):
    """The program of a trial's job; returns its exit code. ``spec``: its
    record (default: read from ``folder``)."""
    import optuna
    folder = Path(folder)
    spec = spec or read_spec(folder)
    trial_spec = spec.trial
    job = Job(spec.id, folder)
    study = load_study(trial_spec)
    trial = optuna.trial.Trial(study, trial_spec['id'])
    reporter = Reporter(trial, trial_spec['metric'])
    done = trial.storage.get_trial(trial_spec['id']).intermediate_values
    for row in job.log_rows():  # epochs of a killed attempt not reported
        if row['epoch'] not in done and trial_spec['metric'] in row:
            trial.report(row[trial_spec['metric']], row['epoch'])
    code = train_job(folder, callbacks=[reporter], spec=spec)
    # Told here, before the job's status says it ended: whoever sees the
    # job ended finds its trial ended too.
    lines = job.logs().strip().splitlines()
    state, value, attrs = outcome(
        job, trial_spec, spec.end(code).state.value,
        lines[-1] if lines else f'exit code {code}')
    finish(study, trial_spec['id'], state, value, **attrs)
    return code


# ------------------------------------------------ reading trials back

def params_text(params):
    """``lr=0.001, mode=ipm``: a trial's params in a line."""
    return ', '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}'
                     for k, v in params.items())


def describe_best(study):
    """The best trial in a line; pruned trials are never best."""
    metric = study.user_attrs.get('metric', 'value')
    try:
        best = study.best_trial
    except ValueError:
        return 'best: none yet (no trial completed; pruned trials never count)'
    return (f'best: trial {best.number}, {metric} {best.value:.4g} at epoch '
            f"{best.user_attrs.get('epoch')} ({params_text(best.params)}); "
            f"outputs in {best.user_attrs.get('out')}")


def trial_jobs(study, path=None):
    """The job of each trial that has one, in trial order."""
    return [Job.find(t.user_attrs['job'], path) for t in study.trials
            if 'job' in t.user_attrs]


if __name__ == '__main__':
    sys.exit(main(sys.argv[1], read_spec(sys.argv[1], sys.argv[2:])))
