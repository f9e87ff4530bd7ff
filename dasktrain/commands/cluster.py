"""``dasktrain cluster start|status|stop``: a Dask cluster on this machine,
with the links to its dashboard, jobs page and metrics; a cluster of
your own, or (``--shared``, as root) one queue for every user of the
machine (:mod:`dasktrain.cluster.shared`)."""
from dasktrain.commands import (
    Command,
    Parser,
    add_jobs_dir,
    add_scheduler,
    printable,
)
from dasktrain.errors import plural


def _add_shared_arguments(parser, what):
    parser.add_argument('--shared', action='store_true', help=what)
    parser.add_argument('--shared-dir', metavar='DIR', default=None,
                        help='with --shared: its machine-wide folder '
                             '(default: $DASKTRAIN_SHARED_DIR, else '
                             '/var/lib/dasktrain)')


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


def offered(state):
    """What a started cluster's workers offer, in words.

    >>> offered({'resources': 'CPU=1', 'workers': 2})
    'CPU=1 on each of 2 workers'
    >>> offered({'resources': 'GPU=2 CPU=1, GPU=1 CPU=1', 'workers': 2})
    'GPU=2 CPU=1, GPU=1 CPU=1 (2 workers)'
    """
    workers, resources = state.get('workers') or 1, state['resources']
    if workers == 1:
        return resources
    if ',' in resources:
        return f'{resources} ({workers} workers)'
    return f'{resources} on each of {workers} workers'


def moved(asked, link):
    """Why the dashboard is not on the port asked for, in words (Dask
    moves it to a free one where that port is taken), or ''.

    >>> print(moved(8787, 'http://127.0.0.1:41234/status'))
    ... # doctest: +ELLIPSIS
     (port 8787 is in use, by another cluster or program: --dashboard-port...
    >>> moved(0, 'http://127.0.0.1:41234/status'), moved(8787, None)
    ('', '')
    """
    from urllib.parse import urlsplit
    try:
        port = urlsplit(link).port if link else None
    except ValueError:
        port = None
    if not asked or port is None or port == asked:
        return ''
    return (f' (port {asked} is in use, by another cluster or program: '
            '--dashboard-port to choose)')


class Cluster(Command):
    name = 'cluster'
    help = 'start, inspect or stop a Dask cluster on this machine'

    def add_arguments(self, parser):
        actions = parser.add_subparsers(dest='action', metavar='ACTION',
                                        required=True, parser_class=Parser)
        p = actions.add_parser('start', help='start a scheduler and a worker '
                               'owning this machine\'s GPUs (or --workers '
                               'N sharing them out), in the background')
        p.add_argument('--host', default='127.0.0.1',
                       help='interface to bind (default: %(default)s)')
        p.add_argument('--port', type=int, default=8786,
                       help='scheduler port, 0 for any (default: '
                            '%(default)s)')
        p.add_argument('--dashboard-port', type=int, default=8787,
                       help='dashboard port, 0 for any (default: '
                            '%(default)s)')
        p.add_argument('--dashboard-host', default=None, metavar='HOST',
                       help='interface of the dashboard, jobs page and '
                            'metrics, which anyone who reaches it may read '
                            '(default: --host)')
        p.add_argument('--gpus', type=int, default=None,
                       help='GPUs the workers advertise (default: all '
                            'found)')
        p.add_argument('--workers', type=int, default=1, metavar='N',
                       help='Dask workers on this machine, its GPUs shared '
                            'out among them (each its own): a job across '
                            'N workers (submit -- --workers N) runs here '
                            '(default: %(default)s)')
        p.add_argument('--cpu-slots', type=int, default=1,
                       help='CPU jobs (--gpus 0) at once on each worker '
                            '(default: %(default)s)')
        p.add_argument('--notify', default=None, metavar='URL',
                       help='tell every job\'s end that names no --notify '
                            'of its own to this webhook URL (Slack-'
                            'compatible JSON) or mailto:ADDR')
        p.add_argument('--busy-mib', type=float, default=None, metavar='MIB',
                       help='a GPU on which a process outside the queue '
                            'holds more memory than this (NVML) is busy: '
                            'no job gets it until it is free (default: '
                            '256)')
        p.add_argument('--max-gpus-per-user', type=int, default=None,
                       metavar='K',
                       help='GPUs one user\'s jobs may hold at once; the '
                            'others wait, "user limit reached" (default: '
                            'no limit)')
        p.add_argument('--max-grace', type=float, default=None,
                       metavar='S',
                       help='the longest a stopped job gets between SIGTERM '
                            'and SIGKILL, whatever it asked (default: 30)')
        p.add_argument('--pids-per-job', type=int, default=None,
                       metavar='N',
                       help='processes one job may have at once (pids.max '
                            'of its cgroup; default: no limit)')
        p.add_argument('--allow-clear-nccl', action='store_true',
                       default=None,
                       help='let a job\'s GPU ranks on several machines sum '
                            'over NCCL, whose sockets are neither encrypted '
                            'nor authenticated (default with --shared: no, '
                            'sealed links instead; else yes)')
        p.add_argument('--cgroup', default=None, metavar='PATH',
                       help='the cgroup v2 folder its jobs\' cgroups go '
                            'under, e.g. a systemd unit\'s delegated one '
                            '(default: one beside this command\'s own)')
        p.add_argument('--notify-allow', action='append', default=None,
                       metavar='RULE',
                       help='where job notifications may go (repeatable): '
                            'public, mailto, any, a network (10.0.0.0/8) '
                            'or a URL prefix (default with --shared: '
                            'public and mailto; else any)')
        p.add_argument('--keep-finished', default=None, metavar='DURATION',
                       help='purge a job (its folder, outputs included) '
                            'this long after it ended; never to keep all '
                            '(default with --shared: 30d; else never)')
        p.add_argument('--max-queued-per-user', type=int, default=None,
                       metavar='N',
                       help='with --shared: jobs one user may have queued '
                            'or running at once (default: 1000)')
        p.add_argument('--max-bytes-per-user', default=None, metavar='SIZE',
                       help='with --shared: bytes of one user\'s job files '
                            'the queue keeps for them, environments and '
                            'copied files (default: 256M)')
        _add_tls_arguments(p)
        add_jobs_dir(p)
        _add_shared_arguments(p, 'one queue for every user of this machine, '
                              'each job run as its submitter (as root: '
                              'sudo); users submit through its socket, '
                              'never to Dask')
        p.set_defaults(command_parser=p)
        p = actions.add_parser('status', help='the scheduler, dashboard and '
                               'workers')
        add_scheduler(p)
        p.set_defaults(command_parser=p)
        p = actions.add_parser(
            'stop', help='shut the cluster down; its queued and running '
            'jobs are cancelled (recorded so), unless --requeue or --wait')
        how = p.add_mutually_exclusive_group()
        how.add_argument('--requeue', action='store_true',
                         help='leave its jobs queued: the next `cluster '
                              'start` runs them (training resumes from its '
                              'checkpoint)')
        how.add_argument('--wait', nargs='?', type=float, const=-1.0,
                         default=None, metavar='S',
                         help='first wait until its jobs ended (at most S '
                              'seconds, then stop as with --requeue)')
        add_jobs_dir(p)
        _add_shared_arguments(p, 'the shared cluster (as root: sudo); its '
                              'jobs are every user\'s')
        p.set_defaults(command_parser=p)

    def run(self, args):
        from dasktrain.cluster import local as cluster
        from dasktrain.cluster import shared
        if args.action in ('start', 'stop'):
            if args.shared_dir is not None and not args.shared:
                args.command_parser.error('--shared-dir needs --shared')
            if args.shared and args.jobs_dir is not None:
                args.command_parser.error(
                    "--jobs-dir and --shared: a shared cluster's jobs are "
                    'in its --shared-dir')
            if args.shared:
                shared.check_root()  # one line, before anything starts
                if args.action == 'start':
                    shared.check_install()
        if args.action == 'start':
            for flag in ('max_gpus_per_user', 'workers'):
                value = getattr(args, flag)  # before anything starts
                if value is not None and value < 1:
                    args.command_parser.error(
                        f'--{flag.replace("_", "-")} must be >= 1, got '
                        f'{value}')
            start = shared.start_shared if args.shared else \
                cluster.start_cluster
            more = {'root': args.shared_dir} if args.shared else {}
            state = start(
                host=args.host, port=args.port,
                dashboard_port=args.dashboard_port, gpus=args.gpus,
                cpu_slots=args.cpu_slots, tls_ca_file=args.tls_ca_file,
                tls_cert=args.tls_cert, tls_key=args.tls_key,
                insecure=args.insecure, dashboard_host=args.dashboard_host,
                notify=args.notify, busy_mib=args.busy_mib,
                cgroup=args.cgroup, limits=self.limits(args),
                workers=args.workers, **more)
            from dasktrain.jobs.scheduler.metrics import links
            tls = ', '.join(state['tls'].values()) if state['tls'] else \
                'none (--insecure)'
            print(f"scheduler: {state['scheduler']}\n"
                  f"dashboard: {state['dashboard']}"
                  f"{moved(args.dashboard_port, state['dashboard'])}")
            for what, link in links(state['dashboard']).items():
                print(f'{what}: {link}')
            where = state.get('shared')
            from dasktrain.containment import Containment
            print(f'worker resources: {offered(state)}\n'
                  f"jobs kept in: {Containment(**state['contain']).words()}"
                  f'\nTLS: {tls}\nrecorded in '
                  f'{where.record if where else cluster.state_path()}')
            if where:
                print(f'shared: every user submits through {where.socket}; '
                      f'their jobs in {where.jobs}')
            if state.get('notify'):
                from dasktrain.notify import redacted
                print(f"jobs' ends told to: {redacted(state['notify'])}")
            self.recover(state, where.jobs if where else args.jobs_dir,
                         args.max_gpus_per_user)
        elif args.action == 'status':
            from dasktrain.jobs.client.route import shared_queue
            from dasktrain.jobs.scheduler.metrics import links
            door = shared_queue(args.scheduler)
            status = door.cluster() if door is not None else \
                cluster.cluster_status(args.scheduler)
            print(f"scheduler: {status['scheduler']}\n"
                  f"dashboard: {status['dashboard']}")
            for what, link in links(status['dashboard']).items():
                print(f'{what}: {link}')
            for address, worker in status['workers'].items():
                resources = ', '.join(f'{k}={v:g}' for k, v in
                                      worker['resources'].items())
                print(printable(f"worker {address} ({worker['name']}): "
                                f"{resources or 'no resources'}, "
                                f"{plural(worker['threads'], 'thread')}"))
            if status.get('contain'):
                print(printable(f"jobs kept in: {status['contain']}"))
            for line in status.get('rules') or ():
                print(printable(line))
            if door is not None:
                owners = ', '.join(status['owners'])
                print(printable(f"shared: the queue's socket {door.path}, "
                                f"owners {owners}; you are {status['you']}"))
        else:
            state = self.stop(cluster, args)
            if state['stale']:
                print(f"no cluster was running at {state['scheduler']} (its "
                      'processes are gone); removed the stale record '
                      f"{state['record']}")
            else:
                print(f"stopped the cluster at {state['scheduler']}")
            for job_id, job_state in state['jobs'].items():
                print(printable(f'job {job_id}: {job_state}'))
        return 0

    @staticmethod
    def limits(args):
        """The settings of ``cluster start``'s limits, from its flags
        (a usage error for a wrong one, before anything starts)."""
        from dasktrain.errors import UserError
        from dasktrain.jobs.fields import parse_size, parse_time
        if not args.shared:
            for flag in ('max_queued_per_user', 'max_bytes_per_user'):
                if getattr(args, flag) is not None:
                    args.command_parser.error(
                        f'--{flag.replace("_", "-")} needs --shared: a '
                        'cluster of your own runs your jobs only')
        try:
            keep = None if args.keep_finished is None else float('inf') \
                if args.keep_finished == 'never' else \
                parse_time(args.keep_finished, 'keep_finished')
            size = None if args.max_bytes_per_user is None else \
                parse_size(args.max_bytes_per_user, 'max_bytes_per_user')
        except UserError as e:
            args.command_parser.error(str(e))
        return {'max_grace': args.max_grace,
                'pids_per_job': args.pids_per_job,
                'notify_allow': args.notify_allow,
                'max_queued_per_user': args.max_queued_per_user,
                'max_bytes_per_user': size, 'keep_finished': keep,
                'allow_clear_nccl': args.allow_clear_nccl}

    @staticmethod
    def recover(state, jobs_dir, max_gpus_per_user=None):
        """Set the queue's per-user GPU limit, then requeue the jobs a
        cluster that is gone left queued or running (this user's, in the
        jobs dir)."""
        from dasktrain.cluster.local import connect, security_from
        from dasktrain.jobs.scheduler.dispatch import set_user_limit
        from dasktrain.jobs.scheduler.recovery import recover
        security = security_from(**state['tls']) if state['tls'] else None
        with connect(state['scheduler'], security) as client:
            if max_gpus_per_user is not None:
                set_user_limit(client, max_gpus_per_user)
                print(f'GPUs one user\'s jobs may hold at once: '
                      f'{max_gpus_per_user}')
            requeued, failed = recover(client, jobs_dir,
                                       anyone=bool(state.get('shared')))
            for job in requeued:
                print(f'requeued job {job.id} (its cluster had gone)')
            for job, why in failed:
                print(printable(f'job {job.id} not requeued: {why}'))

    @staticmethod
    def stop(cluster, args):
        """Stop the cluster; then record what became of its jobs."""
        from dasktrain.cluster import shared
        from dasktrain.jobs.scheduler.recovery import live_jobs, settle
        where = shared.layout(shared.shared_dir(args.shared_dir)) \
            if args.shared else None
        folder, jobs_dir = (where.private, where.jobs) if where else \
            (None, args.jobs_dir)
        recorded = cluster.read_state(folder)
        # no cluster recorded: stop_cluster says so; no job is touched
        jobs = [] if recorded is None else \
            live_jobs(jobs_dir, recorded['scheduler'], anyone=args.shared)
        ended = {}
        if args.wait is not None and jobs:
            print(f'waiting for {len(jobs)} job(s) to end')
            ended = settle(jobs, 'wait',
                           None if args.wait < 0 else args.wait)
        state = shared.stop_shared(args.shared_dir) if args.shared else \
            cluster.stop_cluster()
        state['record'] = cluster.state_path(folder)
        left = [j for j in jobs if j.id not in ended or ended[j.id] in
                ('queued', 'running')]
        policy = 'requeue' if args.requeue or args.wait is not None else \
            'cancel'
        ended.update(settle(left, policy))
        return dict(state, jobs=ended)
