"""A lab's own model, named by a spec: ``package.module:NAME`` (importable)
or ``path/to/file.py:NAME`` (a file). ``NAME`` is a ``chainer.Chain``
subclass or a function returning a ``chainer.Link`` that maps a batch of
inputs to class scores; it is called with ``n_classes=K`` where it takes
that keyword, and with the run's model arguments (``--model-arg``).

Every way the spec can be wrong is one :class:`ModelSpecError` line that
names the spec and the cause; an exception raised by the user's own code
(importing their file, calling their factory) shows its traceback lines
from their files only, not dasktrain's or importlib's.

A file is imported from its path where that exists; elsewhere (a worker on
another machine that received the file with Dask's ``upload_file``) as the
module of the file's name.

Owns finding and calling the factory; the built-in networks are
:mod:`~dasktrain.training.models`'.
"""
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from pathlib import Path

from dasktrain.errors import UserError, argument

PACKAGE = Path(__file__).resolve().parents[1]


class ModelSpecError(UserError):
    """The model spec cannot give a model."""


def is_spec(model):
    """Whether ``model`` names a user's model rather than a built-in one.

    >>> is_spec('resnet20'), is_spec('nets.py:MLP'), is_spec('lab.nets:CNN')
    (False, True, True)
    """
    return ':' in model


def split_spec(spec):
    """``(module or file, NAME, is_file)``; ModelSpecError if malformed.

    >>> split_spec('models/mlp.py:MLP')
    ('models/mlp.py', 'MLP', True)
    >>> split_spec('lab.nets:make_cnn')
    ('lab.nets', 'make_cnn', False)
    """
    where, _, name = spec.rpartition(':')
    if not where or not name.isidentifier():
        raise ModelSpecError(f'{argument("model")} {spec}: expected '
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


def _theirs(e):
    """The user's traceback lines of ``e``: frames outside dasktrain and
    importlib."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(str(PACKAGE)) and
              'importlib' not in f.filename and
              not f.filename.startswith('<frozen')]
    lines = traceback.format_list(frames)
    lines += traceback.format_exception_only(type(e), e)
    return ''.join(lines).rstrip()


def _import(spec, where, is_file):
    if not is_file:
        try:
            return importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name and where.startswith(e.name):
                raise ModelSpecError(f'{argument("model")} {spec}: no module '
                                     f'{e.name!r} (is it installed, or on '
                                     'PYTHONPATH?)') from None
            raise ModelSpecError(f'{argument("model")} {spec}: importing '
                                 f'{where} failed:\n{_theirs(e)}') from None
        except Exception as e:
            raise ModelSpecError(f'{argument("model")} {spec}: importing '
                                 f'{where} failed:\n{_theirs(e)}') from None
    path = Path(where)
    module_name = path.stem
    if not path.is_file():
        if module_name in sys.modules or importlib.util.find_spec(
                module_name) is not None:  # sent to this worker by Dask
            return importlib.import_module(module_name)
        raise ModelSpecError(f'{argument("model")} {spec}: no file {where}')
    # Executed afresh each time: a file edited in a notebook's session
    # counts (a submitted job keeps its own copy).
    unique = f'dasktrain_user_model_{abs(hash(str(path.resolve())))}'
    loader_spec = importlib.util.spec_from_file_location(unique, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[unique] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(unique, None)
        raise ModelSpecError(f'{argument("model")} {spec}: importing '
                             f'{where} failed:\n{_theirs(e)}') from None
    return module


def computes_loss(link):
    """Whether ``link`` computes its own loss, as many Chainer examples'
    models do: an ``L.Classifier`` already, or a ``forward`` (or a
    ``__call__`` of its own) that takes ``(x, t)``, two arguments without
    defaults. Such a link is trained as it is, not wrapped."""
    import chainer
    if isinstance(link, chainer.links.Classifier):
        return True
    call = link.__call__ if type(link).__call__ is not chainer.Link.__call__ \
        else getattr(link, 'forward', None)
    try:
        params = inspect.signature(call).parameters.values()
    except (TypeError, ValueError):
        return False
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and
               p.default is p.empty for p in params) >= 2


def build(spec, n_classes=10, model_args=None):
    """The model ``spec`` names, wrapped in ``L.Classifier`` unless it
    :func:`computes_loss` itself.

    Examples
    --------
    >>> build('nets.py:MLP', 10, {'n_units': 256})  # doctest: +SKIP
    Classifier(...)
    """
    import chainer  # here: naming a spec costs no Chainer import
    where, name, is_file = split_spec(spec)
    module = _import(spec, where, is_file)
    factory = getattr(module, name, None)
    if factory is None:
        raise ModelSpecError(f'{argument("model")} {spec}: {where} has no '
                             f'attribute {name!r}')
    if not callable(factory):
        raise ModelSpecError(f'{argument("model")} {spec}: {name} is not '
                             'a class or function (it is '
                             f'{type(factory).__name__})')
    kwargs = dict(model_args or {})
    try:
        accepts = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        accepts = {}
    if 'n_classes' in accepts or any(
            p.kind is p.VAR_KEYWORD for p in accepts.values()):
        kwargs.setdefault('n_classes', n_classes)
    try:
        link = factory(**kwargs)
    except TypeError as e:
        if e.__traceback__.tb_next is None:  # the call itself: arguments
            raise ModelSpecError(f'{argument("model")} {spec}: calling '
                                 f'{name}({_kwargs(kwargs)}) failed: {e}; '
                                 f'pass its arguments with '
                                 f'{argument("model_args")}') from None
        raise ModelSpecError(f'{argument("model")} {spec}: calling {name} '
                             f'failed:\n{_theirs(e)}') from None
    except Exception as e:
        raise ModelSpecError(f'{argument("model")} {spec}: calling {name} '
                             f'failed:\n{_theirs(e)}') from None
    if not isinstance(link, chainer.Link):
        raise ModelSpecError(f'{argument("model")} {spec}: {name} returned '
                             f'a {type(link).__name__}, not a chainer.Link')
    if not any(True for _ in link.params()):
        raise ModelSpecError(f'{argument("model")} {spec}: {name} returned '
                             'a link without parameters: nothing to train')
    return link if computes_loss(link) else chainer.links.Classifier(link)


def _kwargs(kwargs):
    return ', '.join(f'{k}={v!r}' for k, v in kwargs.items())
