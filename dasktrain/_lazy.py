"""Packages whose public names import their module on first use (PEP 562).

``import dasktrain`` and ``dasktrain --help`` must not pay for Chainer or
dask.distributed (seconds each), yet ``dasktrain.train`` and ``from
dasktrain.cluster import connect`` should simply work. So a package lists
each public name with the module that defines it, and :func:`exports` gives
it a module ``__getattr__`` that imports that module when the name is first
asked for. A submodule's name is never listed: ``from dasktrain.training
import report`` then falls through to the submodule.
"""
import importlib
import sys


def exports(package, names):
    """The lazy ``__getattr__``, ``__dir__`` and ``__all__`` of a package.

    Parameters
    ----------
    package : str
        The package's ``__name__`` (its module must be importing already).
    names : dict
        Public name -> the dotted path of the module that defines it.

    Returns
    -------
    tuple
        ``(__getattr__, __dir__, __all__)``, to assign in the package.
    """
    namespace = vars(sys.modules[package])

    def __getattr__(name):
        module = names.get(name)
        if module is None:
            raise AttributeError(
                f'module {package!r} has no attribute {name!r}')
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__():
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__, sorted(names)
