"""The environment by which ``dasktrain launch`` tells each process it
starts who it is and where its peers are, and joining them from it.

``dasktrain launch -n N -- PROGRAM`` starts N copies of a program (see
:mod:`dasktrain.run.launch`), each with these variables set:

=========================  ==============================================
``DASKTRAIN_RANK``         this process's rank, 0 to N - 1
``DASKTRAIN_SIZE``         N
``DASKTRAIN_RENDEZVOUS``   the Dask scheduler the ranks meet through
``DASKTRAIN_JOB``          the name the ranks of this launch meet under
``DASKTRAIN_LISTEN``       where this rank listens for its peers
                           (``tls://HOST`` or ``tcp://HOST``)
``DASKTRAIN_TLS_CA``,      the TLS files of the cluster (CA, certificate,
``DASKTRAIN_TLS_CERT``,    key), private to the user; unset on a cluster
``DASKTRAIN_TLS_KEY``      without TLS
``DASKTRAIN_TIMEOUT``      seconds any collective waits for a peer
=========================  ==============================================

and, set by the user rather than ``launch``, ``DASKTRAIN_SHARED_MEMORY=0``:
ranks of one machine send arrays over links
(:mod:`~dasktrain.parallel.comm.links`) instead of shared memory (to
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
import shutil
import tempfile

from dasktrain.parallel.comm.base import CollectiveError, Solo
from dasktrain.parallel.comm.shm import ENV as SHARED_MEMORY_ENV

RANK = 'DASKTRAIN_RANK'
SIZE = 'DASKTRAIN_SIZE'
RENDEZVOUS = 'DASKTRAIN_RENDEZVOUS'
JOB = 'DASKTRAIN_JOB'
LISTEN = 'DASKTRAIN_LISTEN'
TLS_CA, TLS_CERT, TLS_KEY = ('DASKTRAIN_TLS_CA', 'DASKTRAIN_TLS_CERT',
                             'DASKTRAIN_TLS_KEY')
TIMEOUT = 'DASKTRAIN_TIMEOUT'
SHARED_MEMORY = SHARED_MEMORY_ENV
ALL = (RANK, SIZE, RENDEZVOUS, JOB, LISTEN, TLS_CA,
       TLS_CERT, TLS_KEY, TIMEOUT)


def rank_environment(rank, size, scheduler, job, listen, tls=None,
                     timeout=300.0):
    """The variables of rank ``rank`` (see the module), as a dict.

    ``tls``: ``(ca, cert, key)`` file paths, or None for a TCP cluster.

    Examples
    --------
    >>> env = rank_environment(1, 2, 'tcp://127.0.0.1:8786', 'j1',
    ...                        'tcp://127.0.0.1')
    >>> env['DASKTRAIN_RANK'], env['DASKTRAIN_SIZE']
    ('1', '2')
    """
    env = {RANK: str(rank), SIZE: str(size), RENDEZVOUS: scheduler, JOB: job,
           LISTEN: listen, TIMEOUT: f'{float(timeout):g}'}
    if tls is not None:
        env.update(zip((TLS_CA, TLS_CERT, TLS_KEY), map(str, tls)))
    return env


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


@contextlib.contextmanager
def chainermn_folder(where=None):
    """A private folder (0700, this user's) holding :data:`CHAINERMN_SHIM`
    as ``chainermn``, made in ``where`` (default the system's temporary
    folder, on the machine of the ranks that use it); removed on leaving.
    Never in a run's output folder: a folder first on a rank's
    ``PYTHONPATH`` is code the rank runs, and one another user could
    swap would run theirs (a ``sitecustomize.py``) as the rank's user.

    Examples
    --------
    >>> with chainermn_folder() as folder:  # doctest: +SKIP
    ...     env = chainermn_environment(folder, os.environ)
    """
    folder = tempfile.mkdtemp(prefix='dasktrain-chainermn-', dir=where)
    try:
        with open(os.path.join(folder, CHAINERMN_MARK), 'w'):
            pass
        os.mkdir(os.path.join(folder, 'chainermn'))
        with open(os.path.join(folder, 'chainermn', '__init__.py'),
                  'w') as f:
            f.write(CHAINERMN_SHIM)
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
    from distributed import Client
    from distributed.security import Security

    from dasktrain.parallel.comm.dask import DaskComm
    if env.get(TLS_CA):
        ca, cert, key = env[TLS_CA], env[TLS_CERT], env[TLS_KEY]
        # The same certificate dials the scheduler and listens for peers.
        security = Security(tls_ca_file=ca, tls_client_cert=cert,
                            tls_client_key=key, tls_worker_cert=cert,
                            tls_worker_key=key, require_encryption=True)
    else:
        security = Security()
    timeout = float(env.get(TIMEOUT) or 300.0)
    try:
        client = Client(env[RENDEZVOUS], security=security,
                        timeout=min(timeout, 60.0), set_as_default=False)
    except (OSError, TimeoutError) as e:
        raise CollectiveError(f'rank {rank} cannot reach the rendezvous at '
                              f'{env[RENDEZVOUS]}: {e}') from None
    try:
        return DaskComm.rendezvous(
            env[JOB], rank, size, timeout, client=client,
            listen_host=env[LISTEN], security=security,
            shared_memory=env.get(SHARED_MEMORY, '1') != '0')
    finally:
        client.close()
