"""The cluster's commands: ``dasktrain cluster``, ``submit``, ``jobs``,
``logs``, ``cancel`` and ``result``, registered with :mod:`dasktrain.cli`'s
registry when that module loads; what they drive imports on use.
"""
import argparse
import sys

from dasktrain.commands import Command, Parser, command, train_config


def _add_tls_arguments(parser):
    parser.add_argument('--tls-ca-file', metavar='PEM',
                        help='your own CA certificate, with --tls-cert and '
                             '--tls-key (default: the cluster\'s own CA and '
                             'certificate in ~/.dasktrain/tls, made on first '
                             'use)')
    parser.add_argument('--tls-cert', metavar='PEM')
    parser.add_argument('--tls-key', metavar='PEM')
    parser.add_argument('--insecure', action='store_true',
                        help='no TLS: every user who can reach the port '
                             '(on 127.0.0.1: everyone on this machine) can '
                             'run any code as you')


@command
class Cluster(Command):
    name = 'cluster'
    help = 'start, inspect or stop a Dask cluster on this machine'

    def add_arguments(self, parser):
        actions = parser.add_subparsers(dest='action', metavar='ACTION',
                                        required=True, parser_class=Parser)
        p = actions.add_parser('start', help='start a scheduler and a worker '
                               'owning this machine\'s GPUs, in the '
                               'background')
        p.add_argument('--host', default='127.0.0.1',
                       help='interface to bind (default: %(default)s)')
        p.add_argument('--port', type=int, default=8786,
                       help='scheduler port, 0 for any (default: '
                            '%(default)s)')
        p.add_argument('--dashboard-port', type=int, default=8787,
                       help='dashboard port, 0 for any (default: '
                            '%(default)s)')
        p.add_argument('--gpus', type=int, default=None,
                       help='GPUs the worker advertises (default: all '
                            'found)')
        p.add_argument('--cpu-slots', type=int, default=1,
                       help='jobs at once on a worker without GPUs '
                            '(default: %(default)s)')
        _add_tls_arguments(p)
        p.set_defaults(command_parser=p)
        p = actions.add_parser('status', help='the scheduler, dashboard and '
                               'workers')
        p.add_argument('--scheduler', default=None, metavar='ADDR',
                       help='default: the cluster `dasktrain cluster start` '
                            'recorded')
        p.set_defaults(command_parser=p)
        actions.add_parser('stop', help='shut the cluster down') \
            .set_defaults(command_parser=parser)

    def run(self, args):
        from dasktrain.cluster import local as cluster
        if args.action == 'start':
            state = cluster.start_cluster(
                host=args.host, port=args.port,
                dashboard_port=args.dashboard_port, gpus=args.gpus,
                cpu_slots=args.cpu_slots, tls_ca_file=args.tls_ca_file,
                tls_cert=args.tls_cert, tls_key=args.tls_key,
                insecure=args.insecure)
            from dasktrain.cluster.monitor import links
            tls = ', '.join(state['tls'].values()) if state['tls'] else \
                'none (--insecure)'
            print(f"scheduler: {state['scheduler']}\n"
                  f"dashboard: {state['dashboard']}")
            for what, link in links(state['dashboard']).items():
                print(f'{what}: {link}')
            print(f"worker resources: {state['resources']}\n"
                  f'TLS: {tls}\nrecorded in {cluster.state_path()}')
        elif args.action == 'status':
            from dasktrain.cluster.monitor import links
            status = cluster.cluster_status(args.scheduler)
            print(f"scheduler: {status['scheduler']}\n"
                  f"dashboard: {status['dashboard']}")
            for what, link in links(status['dashboard']).items():
                print(f'{what}: {link}')
            for address, worker in status['workers'].items():
                resources = ', '.join(f'{k}={v:g}' for k, v in
                                      worker['resources'].items())
                print(f"worker {address} ({worker['name']}): "
                      f"{resources or 'no resources'}, "
                      f"{worker['threads']} threads")
        else:
            state = cluster.stop_cluster()
            if state['stale']:
                print(f"no cluster was running at {state['scheduler']} (its "
                      'processes are gone); removed the stale record '
                      f'{cluster.state_path()}')
            else:
                print(f"stopped the cluster at {state['scheduler']}")
        return 0


def add_jobs_dir(parser):
    parser.add_argument('--jobs-dir', default=None, metavar='DIR',
                        help='job folders, on storage every worker sees '
                             '(default: $DASKTRAIN_JOBS_DIR, else '
                             '~/.dasktrain/jobs)')


@command
class Submit(Command):
    name = 'submit'
    help = ('queue a training job on the cluster: dasktrain submit [options]'
            ' -- <dasktrain train options>')

    def add_arguments(self, parser):
        parser.add_argument('--scheduler', default=None, metavar='ADDR',
                            help='default: the cluster `dasktrain cluster '
                                 'start` recorded')
        parser.add_argument('--gpus', type=int, default=1,
                            help='GPUs the job reserves; with --workers in '
                                 'the train options, GPUs per worker; 0 '
                                 'takes one CPU slot instead (a worker '
                                 'without GPUs offers CPU slots: `cluster '
                                 'start --cpu-slots`) (default: '
                                 '%(default)s)')
        parser.add_argument('--name', default=None,
                            help='a label for `dasktrain jobs`')
        add_jobs_dir(parser)
        parser.add_argument('train_args', nargs=argparse.REMAINDER,
                            help='options of `dasktrain train`, after --')

    def run(self, args):
        from dasktrain.cluster.jobs import submit
        if args.gpus < 0:
            args.command_parser.error(f'--gpus must be >= 0, got {args.gpus}')
        config = train_config(args.train_args, 'dasktrain submit --')
        job = submit(config, gpus=args.gpus, name=args.name,
                     scheduler=args.scheduler, path=args.jobs_dir)
        print(job.id)
        return 0


def _when(seconds):
    import time
    return time.strftime('%m-%d %H:%M:%S', time.localtime(seconds)) \
        if seconds else '-'


@command
class Jobs(Command):
    name = 'jobs'
    help = 'list every job with its state, GPUs, progress and times'

    def add_arguments(self, parser):
        add_jobs_dir(parser)
        parser.add_argument('--watch', '-w', action='store_true',
                            help='refresh the table until Ctrl-C')
        parser.add_argument('--interval', type=float, default=2.0,
                            metavar='SECONDS', help='between refreshes '
                            'with --watch (default: %(default)s)')

    def run(self, args):
        import time
        if args.interval <= 0:
            args.command_parser.error(
                f'--interval must be > 0, got {args.interval:g}')
        if not args.watch:
            print(self.table(args.jobs_dir, _ask_once))
            return 0
        clear = '\x1b[H\x1b[2J' if sys.stdout.isatty() else '\n'
        poller = _SchedulerPoller(args.interval)
        try:
            while True:
                table = self.table(args.jobs_dir, poller.ask)
                sys.stdout.write(f"{clear}every {args.interval:g} s, Ctrl-C "
                                 f"to stop; {time.strftime('%H:%M:%S')}\n"
                                 f'{table}\n')
                sys.stdout.flush()
                time.sleep(args.interval)
        except KeyboardInterrupt:  # the way out of --watch, not an error
            poller.stop()
            return 0

    @staticmethod
    def table(jobs_dir, ask=None):
        """The jobs table; a job folder that cannot be read is one row
        'unreadable' and a line with its reason below, never an error.

        ``ask(keys, address)`` says what the scheduler at ``address`` knows
        of those job keys (None: unreachable); without it the table reads
        the job folders only."""
        from dasktrain.cluster.jobs import DONE, JobError, list_jobs
        jobs, unreadable = [], []
        for job in list_jobs(jobs_dir):
            try:  # one bad job folder must not hide the others
                jobs.append((job, job.spec(), job.status()))
            except JobError as e:
                unreadable.append((job, str(e)))
        live = [(j, spec) for j, spec, s in jobs if s['state'] not in DONE]
        known = {}
        if live and ask is not None:
            known = ask([j.key for j, _ in live], live[0][1].get('scheduler'))
        rows = [('ID', 'STATE', 'GPUS', 'PROGRESS', 'ACCURACY', 'SUBMITTED',
                 'STARTED', 'ENDED', 'SCHEDULER')]
        for job, spec, s in jobs:
            accuracy = f"{s['accuracy']:.4f}" if s['accuracy'] is not None \
                else '-'
            gpus = ','.join(s['gpus']) if s.get('gpus') else \
                str(spec.get('gpus', '-'))
            seen = '-' if s['state'] in DONE else 'unreachable' \
                if known is None else known.get(job.key, 'unknown')
            rows.append((job.id, s['state'], gpus,
                         f"{s['epoch']}/{s['epochs']}", accuracy,
                         _when(spec['submitted']), _when(s.get('started')),
                         _when(s.get('ended')), seen))
        rows += [(job.id, 'unreadable') + ('-',) * 7
                 for job, _ in unreadable]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                 for r in rows]
        lines += [f'unreadable: {reason}' for _, reason in unreadable]
        return '\n'.join(lines)


def _ask_once(keys, address):
    """What the scheduler knows of ``keys``, if it answers within 3 s."""
    from dasktrain.cluster.jobs import scheduler_states
    from dasktrain.cluster.local import connect
    try:
        with connect(address, timeout=3) as client:
            return scheduler_states(keys, client)
    except Exception:  # unreachable: the files alone still tell
        return None


class _SchedulerPoller:
    """``jobs --watch``'s view of the scheduler: one client for the whole
    watch, asked in a daemon thread, so that neither a slow connect nor a
    scheduler that stopped answering delays a refresh or Ctrl-C.

    :meth:`ask` never blocks: it returns the last answer (``{}`` until the
    first, None while unreachable) and names the keys for the next one.
    """

    def __init__(self, interval):
        import threading
        self.interval = interval
        # (keys asked, the scheduler's answer), or None while unreachable
        self.answer, self.wanted = (set(), {}), ([], None)
        self.stopped = threading.Event()
        self.client = None
        threading.Thread(target=self._poll, name='jobs-watch-scheduler',
                         daemon=True).start()

    def ask(self, keys, address):
        self.wanted = (keys, address)
        if self.answer is None:
            return None
        asked, known = self.answer
        # a job the scheduler was not asked about yet: '-', not 'unknown'
        return {k: known.get(k, 'unknown') if k in asked else '-'
                for k in keys}

    def _poll(self):
        from dasktrain.cluster.jobs import scheduler_states
        from dasktrain.cluster.local import connect
        address = None
        while not self.stopped.is_set():
            keys, wanted = self.wanted
            try:
                if keys and (self.client is None or wanted != address):
                    self._close()
                    address = wanted
                    self.client = connect(address, timeout=3)
                if keys:
                    self.answer = (set(keys),
                                   scheduler_states(keys, self.client))
            except Exception:  # unreachable: the files alone still tell
                self.answer = None
                self._close()
            self.stopped.wait(self.interval)
        self._close()

    def _close(self):
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close(timeout=1)
            except Exception:  # already gone: nothing to close
                pass

    def stop(self):
        self.stopped.set()


class _JobCommand(Command):
    def add_arguments(self, parser):
        parser.add_argument('id', help='a job id from `dasktrain jobs`')
        add_jobs_dir(parser)

    def job(self, args):
        from dasktrain.cluster.jobs import Job
        return Job.find(args.id, args.jobs_dir)


@command
class Logs(_JobCommand):
    name = 'logs'
    help = "print a job's output (its traceback, if it failed)"

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument('--follow', '-f', action='store_true',
                            help='keep printing until the job ends')

    def run(self, args):
        import time
        from dasktrain.cluster.jobs import DONE
        job = self.job(args)
        shown = 0
        while True:
            done = job.status()['state'] in DONE
            text = job.logs()
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
            if done or not args.follow:
                return 0
            time.sleep(0.5)


@command
class Cancel(_JobCommand):
    name = 'cancel'
    help = 'cancel a queued or running job'

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument('--timeout', type=float, default=30.0,
                            metavar='S', help='seconds to wait for a running'
                            ' job to stop (default: %(default)s)')

    def run(self, args):
        import time
        from dasktrain.cluster.jobs import DONE
        job = self.job(args)
        was = job.status()['state']
        job.cancel()
        deadline = time.monotonic() + args.timeout
        state = job.status()['state']
        while state not in DONE and time.monotonic() < deadline:
            time.sleep(0.2)  # a running job stops within a second or so
            state = job.status()['state']
        if was in DONE:
            print(f'{job.id}: already {was}')
        elif state in DONE:
            print(f'{job.id}: {state}')
        else:  # e.g. its worker is gone: the flag stops any rerun
            print(f'{job.id}: cancel requested, still {state} after '
                  f'{args.timeout:g} s')
        return 0


@command
class Result(_JobCommand):
    name = 'result'
    help = "a finished job's final metrics and where its outputs are"

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument('--wait', action='store_true',
                            help='wait for the job to end')

    def run(self, args):
        from dasktrain.cluster.jobs import DONE, JobError
        job = self.job(args)
        status = job.status()
        if status['state'] not in DONE and not args.wait:
            raise JobError(f"job {job.id} is {status['state']} (epoch "
                           f"{status['epoch']}/{status['epochs']}); pass "
                           '--wait to wait for it')
        summary = job.result()
        for key, value in summary['final'].items():
            print(f'{key}: {value:.6g}' if isinstance(value, float)
                  else f'{key}: {value}')
        print(f"outputs: {summary['out']}")
        return 0
