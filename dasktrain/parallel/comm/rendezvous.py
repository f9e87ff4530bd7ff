"""The environment by which ``dasktrain launch`` tells each process it
starts who it is and where its peers are, and joining them from it.

``dasktrain launch -n N -- PROGRAM`` starts N copies of a program (see
:mod:`dasktrain.run.launch`), each with these variables set:

=========================  ==============================================
``DASKTRAIN_RANK``         this process's rank, 0 to N - 1
``DASKTRAIN_SIZE``         N
``DASKTRAIN_RENDEZVOUS``   the Dask scheduler the ranks meet through
``DASKTRAIN_RANK0``        or, without one, the file where rank 0
                           writes where it listens, once it does (in
                           a folder only the user may change): the
                           others' first connection, a launch on one
                           machine
``DASKTRAIN_JOB``          the name the ranks of this launch meet under
``DASKTRAIN_LISTEN``       where this rank listens for its peers
                           (``tls://HOST`` or ``tcp://HOST``; or
                           ``unix://FOLDER``, a launch on one machine:
                           sockets in the launch's private folder)
``DASKTRAIN_TLS_CA``,      the TLS files of the cluster (CA, certificate,
``DASKTRAIN_TLS_CERT``,    key), private to the user; unset on a cluster
``DASKTRAIN_TLS_KEY``      without TLS
``DASKTRAIN_TIMEOUT``      seconds any collective waits for a peer
=========================  ==============================================

and, set by the user rather than ``launch``, ``DASKTRAIN_SHARED_MEMORY=0``:
ranks of one machine sum arrays over links
(:mod:`~dasktrain.parallel.comm.links`) instead of shared memory, and
send point-to-point messages over the communicator's connections
instead of :mod:`~dasktrain.parallel.comm.nearby`'s sockets (to
compare, or where ``/dev/shm`` is too small); ``DASKTRAIN_LINKS=tcp`` on
every rank: links between machines unencrypted, for a trusted network.

:func:`join` reads them and returns the rank's
:class:`~dasktrain.parallel.comm.dask.DaskComm`: each rank publishes its
address on the scheduler and then talks to the others directly, over
shared memory where they share a machine, links otherwise. Without
``DASKTRAIN_SIZE`` (a script run by itself) it returns a
:class:`~dasktrain.parallel.comm.base.Solo`.

Owns the variables' names and meaning; starting processes is the
launcher's.
"""
import contextlib
import os
import re
import shutil
import tempfile
import time

from dasktrain.files import atomic_write, read_regular
from dasktrain.parallel.comm.base import (
    SHARED_MEMORY_ENV,
    CollectiveError,
    Solo,
)

RANK = 'DASKTRAIN_RANK'
SIZE = 'DASKTRAIN_SIZE'
RENDEZVOUS = 'DASKTRAIN_RENDEZVOUS'
RANK0 = 'DASKTRAIN_RANK0'
JOB = 'DASKTRAIN_JOB'
LISTEN = 'DASKTRAIN_LISTEN'
TLS_CA, TLS_CERT, TLS_KEY = ('DASKTRAIN_TLS_CA', 'DASKTRAIN_TLS_CERT',
                             'DASKTRAIN_TLS_KEY')
TIMEOUT = 'DASKTRAIN_TIMEOUT'
SHARED_MEMORY = SHARED_MEMORY_ENV
ALL = (RANK, SIZE, RENDEZVOUS, RANK0, JOB, LISTEN, TLS_CA,
       TLS_CERT, TLS_KEY, TIMEOUT)


def rank_environment(rank, size, scheduler, job, listen, tls=None,
                     timeout=300.0, rank0=None):
    """The variables of rank ``rank`` (see the module), as a dict.

    ``tls``: ``(ca, cert, key)`` file paths, or None for a TCP cluster.
    ``rank0``: the file where rank 0 writes where it listens
    (:func:`write_rank0_address`) where the ranks meet without a
    scheduler (``scheduler`` None).

    Examples
    --------
    >>> env = rank_environment(1, 2, 'tcp://127.0.0.1:8786', 'j1',
    ...                        'tcp://127.0.0.1')
    >>> env['DASKTRAIN_RANK'], env['DASKTRAIN_SIZE']
    ('1', '2')
    """
    env = {RANK: str(rank), SIZE: str(size), JOB: job, LISTEN: listen,
           TIMEOUT: f'{float(timeout):g}'}
    env.update({RENDEZVOUS: scheduler} if rank0 is None else {RANK0: rank0})
    if tls is not None:
        env.update(zip((TLS_CA, TLS_CERT, TLS_KEY), map(str, tls)))
    return env


# Rank 0's address, where the ranks meet without a scheduler: written by
# rank 0 once it listens, read by the others. A port chosen before it is
# bound (and told to the ranks on their command lines or environment)
# is one another user of the machine could bind first; this one is the
# kernel's choice, told through a file in the launch's private folder.
_ADDRESS = re.compile(r'(tls|tcp)://[0-9A-Za-z.:\[\]-]{1,253}:[0-9]{1,5}'
                      r'|unix://(/[0-9A-Za-z._+-]{1,255}){1,64}')


def write_rank0_address(path, address):
    """Write ``address`` (``tls://HOST:PORT``, ``unix://PATH``) to the
    file ``path``,
    whole or not at all (a rename), 0600."""
    atomic_write(path, lambda f: f.write(address.encode()), mode=0o600)


def read_rank0_address(path, timeout, size=None):
    """The address rank 0 wrote to ``path`` (see
    :func:`write_rank0_address`), waited for up to ``timeout`` seconds
    (:class:`CollectiveError` after). Read only from a regular file of
    this user's, never through a symlink (:func:`~dasktrain.files.
    read_regular`), at most 300 bytes, and only an address
    (``tls://HOST:PORT``, ``tcp://...`` or ``unix://PATH``): a file put
    there by someone else is refused, not dialled.

    Examples
    --------
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), 'rank0')
    >>> write_rank0_address(path, 'tls://127.0.0.1:40123')
    >>> read_rank0_address(path, 1)
    'tls://127.0.0.1:40123'
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            data = read_regular(path, owner=os.geteuid(), limit=300)
            break
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise CollectiveError(
                    f'rank 0{"" if size is None else f" of {size}"} did '
                    f'not start within {timeout:g} s '
                    '(collective_timeout)') from None
            time.sleep(0.02)
        except OSError as e:
            raise _refused(path, e.strerror) from None
    text = data.decode('ascii', 'replace')
    if not _ADDRESS.fullmatch(text):
        raise _refused(path, f'it holds {text[:60]!r}, not an address')
    return text


def _refused(path, why):
    return CollectiveError(f"rank 0's address file {path} is refused "
                           f'({why}): launch again')


# ``import chainermn`` on a launched rank: dasktrain.chainermn (see
# :mod:`dasktrain.chainermn.substitution`): a folder first on its path.

#: A file that marks the folder as dasktrain's: the ``sys.path`` entry
#: whose ``chainermn`` is not ChainerMN's.
CHAINERMN_MARK = '.dasktrain-chainermn'

#: The folder's ``chainermn/__init__.py``. It imports nothing of
#: dasktrain's before the installed ChainerMN is loaded: dasktrain's
#: modules import ChainerMN's, which must not find this package again.
CHAINERMN_SHIM = '''"""`import chainermn` on a rank of `dasktrain launch`:
dasktrain.chainermn, ChainerMN's API on Dask (`dasktrain launch
--no-chainermn` leaves the installed ChainerMN). Written by
dasktrain.parallel.comm.rendezvous for one launch, removed when it ends."""
import importlib.machinery
import importlib.util
import os
import sys


def _load_installed():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec('chainermn', path)
    if spec is None:
        raise ImportError('ChainerMN is not installed (chainer 7.8.1 brings '
                          'it), which dasktrain.chainermn needs',
                          name='chainermn')
    module = importlib.util.module_from_spec(spec)
    hook = sys.excepthook
    sys.modules['chainermn'] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules['chainermn']
        raise
    finally:
        sys.excepthook = hook  # not ChainerMN's MPI_Abort hook
    return module


_load_installed()
import dasktrain.chainermn  # noqa: E402,F401  (then takes the name)
'''

#: The folder's ``mpi4py/__init__.py``: ``from mpi4py import MPI`` on a
#: launched rank gets dasktrain.chainermn.mpi, mpi4py's calls on the
#: ranks' own connections (its ``COMM_WORLD``: every rank of the launch).
MPI4PY_SHIM = '''"""`import mpi4py` on a rank of `dasktrain launch`: its
`MPI` is dasktrain.chainermn.mpi, mpi4py's calls on the ranks' own
connections, without MPI (`dasktrain launch --no-chainermn` leaves the
installed mpi4py). Written by dasktrain.parallel.comm.rendezvous for one
launch, removed when it ends."""
import sys

from dasktrain.chainermn import mpi as MPI

sys.modules[__name__ + '.MPI'] = MPI
__version__ = '3.1.0'


def get_include():
    raise ImportError('mpi4py on a rank of dasktrain launch is '
                      'dasktrain.chainermn.mpi: it has no C headers')


class _Config:
    initialize = threads = True
    finalize = None
    thread_level = 'multiple'


rc = _Config()
'''


@contextlib.contextmanager
def chainermn_folder(where=None):
    """A private folder (0700, this user's) holding :data:`CHAINERMN_SHIM`
    as ``chainermn`` and :data:`MPI4PY_SHIM` as ``mpi4py``, made in
    ``where`` (default the system's temporary folder, on the machine of
    the ranks that use it); removed on leaving. Never in a run's output
    folder: a folder first on a rank's ``PYTHONPATH`` is code the rank
    runs, and one another user could swap would run theirs (a
    ``sitecustomize.py``) as the rank's user.

    Examples
    --------
    >>> with chainermn_folder() as folder:  # doctest: +SKIP
    ...     env = chainermn_environment(folder, os.environ)
    """
    folder = tempfile.mkdtemp(prefix='dasktrain-chainermn-', dir=where)
    try:
        with open(os.path.join(folder, CHAINERMN_MARK), 'w'):
            pass
        for package, text in (('chainermn', CHAINERMN_SHIM),
                              ('mpi4py', MPI4PY_SHIM)):
            os.mkdir(os.path.join(folder, package))
            with open(os.path.join(folder, package, '__init__.py'),
                      'w') as f:
                f.write(text)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def chainermn_environment(folder, environ):
    """The variables that put ``folder`` (from :func:`chainermn_folder`)
    first on a rank's ``PYTHONPATH``, given the environment ``environ``.

    Examples
    --------
    >>> chainermn_environment('/x', {'PYTHONPATH': '/y'})
    {'PYTHONPATH': '/x:/y'}
    """
    before = environ.get('PYTHONPATH')
    return {'PYTHONPATH': os.pathsep.join([str(folder)] + (
        [before] if before else []))}


def launched(environ=None):
    """Whether this process is a rank that ``dasktrain launch`` started."""
    return SIZE in (os.environ if environ is None else environ)


def position(environ=None):
    """``(rank, size)`` from the environment; ``(0, 1)`` for a process
    not launched as a rank."""
    env = os.environ if environ is None else environ
    if not launched(env):
        return 0, 1
    try:
        return int(env[RANK]), int(env[SIZE])
    except (KeyError, ValueError) as e:
        raise CollectiveError(f'the rank environment is incomplete or '
                              f'wrong ({e}); start the program with '
                              '`dasktrain launch`') from None


def join(environ=None):
    """This rank's communicator: a ``DaskComm`` joined to its peers as the
    environment says, or a ``Solo`` for a process not launched as a rank.
    Raises :class:`CollectiveError` when a peer does not come within the
    timeout."""
    env = os.environ if environ is None else environ
    rank, size = position(env)
    if size == 1:
        return Solo()
    from dasktrain.parallel.comm.dask import DaskComm
    from dasktrain.parallel.comm.transports import transport_for
    transport = transport_for(env[LISTEN], (
        env[TLS_CA], env[TLS_CERT], env[TLS_KEY]) if env.get(TLS_CA)
        else None)
    timeout = float(env.get(TIMEOUT) or 300.0)
    shared_memory = env.get(SHARED_MEMORY, '1') != '0'
    if env.get(RANK0):  # no scheduler: rank 0 tells the others
        rank0 = env[RANK0]

        def tell(address):
            write_rank0_address(rank0, address)

        def find(limit):
            return read_rank0_address(rank0, limit, size)
        return DaskComm.meet(rank, size, tell, find, transport, timeout,
                             shared_memory=shared_memory)
    from distributed import Client
    try:
        client = Client(env[RENDEZVOUS], security=transport.security,
                        timeout=min(timeout, 60.0), set_as_default=False)
    except (OSError, TimeoutError) as e:
        raise CollectiveError(f'rank {rank} cannot reach the rendezvous at '
                              f'{env[RENDEZVOUS]}: {e}') from None
    try:
        return DaskComm.rendezvous(
            env[JOB], rank, size, timeout, client=client,
            listen_host=env[LISTEN], security=transport.security,
            shared_memory=shared_memory)
    finally:
        client.close()
