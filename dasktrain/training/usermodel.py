"""A lab's own model, named by a spec: ``package.module:NAME`` (importable)
or ``path/to/file.py:NAME`` (a file). ``NAME`` is a ``chainer.Chain``
subclass or a function returning a ``chainer.Link`` that maps a batch of
inputs to class scores; it is called with ``n_classes=K`` where it takes
that keyword, and with the run's model arguments (``--model-arg``).

Every way the spec can be wrong is one :class:`ModelSpecError` line that
names the spec and the cause; an exception raised by the user's own code
(importing their file, calling their factory) shows its traceback lines
from their files only, not dasktrain's or importlib's.

Owns finding and calling the factory; the built-in networks are
:mod:`~dasktrain.training.models`'.
"""
import inspect

from dasktrain.errors import argument
from dasktrain.userspec import (  # noqa: F401 (re-exported: the model's)
    SpecError,
    absolute_spec,
    is_spec,
    load_attribute,
    spec_file,
    split_spec,
    theirs,
)

ModelSpecError = SpecError  # what --model raises

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
    factory = load_attribute(spec, 'model')
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
                             f'failed:\n{theirs(e)}') from None
    except Exception as e:
        raise ModelSpecError(f'{argument("model")} {spec}: calling {name} '
                             f'failed:\n{theirs(e)}') from None
    if not isinstance(link, chainer.Link):
        raise ModelSpecError(f'{argument("model")} {spec}: {name} returned '
                             f'a {type(link).__name__}, not a chainer.Link')
    if not any(True for _ in link.params()):
        raise ModelSpecError(f'{argument("model")} {spec}: {name} returned '
                             'a link without parameters: nothing to train')
    return link if computes_loss(link) else chainer.links.Classifier(link)


def _kwargs(kwargs):
    return ', '.join(f'{k}={v!r}' for k, v in kwargs.items())
