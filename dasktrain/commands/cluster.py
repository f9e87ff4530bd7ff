"""``dasktrain cluster start|status|stop``: a Dask cluster on this machine,
with the links to its dashboard, jobs page and metrics."""
from dasktrain.commands import Command, Parser


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
            from dasktrain.monitor import links
            tls = ', '.join(state['tls'].values()) if state['tls'] else \
                'none (--insecure)'
            print(f"scheduler: {state['scheduler']}\n"
                  f"dashboard: {state['dashboard']}")
            for what, link in links(state['dashboard']).items():
                print(f'{what}: {link}')
            print(f"worker resources: {state['resources']}\n"
                  f'TLS: {tls}\nrecorded in {cluster.state_path()}')
        elif args.action == 'status':
            from dasktrain.monitor import links
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
