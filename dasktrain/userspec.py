"""A user's own code named by a spec: ``package.module:NAME`` (importable)
or ``path/to/file.py:NAME`` (a file), as ``--model`` and ``--dataset``
take them.

Every way a spec can be wrong is one :class:`SpecError` line that names
the option, the spec and the cause; an exception raised by the user's own
code (importing their file) shows its traceback lines from their files
only, not dasktrain's or importlib's. A file is imported from its path
where that exists; elsewhere (a worker on another machine that received
the file with Dask's ``upload_file``) as the module of the file's name.

Owns finding and importing; what the named object must be is its user's
(:mod:`~dasktrain.training.usermodel`, :mod:`~dasktrain.data.datasets`).
"""
import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

from dasktrain.errors import UserError, argument

PACKAGE = Path(__file__).resolve().parent


class SpecError(UserError):
    """A spec (``--model``, ``--dataset``) names nothing usable."""


def is_spec(model):
    """Whether ``model`` names a user's model rather than a built-in one.

    >>> is_spec('resnet20'), is_spec('nets.py:MLP'), is_spec('lab.nets:CNN')
    (False, True, True)
    """
    return ':' in model


def split_spec(spec, option='model'):
    """``(module or file, NAME, is_file)``; SpecError (naming ``option``)
    if malformed.

    >>> split_spec('models/mlp.py:MLP')
    ('models/mlp.py', 'MLP', True)
    >>> split_spec('lab.nets:make_cnn')
    ('lab.nets', 'make_cnn', False)
    """
    where, _, name = spec.rpartition(':')
    if not where or not name.isidentifier():
        raise SpecError(f'{argument(option)} {spec}: expected '
                             'package.module:NAME or path/to/file.py:NAME')
    return where, name, where.endswith('.py')


def absolute_spec(spec, cwd=None):
    """``spec`` with a relative file made absolute (from ``cwd``, default
    the working directory): processes elsewhere find the same file.

    >>> absolute_spec('nets.py:MLP', cwd='/home/ana/lab')
    '/home/ana/lab/nets.py:MLP'
    >>> absolute_spec('lab.nets:CNN')
    'lab.nets:CNN'
    """
    where, name, is_file = split_spec(spec)
    if not is_file or os.path.isabs(where):
        return spec
    return f'{os.path.join(cwd or os.getcwd(), where)}:{name}'


def spec_file(spec):
    """The file a file spec names, else None."""
    where, _, is_file = split_spec(spec)
    return Path(where) if is_file else None


def theirs(e):
    """The user's traceback lines of ``e``: frames outside dasktrain and
    importlib."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(str(PACKAGE)) and
              'importlib' not in f.filename and
              not f.filename.startswith('<frozen')]
    lines = traceback.format_list(frames)
    lines += traceback.format_exception_only(type(e), e)
    return ''.join(lines).rstrip()


def _import(spec, where, is_file, option):
    if not is_file:
        try:
            return importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name and where.startswith(e.name):
                raise SpecError(f'{argument(option)} {spec}: no module '
                                     f'{e.name!r} (is it installed, or on '
                                     'PYTHONPATH?)') from None
            raise SpecError(f'{argument(option)} {spec}: importing '
                                 f'{where} failed:\n{theirs(e)}') from None
        except Exception as e:
            raise SpecError(f'{argument(option)} {spec}: importing '
                                 f'{where} failed:\n{theirs(e)}') from None
    path = Path(where)
    module_name = path.stem
    if not path.is_file():
        if module_name in sys.modules or importlib.util.find_spec(
                module_name) is not None:  # sent to this worker by Dask
            return importlib.import_module(module_name)
        raise SpecError(f'{argument(option)} {spec}: no file {where}')
    # Executed afresh each time: a file edited in a notebook's session
    # counts (a submitted job keeps its own copy).
    unique = f'dasktrain_user_{option}_{abs(hash(str(path.resolve())))}'
    loader_spec = importlib.util.spec_from_file_location(unique, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[unique] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(unique, None)
        raise SpecError(f'{argument(option)} {spec}: importing '
                             f'{where} failed:\n{theirs(e)}') from None
    return module


def load_attribute(spec, option='model'):
    """The object ``spec`` names (``file.py:NAME`` or
    ``package.module:NAME``), importing its module; every failure one
    :class:`SpecError` line naming ``option`` and the spec."""
    where, name, is_file = split_spec(spec, option)
    module = _import(spec, where, is_file, option)
    found = getattr(module, name, None)
    if found is None:
        raise SpecError(f'{argument(option)} {spec}: {where} has no '
                        f'attribute {name!r}')
    return found
