"""The queue's policy, as a pure function: which waiting jobs start now, on
which worker and GPUs, why each other one waits, and when each is expected
to start or end (:func:`plan`).

The rules are Slurm's with EASY backfill: jobs start in submission order
among those that fit; when the first job in line cannot start, it gets a
reservation (the worker where it can start soonest, given the running
jobs' estimated ends) and a later, smaller job may start before it only
where it cannot delay that reservation: on another worker, on GPUs of that
worker the reserved job will not need, or when it is known to end (its
``--time``) before the reservation begins. A job across workers (its
``ranks``) is a gang: it starts when that many workers have its GPUs (or
a CPU slot) free at once, one rank each, and is reserved the same way on
the workers where its ranks can start soonest. A job with dependencies
(``--after``) is not in line until they finished; one over its user's GPU
limit waits without holding anyone up.

It reads no file and talks to no scheduler: the dispatcher
(:mod:`~dasktrain.jobs.scheduler.dispatch`) gathers its input and
applies its answer.
"""
import collections
import math

from dasktrain.errors import plural

Plan = collections.namedtuple('Plan', 'starts reasons estimates ends')
Plan.__doc__ = """What :func:`plan` decided: ``starts`` a list of
``(job id, worker, [GPU ids])`` to start now, in order (a gang: one per
rank, in rank order); ``reasons`` {job
id: why it waits}; ``estimates`` {job id: {'position', 'start'} for a
queued job, {'end', 'overdue'} for a running one; None: unknown};
``ends`` {job id: why it must end now} (a dependency that can never be
met, a time limit passed)."""

FAILED = ('failed', 'cancelled', 'pruned', 'lost')  # a dependency that
# will not finish: only --after-any runs after it


def _need(job):
    """(GPUs, CPU slots) a job holds (each rank of a gang): a job of 0
    GPUs takes a CPU slot."""
    return (job['gpus'], 0) if job['gpus'] else (0, 1)


def _ranks(job):
    """The workers a job spans at once: its ``ranks`` (a gang), else 1."""
    return job.get('ranks') or 1


class _Pool:
    """Free GPU ids and CPU slots per worker (what the loop hands out)."""

    def __init__(self, workers, running, busy):
        self.order = sorted(workers)
        self.gpus = {w: [g for g in workers[w].get('gpus', ())
                         if g not in busy.get(w, {})] for w in self.order}
        self.cpus = {w: workers[w].get('cpus', 0) for w in self.order}
        self.offers = dict(self.cpus)
        for job in running:
            w = job['worker']
            if w not in self.gpus:
                continue
            held = set(job.get('held') or ())
            self.gpus[w] = [g for g in self.gpus[w] if g not in held]
            self.cpus[w] -= self.slot(w, job)

    def slot(self, w, job):
        """The CPU slots ``job`` holds on ``w``: one for a job of no GPU;
        none for a gang's rank on a worker that offers no slots (it runs
        on one of the worker's threads, as its rank's task does)."""
        if job['gpus'] or (job.get('ranks') and not self.offers[w]):
            return 0
        return 1

    def fits(self, w, job):
        gpus, _ = _need(job)
        return len(self.gpus[w]) >= gpus and self.cpus[w] >= self.slot(w, job)

    def take(self, w, job):
        gpus, _ = _need(job)
        taken, self.gpus[w] = self.gpus[w][:gpus], self.gpus[w][gpus:]
        self.cpus[w] -= self.slot(w, job)
        return taken

    def most_free(self, job):
        gpus, _ = _need(job)
        return max((len(self.gpus[w]) if gpus else self.cpus[w]
                    for w in self.order), default=0)


def _reservation(job, pool, running, workers, busy, now):
    """Where and when the first job in line can start: (time, {worker:
    spare}) with ``spare`` the GPUs (or CPU slots) of that worker it will
    not need then (one worker, or a gang's ``ranks``); time ``math.inf``
    when no running job's end is known; None where it cannot start while
    the GPUs outside the queue stay busy."""
    gpus, cpus = _need(job)
    found = []
    for w in pool.order:
        usable = len([g for g in workers[w].get('gpus', ())
                      if g not in busy.get(w, {})]) if gpus else \
            workers[w].get('cpus', 0)
        if usable < max(gpus, cpus):
            continue  # never here while the busy GPUs stay busy
        free = len(pool.gpus[w]) if gpus else pool.cpus[w]
        when = now
        for r in sorted((r for r in running if r['worker'] == w),
                        key=lambda r: _end(r, now)):
            if free >= max(gpus, cpus):
                break
            held = len(r.get('held') or ()) if gpus else int(not r['gpus'])
            free += held
            when = _end(r, now)
        if free < max(gpus, cpus):
            continue
        found.append((when, -free, w))
    found.sort()
    if len(found) < _ranks(job):
        return None
    found = found[:_ranks(job)]
    return max(when for when, _, _ in found), {
        w: -free - max(gpus, cpus) for _, free, w in found}


def _end(job, now):
    end = job.get('end')
    return math.inf if end is None else max(end, now)


def _wait_reason(job, pool, workers, busy):
    """Why ``job``, which fits no worker now (a gang: too few), waits: a
    busy GPU outside the queue (by whom) where that is the difference,
    else the count."""
    gpus, _ = _need(job)
    if _ranks(job) > 1:
        each = plural(gpus, 'GPU') if gpus else 'a CPU slot'
        able = sum(pool.fits(w, job) for w in pool.order)
        return f'needs {_ranks(job)} workers with {each} free, {able} have'
    if not gpus:
        return 'needs a CPU slot, none free'
    for w in pool.order:
        outside = busy.get(w, {})
        if outside and len(pool.gpus[w]) < gpus <= \
                len(pool.gpus[w]) + len(outside):
            gpu, who = sorted(outside.items())[0]
            return f'GPU {gpu} busy outside the queue (by {who})'
    if gpus > max((len(workers[w].get('gpus', ())) for w in pool.order),
                  default=0):
        return f'needs {plural(gpus, "GPU")} on one worker; none has as many'
    return f'needs {plural(gpus, "GPU")}, {pool.most_free(job):g} free'


def _dependency(job, states):
    """(reason to wait, reason to end) for ``job``'s ``after`` list given
    the other jobs' ``states``; (None, None) once it may start."""
    for dep in job.get('after') or ():
        state = states.get(dep)
        if state == 'finished' or (job.get('after_any') and
                                   state in FAILED):
            continue
        if state in FAILED:
            return None, (f'job {dep}, which it runs after, ended {state}; '
                          f'it never ran (--after-any runs it after a '
                          f'failure too)')
        if state is None:
            return None, f'job {dep}, which it runs after, does not exist'
        return f'after job {dep}', None
    return None, None


def _step(queued, running, workers, now, busy, limit, states):
    """One pass of the rules at ``now``: (starts, reasons, ends)."""
    pool = _Pool(workers, running, busy)
    held = collections.Counter()
    for r in running:
        held[r['user']] += r['gpus']
    starts, reasons, ends = [], {}, {}
    first = reserve = None  # the first job in line that cannot start
    for job in queued:
        wait, end = _dependency(job, states)
        if end:
            ends[job['id']] = end
            continue
        if wait:
            reasons[job['id']] = wait
            continue
        if limit is not None and job['gpus'] and \
                held[job['user']] + job['gpus'] * _ranks(job) > limit:
            reasons[job['id']] = (f'user limit reached ({job["user"]} holds '
                                  f'{held[job["user"]]:g} of '
                                  f'{plural(limit, "GPU")})')
            continue
        able = [w for w in pool.order if pool.fits(w, job)]
        if first is not None:
            able = [w for w in able if _backfills(job, w, reserve, now)]
        if len(able) >= _ranks(job):
            # the tightest fits keep the larger holes for larger jobs
            for w in sorted(able, key=lambda w: (len(pool.gpus[w]), w))[
                    :_ranks(job)]:
                if first is not None and reserve is not None and \
                        w in reserve[1] and \
                        not _ends_before(job, reserve, now):
                    reserve[1][w] -= max(_need(job))
                gpus = pool.take(w, job)
                held[job['user']] += job['gpus']
                starts.append((job['id'], w, gpus))
                running = running + [dict(job, worker=w, held=gpus,
                                          end=_planned_end(job, now))]
            continue
        if first is None:
            first = job
            reserve = _reservation(job, pool, running, workers, busy, now)
            reasons[job['id']] = _wait_reason(job, pool, workers, busy)
        elif sum(pool.fits(w, job) for w in pool.order) >= _ranks(job):
            reasons[job['id']] = f'behind job {first["id"]} (first in line)'
        else:
            reasons[job['id']] = _wait_reason(job, pool, workers, busy)
    return starts, reasons, ends


def _planned_end(job, now):
    return None if job.get('time') is None else now + job['time']


def _ends_before(job, reserve, now):
    # An unknown reservation time may be any moment (a running job of
    # unknown length can end now): nothing is known to end before it.
    return job.get('time') is not None and reserve[0] != math.inf and \
        now + job['time'] <= reserve[0]


def _backfills(job, w, reserve, now):
    """Whether ``job`` may start on ``w`` before the first job in line:
    never delaying its reservation ``reserve`` (None: it can never start
    while the GPUs outside the queue stay busy, so nothing is held for
    it)."""
    if reserve is None or w not in reserve[1]:
        return True
    return max(_need(job)) <= reserve[1][w] or \
        _ends_before(job, reserve, now)


def plan(queued, running, workers, now, busy=None, max_gpus_per_user=None,
         states=None):
    """Decide which queued jobs start now, why the others wait, and when
    each job is expected to start or end.

    Parameters
    ----------
    queued : list of dict
        The waiting jobs in submission order, each ``{'id', 'user',
        'gpus'}`` (0: one CPU slot) with optional ``'after'`` (job ids it
        starts after), ``'after_any'`` (True: after they ended in any
        state, not only ``finished``), ``'time'`` (seconds it is
        expected to run: ``--time``; None: unknown) and ``'ranks'`` (a
        gang: that many workers, ``gpus`` each, at once).
    running : list of dict
        The jobs that hold GPUs or CPU slots: ``{'id', 'user', 'gpus',
        'worker', 'held'}`` (``held``: its GPU ids on ``worker``; a gang
        has one entry per worker) with
        optional ``'end'`` (estimated end, seconds since the epoch; None:
        unknown), ``'due'`` (``--time`` after its start: past it, it is
        overdue; without it, past its estimated end) and ``'limit'`` (a
        time by which it must end: ``--time-limit`` after its start).
    workers : dict
        ``{address: {'gpus': [GPU ids], 'cpus': CPU slots}}``. A GPU id is
        the worker's ``CUDA_VISIBLE_DEVICES`` entry (``'0'``,
        ``'GPU-8f6c...'``), or its CUDA ordinal as a string where the
        entries are not known.
    now : float
        Seconds since the epoch.
    busy : dict, optional
        The GPUs used by processes outside the queue, which must not be
        handed out: ``{address: {GPU id: 'who (pid N, M MiB)'}}``, ids as
        in ``workers``; the text is shown in the waiting reason ("GPU 0
        busy outside the queue (by who (pid N, M MiB))"). None or a
        missing worker: nothing busy.
    max_gpus_per_user : int, optional
        GPUs one user's jobs may hold at once (None: no limit).
    states : dict, optional
        ``{job id: state}`` of the jobs that ended (for ``after``); a
        dependency neither there nor queued or running does not exist.

    Returns
    -------
    Plan
        ``starts``, ``reasons``, ``estimates`` and ``ends``: see
        :class:`Plan`. Estimated starts come from replaying these rules
        at each running job's estimated end (jobs of unknown duration
        never end in that replay, so what waits on them has no estimate).

    Examples
    --------
    Two 1-GPU jobs hold a 2-GPU worker; a 2-GPU job is first in line, so
    the 1-GPU job behind it may not take the GPU freed first:

    >>> workers = {'w': {'gpus': ['0', '1'], 'cpus': 1}}
    >>> running = [dict(id='a', user='ann', gpus=1, worker='w',
    ...                 held=['0'], end=100.0),
    ...            dict(id='b', user='ann', gpus=1, worker='w',
    ...                 held=['1'], end=200.0)]
    >>> queued = [dict(id='big', user='bob', gpus=2),
    ...           dict(id='small', user='cy', gpus=1)]
    >>> p = plan(queued, running[1:], workers, now=150.0)
    >>> p.starts, p.reasons['small']
    ([], 'behind job big (first in line)')
    >>> p.estimates['big']
    {'position': 1, 'start': 200.0}

    A job known to end before the reservation backfills:

    >>> quick = dict(id='quick', user='cy', gpus=1, time=30.0)
    >>> plan([queued[0], quick], running[1:], workers, now=150.0).starts
    [('quick', 'w', ['0'])]

    A GPU busy outside the queue is never handed out, and says by whom:

    >>> p = plan(queued[1:], [], workers, now=0.0,
    ...          busy={'w': {'0': 'root (pid 7, 900 MiB)',
    ...                      '1': 'eve (pid 8, 500 MiB)'}})
    >>> p.reasons['small']
    'GPU 0 busy outside the queue (by root (pid 7, 900 MiB))'
    """
    busy = busy or {}
    states = dict(states or {})
    for job in running:
        states[job['id']] = 'running'
    for job in queued:
        states.setdefault(job['id'], 'queued')
    ends = {r['id']: f'its time limit passed ({_clock(r["limit"])})'
            for r in running
            if r.get('limit') is not None and now >= r['limit']}
    starts, reasons, more = _step(queued, running, workers, now, busy,
                                  max_gpus_per_user, states)
    ends.update(more)
    estimates = {r['id']: {'end': r.get('end'), 'overdue': _overdue(r, now)}
                 for r in running}
    position = 0
    for job in queued:
        if job['id'] not in ends:
            position += 1
            estimates[job['id']] = {'position': position, 'start': None}
    for job_id, _, _ in starts:
        estimates[job_id]['start'] = now
    _replay(queued, running, workers, now, busy, max_gpus_per_user,
            states, starts, estimates)
    return Plan(starts, reasons, estimates, ends)


def _overdue(job, now):
    """Past its ``--time`` (``due``), else past its estimated end."""
    due = job.get('due')
    due = job.get('end') if due is None else due
    return due is not None and now > due


def _clock(seconds):
    import time
    return time.strftime('%H:%M', time.localtime(seconds))


def _replay(queued, running, workers, now, busy, limit, states, starts,
            estimates):
    """Fill in the estimated starts: run the rules again at each estimated
    end, as if the jobs ran exactly as long as estimated."""
    by_id = {j['id']: j for j in queued}
    started = {job_id for job_id, _, _ in starts}
    running = [dict(r, end=_end(r, now)) for r in running] + [
        dict(by_id[i], worker=w, held=g,
             end=_end({'end': _planned_end(by_id[i], now)}, now))
        for i, w, g in starts]
    waiting = [j for j in queued if j['id'] not in started and
               j['id'] in estimates]
    states = dict(states)
    for _ in range(len(running) + len(queued)):
        if not waiting:
            return
        t = min((r['end'] for r in running), default=math.inf)
        if t == math.inf:
            return
        for r in [r for r in running if r['end'] <= t]:
            states[r['id']] = 'finished'
        running = [r for r in running if r['end'] > t]
        new, _, _ = _step(waiting, running, workers, t, busy, limit, states)
        for job_id, w, g in new:
            estimates[job_id]['start'] = t
            job = by_id[job_id]
            running.append(dict(job, worker=w, held=g,
                                end=_end({'end': _planned_end(job, t)}, t)))
        begun = {i for i, _, _ in new}
        waiting = [j for j in waiting if j['id'] not in begun]
