"""Whether every user of the machine can run a Python and read a package:
what a shared install needs, where each job runs as its submitter.

``make install-shared`` runs this file (standard library only, before
dasktrain is installed) to pick the Python of the shared venv, the first
of its candidates that every user can execute, of Python >= 3.10:

    python -I dasktrain/shared_install.py python "$(PYTHON)" /usr/bin/python3

and, once installed, to check the venv (``PREFIX/bin/python -I -m
dasktrain.shared_install check``).
``dasktrain cluster start --shared`` asks :func:`install_problem` of its
own interpreter and package before it starts, and refuses in one line.

The other way round, root's processes of a shared cluster import this
interpreter's code: :func:`root_only_problem` names the first place
(the interpreter, its standard library, its prefix, every folder on its
``sys.path``, the folders above each) that a user other than root could
change (:func:`dasktrain.writers.opening`): a group-writable
``/usr/local`` would let its members replace a module every root
process of the queue imports. ``cluster start --shared`` refuses it in
one line, whatever else it allows.

The rule, :func:`blocked`, is a pure function of the permission bits: a
user who is neither the owner nor in the group needs ``x`` on every folder
above a path, and ``x`` (a program) or ``r`` (a file; ``r`` and ``x`` for
a folder) on the path itself.
"""
import os
import stat
import subprocess
import sys

NEED = {'x': stat.S_IXOTH, 'r': stat.S_IROTH,
        'rx': stat.S_IROTH | stat.S_IXOTH}
MIN_PYTHON = (3, 10)


def blocked(path, need, mode_of):
    """The first of ``path`` (absolute, symlinks resolved) and the folders
    above it that other users cannot use as needed, as ``(path, mode)``;
    None if they can. ``need``: 'x', 'r' or 'rx' for ``path`` itself;
    ``mode_of(p)``: ``p``'s ``st_mode``.

    Examples
    --------
    >>> modes = {'/': 0o40755, '/root': 0o40700, '/root/py': 0o100755,
    ...          '/usr': 0o40755, '/usr/bin': 0o40755,
    ...          '/usr/bin/python3': 0o100755}
    >>> blocked('/root/py', 'x', modes.get)
    ('/root', 16832)
    >>> blocked('/usr/bin/python3', 'x', modes.get) is None
    True
    """
    parts = path.strip('/').split('/')
    folders = ['/'] + ['/' + '/'.join(parts[:i]) for i in
                       range(1, len(parts))]
    for folder in folders:
        mode = mode_of(folder)
        if not mode & stat.S_IXOTH:
            return folder, mode
    mode = mode_of(path)
    if mode & NEED[need] != NEED[need]:
        return path, mode
    return None


def describe(found):
    """``'/root (drwx------)'`` for what :func:`blocked` returned."""
    path, mode = found
    return f'{path} ({stat.filemode(mode)})'


def _mode(path):
    return os.stat(path).st_mode


def install_problem(executable=None, package=None, mode_of=_mode,
                    real=os.path.realpath):
    """One line saying what other users cannot run or read of this
    install (``executable``, default ``sys.executable``; ``package``,
    the folder of the dasktrain package), or None where they can.

    Examples
    --------
    >>> modes = {'/': 0o40755, '/root': 0o40700, '/root/v/bin/python':
    ...          0o100755, '/opt': 0o40755, '/opt/d': 0o40755}
    >>> print(install_problem('/root/v/bin/python', '/opt/d', modes.get,
    ...                       real=lambda p: p))  # doctest: +ELLIPSIS
    other users cannot run /root/v/bin/python: /root (drwx------) ...
    """
    executable = executable or sys.executable
    if package is None:
        package = os.path.dirname(os.path.abspath(__file__))
    checks = [(os.path.abspath(executable), 'x', 'run'),
              (real(executable), 'x', 'run'),
              (real(package), 'rx', 'read')]
    for path, need, verb in checks:
        found = blocked(path, need, mode_of)
        if found is not None:
            what = executable if verb == 'run' else package
            return (f'other users cannot {verb} {what}: '
                    f'{describe(found)} is closed to them')
    return None


def loaded_from(executable=None):
    """Where this interpreter's code comes from: ``executable`` (default
    ``sys.executable``), its prefixes, its standard library and
    site-packages, every existing folder (or zip) on ``sys.path``; in
    that order, once each."""
    import sysconfig
    places = [executable or sys.executable, sys.prefix, sys.exec_prefix,
              sys.base_prefix, sys.base_exec_prefix,
              *sysconfig.get_paths().values(),
              os.path.dirname(os.path.abspath(__file__)), *sys.path]
    found = []
    for place in places:
        place = os.path.abspath(place) if place else None
        if place and place not in found and os.path.exists(place):
            found.append(place)
    return found


def root_only_problem(places=None, opening=None):
    """One line naming the first of ``places`` (default
    :func:`loaded_from`) that a user other than root can change, and how,
    or None where root alone can. ``opening``: the rule
    (:func:`dasktrain.writers.opening`, imported here: this file also
    runs alone, before dasktrain is installed)."""
    if opening is None:
        from dasktrain.writers import opening
    from dasktrain.writers import words
    for place in loaded_from() if places is None else places:
        found = opening(place, {0})
        if found is not None:
            return (f'{place} holds code that root runs, and users other '
                    f'than root can change it: {words(found)}')
    return None


def python_version(python):
    """``python``'s ``(major, minor)``, or None if it does not run."""
    try:
        done = subprocess.run(
            [python, '-I', '-c',
             'import sys, venv; print(*sys.version_info[:2])'],
            capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    if done.returncode:
        return None
    major, minor = done.stdout.split()
    return int(major), int(minor)


def choose_python(candidates, mode_of=_mode, version_of=python_version,
                  real=os.path.realpath, exists=os.path.exists):
    """``(python, None)``: the first of ``candidates`` that every user can
    execute and that is Python >= 3.10 with ``venv``; else ``(None,
    why)``, the reasons in one line.

    Examples
    --------
    >>> modes = {'/': 0o40755, '/root': 0o40700, '/root/py': 0o100755,
    ...          '/usr': 0o40755, '/usr/bin': 0o40755,
    ...          '/usr/bin/python3': 0o100755}
    >>> choose_python(['/root/py', '/usr/bin/python3'], modes.get,
    ...               lambda p: (3, 11), real=lambda p: p,
    ...               exists=modes.__contains__)
    ('/usr/bin/python3', None)
    >>> choose_python(['/root/py'], modes.get, lambda p: (3, 11),
    ...               real=lambda p: p, exists=modes.__contains__)[1]
    '/root/py: /root (drwx------) is closed to other users'
    """
    reasons = []
    for python in candidates:
        if not python:
            continue
        if not exists(python):
            reasons.append(f'{python}: not found')
            continue
        path = real(python)
        found = blocked(path, 'x', mode_of)
        if found is not None:
            reasons.append(f'{python}: {describe(found)} is closed to '
                           'other users')
            continue
        version = version_of(path)
        if version is None or version < MIN_PYTHON:
            reasons.append(f'{python}: not a Python >= 3.10 with venv')
            continue
        return path, None
    return None, '; '.join(reasons) or 'no Python named'


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ['python']:
        import shutil
        candidates = [shutil.which(c) or c for c in argv[1:]]
        python, why = choose_python(candidates)
        if python is None:
            print(f'error: no Python every user can run ({why}); name one '
                  'with SHARED_PYTHON=/path/to/python3', file=sys.stderr)
            return 1
        print(python)
        return 0
    if argv == ['check']:  # run by the installed venv's Python
        why = install_problem() or root_only_problem()
        if why:
            print(f'error: {why}', file=sys.stderr)
            return 1
        print(f'every user can run {sys.executable} and read '
              f'{os.path.dirname(os.path.abspath(__file__))}')
        return 0
    print('usage: shared_install.py python CANDIDATE... | check',
          file=sys.stderr)
    return 2


if __name__ == '__main__':
    sys.exit(main())
