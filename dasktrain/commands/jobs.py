"""The job queue's commands: ``dasktrain submit``, ``jobs`` (the table,
once or ``--watch``), ``logs``, ``cancel``, ``requeue`` and ``result``;
each asks a cluster of your own or a shared cluster's socket, as
:func:`dasktrain.jobs.client.route.shared_queue` decides."""
import argparse
import sys
import time

from dasktrain.commands import (
    Command,
    add_jobs_dir,
    add_scheduler,
    output_closed,
    printable,
    train_config,
)


class Submit(Command):
    name = 'submit'
    help = ('queue a job on the cluster: dasktrain submit [options] -- '
            '<dasktrain train options>, or -- PROGRAM ARGS... for any '
            'program')

    def add_arguments(self, parser):
        add_scheduler(parser)
        parser.add_argument('--gpus', type=int, default=1,
                            help='GPUs the job reserves; with --workers in '
                                 'the train options, GPUs per worker; 0 '
                                 'takes one CPU slot instead (a worker '
                                 'without GPUs offers CPU slots: `cluster '
                                 'start --cpu-slots`) (default: '
                                 '%(default)s)')
        parser.add_argument('--name', default=None,
                            help='a label for `dasktrain jobs`')
        parser.add_argument('--env', action='append', metavar='KEY=VALUE',
                            help='a program: a variable added to your '
                                 'environment as it is now (repeatable)')
        parser.add_argument('--grace', type=float, default=None,
                            metavar='SECONDS',
                            help='a program: seconds between a cancel\'s '
                                 'SIGTERM and its SIGKILL, at most the '
                                 'cluster\'s `cluster start --max-grace` '
                                 '(default: that longest, 30 unless the '
                                 'cluster says otherwise)')
        parser.add_argument('--requeue', action='store_true',
                            help='a program: start it again if its worker '
                                 'dies (it resumes by itself); else it '
                                 'ends lost')
        parser.add_argument('--notify', default=None, metavar='URL',
                            help='when the job ends, POST a Slack-'
                                 'compatible message to this webhook URL '
                                 '(or mail it: mailto:ADDR, with a local '
                                 'MTA) (default: the cluster\'s, `cluster '
                                 'start --notify`)')
        parser.add_argument('--after', metavar='ID[,ID]', default=None,
                            help='start only once these jobs finished')
        parser.add_argument('--after-any', action='store_true',
                            help='with --after: once they ended, finished '
                                 'or not (without it, one that fails '
                                 'fails this job too)')
        parser.add_argument('--time', default=None, metavar='DURATION',
                            help='how long it is expected to run (90m, '
                                 '2h, 1h30m, 2:00:00): its estimated end '
                                 'in `jobs`, flagged once past')
        parser.add_argument('--time-limit', default=None,
                            metavar='DURATION',
                            help='how long it may run: stopped (failed) '
                                 'once past')
        parser.add_argument('--mem', default=None, metavar='SIZE',
                            help='memory its processes may use together '
                                 '(512M, 8G): past it the kernel kills '
                                 'them (memory.max of its cgroup; refused '
                                 'where the cluster cannot cap memory)')
        add_jobs_dir(parser)
        parser.add_argument('train_args', nargs=argparse.REMAINDER,
                            help='after --: options of `dasktrain train`, '
                                 'or a program and its arguments')

    def run(self, args):
        from dasktrain.jobs.client.submit import parse_env, queue_request
        from dasktrain.jobs.request import JobRequest, Program, Training
        from dasktrain.notify import check_target
        if args.gpus < 0:
            args.command_parser.error(f'--gpus must be >= 0, got {args.gpus}')
        check_target(args.notify)  # before anything connects
        words = args.train_args[1:] if args.train_args[:1] == ['--'] \
            else args.train_args
        # After --: a program and its arguments, or `dasktrain train`'s
        # flags (a run, which its job runs as a program of its own).
        if words and not words[0].startswith('-'):
            program = Program.of(words, parse_env(args.env),
                                 grace=args.grace, requeue=args.requeue)
        else:
            program = Training.of(train_config(args.train_args,
                                               'dasktrain submit --'))
        request = JobRequest.of(program, args.gpus, args.name, args.notify,
                                args.after, args.after_any, args.time,
                                args.time_limit, args.mem)
        print(queue_request(request, scheduler=args.scheduler,
                            path=args.jobs_dir).id)
        return 0


PER_PAGE = 100  # as dasktrain.jobs.status.PER_PAGE (not imported at start)

# Seconds between asking the scheduler whether a job it should hold is
# still there (`logs --follow`, `result --wait`): cheap, and a lost job is
# reported within this long.
LOST_CHECK = 5.0


def _when(seconds):
    return time.strftime('%m-%d %H:%M:%S', time.localtime(seconds)) \
        if seconds else '-'


def estimate_words(state, view):
    """The jobs table's ESTIMATE (labelled: an estimate) of a job in
    ``state`` from the queue's ``view`` of it.

    >>> estimate_words('queued', {'position': 2, 'start': None})
    '#2, start unknown'
    >>> estimate_words('running', {'end': 0.0, 'overdue': True})[-7:]
    'OVERDUE'
    """
    if state == 'queued' and view.get('position'):
        start = view.get('start')
        return (f'#{view["position"]}, start ~{_when(start)}' if start
                else f'#{view["position"]}, start unknown')
    # a job the queue started before its worker says so: already its end
    if state in ('queued', 'running') and 'end' in view:
        end = view.get('end')
        if end is None:
            return 'end unknown'
        return f'end ~{_when(end)}' + (' OVERDUE' if view.get('overdue')
                                       else '')
    return '-'


class Jobs(Command):
    name = 'jobs'
    help = ('list the queued and running jobs, and those that ended in the '
            'last day, with their state, GPUs, progress and times')

    def add_arguments(self, parser):
        add_jobs_dir(parser)
        parser.add_argument('--all', '-a', action='store_true',
                            help='every job the queue keeps, however long '
                                 'ago it ended: the history')
        who = parser.add_mutually_exclusive_group()
        who.add_argument('--user', '-u', default=None,
                         help="this user's jobs only")
        who.add_argument('--mine', action='store_true',
                         help='your jobs only')
        parser.add_argument('--page', type=int, default=1,
                            help=f'which page of {PER_PAGE} rows '
                                 '(default: %(default)s)')
        parser.add_argument('--watch', '-w', action='store_true',
                            help='refresh the table until Ctrl-C')
        parser.add_argument('--interval', type=float, default=2.0,
                            metavar='SECONDS', help='between refreshes '
                            'with --watch (default: %(default)s)')

    def run(self, args):
        if args.interval <= 0:
            args.command_parser.error(
                f'--interval must be > 0, got {args.interval:g}')
        if args.page < 1:
            args.command_parser.error(f'--page must be >= 1, got '
                                      f'{args.page}')
        from dasktrain.jobs.client.route import rows
        from dasktrain.jobs.job import current_user
        from dasktrain.jobs.scheduler.query import (
            SchedulerPoller,
            ask_scheduler,
        )
        cut = {'everything': args.all, 'page': args.page,
               'user': current_user() if args.mine else args.user}
        if not args.watch:
            print(self.table(*rows(args.jobs_dir, ask_scheduler, **cut)))
            return 0
        clear = '\x1b[H\x1b[2J' if sys.stdout.isatty() else '\n'
        poller = SchedulerPoller(args.interval)
        try:
            while not output_closed():  # `| head`: nothing more to show
                table = self.table(*rows(args.jobs_dir, poller.ask, **cut))
                sys.stdout.write(f"{clear}every {args.interval:g} s, Ctrl-C "
                                 f"to stop; {time.strftime('%H:%M:%S')}\n"
                                 f'{table}\n')
                sys.stdout.flush()
                if not output_closed():
                    time.sleep(args.interval)
        except KeyboardInterrupt:  # the way out of --watch, not an error
            pass
        poller.stop()
        return 0

    @staticmethod
    def table(rows, unreadable=(), counts=None):
        """The jobs table of ``rows`` (as
        :func:`dasktrain.jobs.status.shown` gives them: a cluster of
        your own's job folders and scheduler, or a shared cluster's
        socket); a job folder that cannot be read is one row 'unreadable'
        and a line with its reason below, never an error; every field
        :func:`~dasktrain.commands.printable`; ``counts``: which page of
        how many, and the ended jobs left out."""
        lines = [('ID', 'NAME', 'USER', 'STATE', 'GPUS', 'PROGRESS',
                  'ACCURACY', 'SUBMITTED', 'STARTED', 'ENDED', 'SCHEDULER',
                  'ESTIMATE', 'REASON')]
        for r in rows:
            view = r.get('view') or {}
            lines.append((
                r['id'], r['name'], r['user'], r['state'] +
                (f" ({r['ending']})" if r.get('ending') else ''), r['gpus'],
                r['progress'], '-' if r['accuracy'] is None else
                f"{r['accuracy']:.4f}", _when(r['submitted']),
                _when(r['started']), _when(r['ended']), r['seen'],
                estimate_words(r['state'], view), view.get('reason') or '-'))
        lines += [(job_id, '-', '-', 'unreadable') + ('-',) * 9
                  for job_id, _ in unreadable]
        lines = [tuple(printable(c) for c in r) for r in lines]
        widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
        text = ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                for r in lines]
        text += [f'unreadable: {printable(reason)}'
                 for _, reason in unreadable]
        if any(r[11] != '-' for r in lines[1:]):
            text.append('ESTIMATE: the queue\'s estimate (#position in '
                        'line), from --time and measured epoch times')
        counts = counts or {}
        if counts.get('pages', 1) > 1:
            text.append(f"page {counts['page']} of {counts['pages']} "
                        f"({counts['total']} jobs): --page "
                        f"{counts['page'] % counts['pages'] + 1} for "
                        'another')
        if counts.get('older'):
            text.append(f"{counts['older']} job(s) that ended more than a "
                        'day ago not shown: --all lists them')
        return '\n'.join(text)


class _JobCommand(Command):
    def add_arguments(self, parser):
        parser.add_argument('id', help='a job id from `dasktrain jobs`')
        add_jobs_dir(parser)

    def job(self, args):
        """The job, from a cluster of your own or a shared cluster's
        socket (:func:`dasktrain.jobs.client.route.find` decides)."""
        from dasktrain.jobs.client.route import find
        return find(args.id, args.jobs_dir)


class Logs(_JobCommand):
    name = 'logs'
    help = "print a job's output (its traceback, if it failed)"

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument('--follow', '-f', action='store_true',
                            help='keep printing until the job ends')
        parser.add_argument('--raw', action='store_true',
                            help='print its output as written, control '
                                 'characters and all (by default they are '
                                 'escaped, but newlines, tabs and carriage '
                                 'returns)')

    def run(self, args):
        from dasktrain.jobs.job import DONE, JobError
        from dasktrain.jobs.scheduler.query import ask_scheduler
        job = self.job(args)
        offset, checked, last = 0, time.monotonic(), '\n'
        while True:
            done = job.status()['state'] in DONE
            while True:  # all there is now, a chunk at a time
                text, offset = job.read_log(offset)
                sys.stdout.write(text if args.raw else
                                 printable(text, keep='\n\t\r'))
                sys.stdout.flush()
                if not text:
                    break
                last = text[-1]
            if done or not args.follow or output_closed():
                # A last line cut short (a process killed mid-line, a
                # progress bar's \r) ends here, not in the shell's prompt.
                if last != '\n' and not args.raw:
                    print()
                return 0
            if time.monotonic() - checked > LOST_CHECK:
                checked = time.monotonic()
                reason = job.lost_reason(ask_scheduler)
                if reason:
                    raise JobError(reason)
            time.sleep(0.5)


class Cancel(_JobCommand):
    name = 'cancel'
    help = 'cancel a queued or running job'

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument('--timeout', type=float, default=60.0,
                            metavar='S', help='seconds to wait for a running'
                            ' job to stop: its grace, then SIGKILL (at most '
                            'the cluster\'s --max-grace) (default: '
                            '%(default)s)')

    def run(self, args):
        from dasktrain.jobs.job import DONE, JobError

        def state_now(told=None):
            # A job whose files cannot be read: what the cancel answered.
            try:
                state = job.status()['state']
            except JobError:
                state = 'unreadable'
            return told if state == 'unreadable' and told else state
        job = self.job(args)
        was = state_now()
        told = job.cancel()  # a shared cluster's answer: its state now
        deadline = time.monotonic() + args.timeout
        state = state_now(told)
        while state not in DONE and time.monotonic() < deadline:
            time.sleep(0.2)  # a running job stops within a second or so
            state = state_now(told)
        if was in DONE:
            print(f'{job.id}: already {was}')
        elif state in DONE:
            print(f'{job.id}: {state}')
        else:  # e.g. its worker is gone: the flag stops any rerun
            print(f'{job.id}: cancel requested, still {state} after '
                  f'{args.timeout:g} s')
        return 0


class Requeue(_JobCommand):
    name = 'requeue'
    help = ('hand a job its scheduler lost (a stopped or restarted '
            'cluster) to the running cluster; it resumes from its '
            'checkpoint')

    def add_arguments(self, parser):
        super().add_arguments(parser)
        add_scheduler(parser)

    def run(self, args):
        from dasktrain.cluster.local import connect
        from dasktrain.jobs.client.route import shared_queue
        from dasktrain.jobs.job import JobError
        from dasktrain.jobs.scheduler.recovery import orphans, requeue
        door = shared_queue(args.scheduler, args.jobs_dir)
        if door is not None:  # a shared cluster: its server decides
            print(f'{args.id}: queued on {door.requeue(args.id)}')
            return 0
        job = self.job(args)
        state = job.status()['state']
        if state in ('queued', 'running') and not orphans([job]):
            raise JobError(f'job {job.id} is {state} on its scheduler '
                           f"({job.spec().scheduler}); nothing to "
                           'requeue')
        with connect(args.scheduler) as client:
            requeue(job, client)
            print(f'{job.id}: queued on {client.scheduler.address}')
        return 0


class Result(_JobCommand):
    name = 'result'
    help = "a finished job's final metrics and where its outputs are"

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument('--wait', action='store_true',
                            help='wait for the job to end')

    def run(self, args):
        from dasktrain.jobs.job import DONE, JobError
        from dasktrain.jobs.scheduler.query import ask_scheduler
        job = self.job(args)
        job.spec()  # yours to read, or one line saying whose it is
        status = job.status()
        if status['state'] not in DONE and not args.wait:
            raise JobError(f"job {job.id} is {status['state']} (epoch "
                           f"{status.get('epoch')}/{status.get('epochs')});"
                           ' pass --wait to wait for it')
        while status['state'] not in DONE:
            reason = job.lost_reason(ask_scheduler)
            if reason:
                raise JobError(reason)
            try:
                job.result(timeout=LOST_CHECK)
            except TimeoutError:
                pass
            status = job.status()
        summary = job.result()
        if not summary['final']:
            raise JobError(f'job {job.id} finished, but its log '
                           f"{summary['out']}/log is missing or damaged; "
                           f"its outputs: {summary['out']}")
        for key, value in summary['final'].items():
            print(printable(f'{key}: {value:.6g}' if isinstance(value, float)
                            else f'{key}: {value}'))
        print(f"outputs: {printable(summary['out'])}")
        return 0
