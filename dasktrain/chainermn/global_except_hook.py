"""ChainerMN's ``global_except_hook``: an uncaught exception on one rank
ends that rank at once, so that the job ends instead of hanging.

Under MPI a rank that raises may leave the others waiting forever in
their next collective; ChainerMN's hook (``add_hook()``, or
``CHAINERMN_FORCE_ABORT_ON_EXCEPTION`` set) calls ``MPI_Abort``.
``dasktrain launch`` needs no hook for that: the first rank to exit
non-zero ends the job (it stops every other rank and says which failed),
and a rank whose peer is gone fails its next call within the timeout.
What remains is a rank that cannot exit after its exception because a
thread of its own (not a daemon) is still running; :func:`add_hook`
makes such a rank print its traceback and exit with status 1 at once,
which ends the job. As in ChainerMN it is on with
``CHAINERMN_FORCE_ABORT_ON_EXCEPTION`` set, or after :func:`add_hook`.
"""
import os
import sys
import warnings

from dasktrain.parallel.comm.rendezvous import RANK

_orig_except_hook = None


def _global_except_hook(exctype, value, traceback):
    """The traceback as usual, then this rank exits with status 1."""
    try:
        (_orig_except_hook or sys.__excepthook__)(exctype, value, traceback)
    finally:
        sys.stderr.write(f'\ndasktrain.chainermn: uncaught exception on rank '
                         f'{os.environ.get(RANK, "0")}: this rank exits, '
                         'and dasktrain launch stops the others\n')
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


def _add_hook_if_enabled():
    """At import, as ChainerMN: the hook where the variable is set; and
    never ChainerMN's own, which the installed ChainerMN's import set
    there (it calls MPI, which a launched rank does not run under)."""
    hook = sys.excepthook
    if getattr(hook, '__module__', None) == 'chainermn.global_except_hook':
        sys.excepthook = hook.__globals__.get('_orig_except_hook') or \
            sys.__excepthook__
    if os.environ.get('CHAINERMN_FORCE_ABORT_ON_EXCEPTION'):
        add_hook()


def add_hook():
    """Make an uncaught exception end this rank at once, after its
    traceback (see the module); a second call warns and does nothing."""
    global _orig_except_hook
    if _orig_except_hook is not None:
        warnings.warn('chainermn.global_except_hook.add_hook() '
                      'seems to be called multiple times. Ignoring.',
                      stacklevel=2)
        return
    _orig_except_hook = sys.excepthook
    sys.excepthook = _global_except_hook
