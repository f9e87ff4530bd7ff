"""``dasktrain gpus``: every GPU of every worker, the queue's job and
user holding it, and the processes outside the queue NVML sees on it
(pid, user, memory; a GPU they hold more than ``--busy-mib`` of is
busy); on workers without GPUs, their CPU slots and the jobs holding
them. The readings are :mod:`dasktrain.jobs.worker.gpu_use`'s (workers'
heartbeats),
the jobs those the scheduler's monitor and the jobs dir know."""
from dasktrain.commands import (
    Command,
    add_jobs_dir,
    add_scheduler,
    printable,
)


class Gpus(Command):
    name = 'gpus'
    help = ('who is using the machine: every GPU of every worker with the '
            'job and user holding it, and processes outside the queue')

    def add_arguments(self, parser):
        add_scheduler(parser)
        add_jobs_dir(parser)

    def run(self, args):
        from dasktrain.jobs.client.route import shared_queue
        door = shared_queue(args.scheduler, args.jobs_dir)
        if door is not None:  # a shared cluster: its front door reads them
            answer = door.gpus()
            print(self.table(answer['seen'], answer['running']))
            return 0
        from dasktrain.cluster.local import connect
        from dasktrain.jobs.scheduler.outside_use import cluster_use
        from dasktrain.jobs.status import running_jobs
        with connect(args.scheduler) as client:
            seen = client.run_on_scheduler(cluster_use)
            address = client.scheduler.address
        print(self.table(seen, running_jobs(args.jobs_dir, address,
                                            seen['jobs'])))
        return 0

    @staticmethod
    def table(seen, jobs):
        """The lines for the scheduler's answer ``seen`` (see
        :func:`~dasktrain.jobs.scheduler.outside_use.cluster_use`) and
        ``jobs``: the running
        jobs' summaries."""
        from dasktrain.parallel.outside import describe, worker_ids
        rows = [('WORKER', 'GPU', 'JOB', 'USER', 'OUTSIDE THE QUEUE')]
        notes = []
        for address, worker in sorted(seen['workers'].items()):
            use = worker['use'] or {}
            mine = [j for j in jobs if j.get('worker') == address]
            count = int(worker['resources'].get('GPU', 0))
            processes = [p for p in use.get('processes') or ()
                         if p.get('job') is None]
            busy = seen['busy'].get(address) or {}  # the queue's own view
            for gpu in worker_ids(use, count):
                holder = [j for j in mine if gpu in (j.get('held') or ())]
                job = holder[0] if holder else None
                outside = [describe(p) for p in processes
                           if p['gpu'] == gpu]
                if gpu in busy:
                    outside.append('busy: no job gets it')
                elif not use.get('nvml'):
                    outside = ['-']
                rows.append((address, gpu, _job(job),
                             job['user'] if job else '-',
                             ', '.join(outside) or 'none'))
            slots = int(worker['resources'].get('CPU', 0))
            cpu_jobs = [j for j in mine if not j.get('held') and
                        not j.get('gpus')]
            for i in range(slots):
                job = cpu_jobs[i] if i < len(cpu_jobs) else None
                rows.append((address, f'CPU slot {i + 1}', _job(job),
                             job['user'] if job else '-', '-'))
            if count and not use.get('nvml'):
                notes.append(f'{address}: no NVML process list (no NVIDIA '
                             'driver, no permission, or no '
                             'dasktrain.jobs.worker.preload): processes '
                             'outside the queue unknown')
        if len(rows) == 1:
            return 'no workers'
        rows = [tuple(printable(c) for c in r) for r in rows]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                 for r in rows]
        return '\n'.join(lines + notes)


def _job(job):
    return f"{job['id']} ({job['name']})" if job else 'free'
