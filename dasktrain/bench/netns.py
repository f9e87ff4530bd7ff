"""Several "hosts" on one machine: Linux network namespaces joined by veth
pairs to one switch, for measuring what crosses a network without a
second machine.

:class:`Hosts` makes ``n`` namespaces ``h0 .. h{n-1}``, each with one
interface (a veth pair whose other end is a port of a bridge in a switch
namespace of its own) and one address, ``10.X.Y.(k+1)/24``; one more port
gives this (the root) namespace ``10.X.Y.254``, where a scheduler or a
driver can listen that every host reaches. Traffic between two hosts
crosses two veth pairs and the bridge, in the kernel, as on a real
switch; ``rate`` shapes every port in both directions with a token bucket
(``tc tbf``), so each host sends and receives at most ``rate`` at once
(full duplex, as a switched Ethernet port).

Made only by root on Linux with ``ip`` (iproute2) and, to shape, ``tc``;
:func:`unavailable` says why not. Everything it makes is named
``dtn{pid}...`` and deleted on exit (the hosts' namespaces take their
interfaces with them); leftovers of a process that is gone (a SIGKILL)
are deleted by the next :class:`Hosts`.

Examples
--------
>>> with Hosts(2, rate='10gbit') as hosts:  # doctest: +SKIP
...     subprocess.run(hosts.command(1, ['python', 'rank.py']))
"""
import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

PREFIX = 'dtn'
#: Rates :class:`Hosts` takes, as ``tc`` writes them.
RATE = re.compile(r'^\d+(\.\d+)?(k|m|g)?bit$')


class NetnsError(RuntimeError):
    """A namespace, interface or shaper could not be made."""


def unavailable():
    """Why namespaces cannot be made here (a line), or None where they
    can: root, Linux, ``ip`` on the PATH."""
    if not hasattr(os, 'geteuid') or not os.path.isdir('/proc/self/ns'):
        return 'not Linux: no network namespaces'
    if os.geteuid() != 0:
        return 'network namespaces need root'
    if shutil.which('ip') is None:
        return 'no `ip` command (apt-get install iproute2)'
    return None


def _ip(*args, netns=None, check=True):
    argv = ['ip'] + (['-n', netns] if netns else []) + list(args)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise NetnsError(f'{" ".join(argv)}: {done.stderr.strip()}')
    return done


def _tc(*args, netns=None):
    argv = (['ip', 'netns', 'exec', netns] if netns else []) + ['tc'] + \
        list(args)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise NetnsError(f'{" ".join(argv)}: {done.stderr.strip()}')


def ours():
    """Namespaces this module made, as ``{pid: [names]}``."""
    done = _ip('netns', 'list', check=False)
    found = {}
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ''
        match = re.match(rf'^{PREFIX}(\d+)[a-z]', name)
        if match:
            found.setdefault(int(match.group(1)), []).append(name)
    return found


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale():
    """Delete the namespaces of processes that are gone (a SIGKILL left
    them); the root namespace's port goes with its peer."""
    for pid, names in ours().items():
        if pid != os.getpid() and not _alive(pid):
            for name in names:
                _ip('netns', 'delete', name, check=False)


def subnet(pid, taken=()):
    """A /24 in 10.0.0.0/8 for the namespaces of process ``pid``, not one
    of ``taken`` (networks already routed here).

    Examples
    --------
    >>> str(subnet(1234))
    '10.204.210.0/24'
    """
    taken = [ipaddress.ip_network(t, strict=False) for t in taken]
    for attempt in range(256):
        key = (pid + attempt * 7919) % (56 * 256)
        net = ipaddress.ip_network(f'10.{200 + key // 256}.{key % 256}.0/24')
        if not any(net.overlaps(t) for t in taken):
            return net
    raise NetnsError('no free /24 left in 10.200.0.0/13')


def _routed():
    done = _ip('-4', '-o', 'addr', 'show', check=False)
    return re.findall(r'inet (\S+)', done.stdout)


class Hosts:
    """``n`` network namespaces on one switch: see the module.

    Parameters
    ----------
    n : int
        Hosts, 1 to 250.
    rate : str, optional
        Each port's rate in both directions, as ``tc`` writes it
        (``'10gbit'``, ``'1gbit'``); default: unshaped (the kernel's
        speed, as fast as the CPU copies).
    mtu : int, default 1500
        Every interface's MTU (Ethernet's; 9000 for jumbo frames).

    Attributes
    ----------
    names : list of str
        The hosts' namespaces.
    addresses : list of str
        The hosts' IPv4 addresses.
    root_address : str
        This namespace's address on the switch.
    """

    def __init__(self, n, rate=None, mtu=1500):
        if not isinstance(n, int) or not 1 <= n <= 250:
            raise ValueError(f'n must be an int from 1 to 250, got {n!r}')
        if rate is not None and not RATE.match(str(rate)):
            raise ValueError(f"rate must be like '10gbit' or '500mbit', "
                             f'got {rate!r}')
        self.n, self.rate, self.mtu = n, rate, int(mtu)
        self.names, self.addresses, self.root_address = [], [], None
        self._made = []
        self._root_port = None

    def __enter__(self):
        why = unavailable()
        if why:
            raise NetnsError(why)
        clean_stale()
        pid = os.getpid()
        net = subnet(pid, _routed())
        tag = f'{PREFIX}{pid}'
        hosts = list(net.hosts())
        switch = f'{tag}s'
        try:
            self._add_netns(switch)
            _ip('link', 'add', 'br0', 'type', 'bridge', netns=switch)
            _ip('link', 'set', 'br0', 'up', netns=switch)
            for k in range(self.n):
                name = f'{tag}h{k}'
                self._add_netns(name)
                self._port(switch, f'{tag}p{k}', name, 'eth0',
                           hosts[k])
                self.names.append(name)
                self.addresses.append(str(hosts[k]))
            self._root_port = f'{tag}r'
            self._port(switch, f'{tag}q', None, self._root_port, hosts[253])
            self.root_address = str(hosts[253])
        except BaseException:
            self.close()
            raise
        return self

    def _add_netns(self, name):
        _ip('netns', 'add', name)
        self._made.append(name)
        _ip('link', 'set', 'lo', 'up', netns=name)

    def _port(self, switch, outer, netns, inner, address):
        """A veth pair: ``outer`` a port of the switch's bridge, ``inner``
        with ``address`` in ``netns`` (None: this namespace)."""
        _ip('link', 'add', outer, 'mtu', str(self.mtu), 'type', 'veth',
            'peer', 'name', inner, 'mtu', str(self.mtu),
            *(['netns', netns] if netns else []))
        _ip('link', 'set', outer, 'netns', switch)
        _ip('link', 'set', outer, 'master', 'br0', netns=switch)
        _ip('link', 'set', outer, 'up', netns=switch)
        _ip('addr', 'add', f'{address}/24', 'dev', inner, netns=netns)
        _ip('link', 'set', inner, 'up', netns=netns)
        if self.rate and netns:  # a host's port: shaped both ways
            for where, dev in ((netns, inner), (switch, outer)):
                _tc('qdisc', 'add', 'dev', dev, 'root', 'tbf', 'rate',
                    self.rate, 'burst', '4mb', 'latency', '50ms',
                    netns=where)

    def command(self, k, argv):
        """``argv`` run inside host ``k``'s namespace."""
        return ['ip', 'netns', 'exec', self.names[k]] + list(argv)

    def close(self):
        """Delete every namespace made (their interfaces go with them)."""
        for name in reversed(self._made):
            _ip('netns', 'delete', name, check=False)
        self._made.clear()
        if self._root_port:  # gone with its peer; in case it was not
            _ip('link', 'delete', self._root_port, check=False)

    def __exit__(self, *exc):
        self.close()


class Loopback:
    """``n`` "hosts" as addresses of the loopback interface
    (``127.0.0.2`` up): ranks that listen on different ones take the
    routes between hosts (links), all inside this namespace. No root
    needed; nothing shaped (the tests' stand-in for :class:`Hosts`).
    """

    def __init__(self, n):
        if not isinstance(n, int) or not 1 <= n <= 250:
            raise ValueError(f'n must be an int from 1 to 250, got {n!r}')
        self.n = n
        self.addresses = [f'127.0.0.{k + 2}' for k in range(n)]
        self.root_address = '127.0.0.1'

    def command(self, k, argv):
        return list(argv)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def _python(module, *args):
    import sys
    return [sys.executable, '-m', module, *args]


@contextlib.contextmanager
def cluster(hosts, per_host=1, blas_threads=1, tls=True, env=None,
            timeout=120.0):
    """A Client to a Dask cluster across ``hosts`` (a :class:`Hosts` or
    :class:`Loopback`, entered): the scheduler in this namespace on
    ``hosts.root_address``, ``per_host`` single-threaded workers in each
    host's namespace listening on its address (so their ranks' links
    cross the switch), TLS with throwaway certificates unless ``tls`` is
    False. ``env`` adds to the workers' environment. Every process is
    stopped, and every file removed, on exit.

    Examples
    --------
    >>> with Hosts(2) as hosts, cluster(hosts) as client:  # doctest: +SKIP
    ...     client.submit(socket.gethostname).result()
    """
    from distributed import Client

    from dasktrain.cluster import malloc
    from dasktrain.cluster.local import security_from
    from dasktrain.cluster.tls import ensure_certificates
    folder = tempfile.mkdtemp(prefix='dasktrain-netns-')
    processes = []
    try:
        tls_args, security = [], None
        if tls:
            files = ensure_certificates(os.path.join(folder, 'tls'),
                                        hosts.root_address)
            security = security_from(**files)
            tls_args = ['--tls-ca-file', files['tls_ca_file'],
                        '--tls-cert', files['tls_cert'],
                        '--tls-key', files['tls_key']]
        environ = dict(os.environ, **(env or {}), **{
            k: str(blas_threads) for k in (
                'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS',
                'MKL_NUM_THREADS')})
        malloc.users_environ(environ)
        scheduler_file = os.path.join(folder, 'scheduler.json')
        processes.append(_start(_python(
            'distributed.cli.dask_scheduler', '--host', hosts.root_address,
            '--port', '0', '--no-dashboard', '--scheduler-file',
            scheduler_file, *(['--protocol', 'tls'] if tls else []),
            *tls_args), folder, 'scheduler', environ))
        address = _wait(lambda: json.load(open(scheduler_file))['address'],
                        timeout, processes, 'the scheduler', folder)
        for k in range(hosts.n):
            processes.append(_start(hosts.command(k, _python(
                'distributed.cli.dask_worker', address,
                '--host', hosts.addresses[k], '--nworkers', str(per_host),
                '--nthreads', '1', '--no-dashboard', '--name', f'h{k}',
                '--local-directory', os.path.join(folder, f'h{k}'),
                '--preload-nanny', 'dasktrain.cluster.malloc',
                *tls_args)), folder, f'h{k}', environ))
        client = Client(address, security=security, timeout=timeout,
                        set_as_default=False)
        try:
            _wait(lambda: len(client.scheduler_info(
                n_workers=-1)['workers']) >= hosts.n * per_host or None,
                timeout, processes, 'the workers', folder)
            yield client
        finally:
            client.close()
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def _start(argv, folder, name, env):
    log = open(os.path.join(folder, f'{name}.log'), 'ab')
    with log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env,
                                cwd=folder, start_new_session=True)


def _wait(probe, timeout, processes, what, folder):
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = probe()
        except (OSError, ValueError, KeyError):
            got = None
        if got:
            return got
        dead = [p for p in processes if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = 'exited' if dead else f'did not start within {timeout:g} s'
            logs = ''.join(open(os.path.join(folder, f)).read()[-2000:]
                           for f in sorted(os.listdir(folder))
                           if f.endswith('.log'))
            raise NetnsError(f'{what} {why}; the logs end:\n{logs}')
        time.sleep(0.1)


#: Open MPI's agent that starts its daemon "on" a host: in its namespace,
#: in a session of its own as each host's Dask worker is (on a kernel with
#: autogroup scheduling every session gets its own share of the CPUs: a
#: host, not a launcher, is the unit, as on separate machines).
AGENT = '''#!/bin/sh
host=$1; shift
case $host in
{cases}  *) echo "no namespace for host $host" >&2; exit 1 ;;
esac
exec setsid ip netns exec "$ns" /bin/sh -c "$*"
'''


@contextlib.contextmanager
def mpirun(hosts, per_host=1, btl='tcp,self'):
    """An ``mpirun`` command line (a list, to which the program is
    appended) that starts ``per_host`` ranks in each host's namespace,
    one Open MPI daemon per host as on real machines (its agent enters
    the namespace instead of ssh), its byte transfer layers ``btl``
    (``'tcp,self'``: TCP between ranks, as between machines; add
    ``vader`` for shared memory within a host) over the hosts' interfaces
    only. Yields None where ``mpirun`` is not Open MPI's.
    """
    exe = shutil.which('mpirun')
    version = subprocess.run([exe, '--version'], capture_output=True,
                             text=True).stdout if exe else ''
    if 'Open MPI' not in version and 'OpenRTE' not in version:
        yield None
        return
    folder = tempfile.mkdtemp(prefix='dasktrain-mpirun-')
    try:
        agent = os.path.join(folder, 'agent')
        cases = ''.join(f'  {a}) ns={n} ;;\n'
                        for a, n in zip(hosts.addresses, hosts.names))
        with open(agent, 'w') as f:
            f.write(AGENT.format(cases=cases))
        os.chmod(agent, 0o700)
        hostfile = os.path.join(folder, 'hosts')
        with open(hostfile, 'w') as f:
            f.writelines(f'{a} slots={per_host}\n' for a in hosts.addresses)
        yield [exe, '--allow-run-as-root', '--hostfile', hostfile,
               '-n', str(hosts.n * per_host), '--map-by', 'node' if
               per_host == 1 else 'slot', '--bind-to', 'none',
               '--mca', 'plm_rsh_agent', agent, '--mca', 'btl', btl,
               '--mca', 'btl_tcp_if_include', 'eth0',
               '--mca', 'oob_tcp_if_include', f'{hosts.root_address}/24',
               '-x', 'OMP_NUM_THREADS=1', '-x', 'OPENBLAS_NUM_THREADS=1',
               '-x', 'MKL_NUM_THREADS=1']
    finally:
        shutil.rmtree(folder, ignore_errors=True)
