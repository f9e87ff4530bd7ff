"""The package keeps the shape docs/design.md describes: imports run one
way down the layers, no module reaches for another's private names, no
import cycle, no module over ~400 lines, and each opens with a docstring
that says what it owns. Read from the source (``ast``), nothing imported."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / 'dasktrain'
# Lowest first; a module may import its own layer and those below it.
LAYERS = [
    {'errors', 'files', 'config', '_compat', '_lazy', 'cuda_extra', 'keeper',
     'spawn', 'userspec', 'notify'},
    {'data'},
    {'parallel'},
    {'training', 'chainermn'},
    {'cluster'},
    {'run'},
    {'jobs'},
    {'monitor', 'gpuuse', 'tuning'},
    {'report'},
    {'bench', 'nbrun', 'commands', 'cli'},
    {'entry'},
]
MAX_LINES = 420  # "about 400"


def modules():
    for path in sorted(PACKAGE.rglob('*.py')):
        parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
        name = '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)
        yield name, path


def layer(module):
    top = module.split('.')[1] if module.count('.') else ''
    for i, members in enumerate(LAYERS):
        if top in members:
            return i
    return None  # the package itself: dasktrain/__init__.py


def imports(path):
    """(module, names, line) of each dasktrain import in ``path``, at any
    depth (an import inside a function counts too)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.startswith('dasktrain') and node.level == 0:
            yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith('dasktrain'):
                    yield alias.name, [], node.lineno


ALL = list(modules())


@pytest.mark.parametrize('name, path', ALL, ids=[n for n, _ in ALL])
def test_imports_run_down_the_layers(name, path):
    mine = layer(name)
    if mine is None:
        return  # the package's lazy front door names everything
    for module, _, line in imports(path):
        theirs = layer(module)
        assert theirs is None or theirs <= mine, \
            f'{path.name}:{line} imports {module} from a layer above'


@pytest.mark.parametrize('name, path', ALL, ids=[n for n, _ in ALL])
def test_no_private_name_crosses_modules(name, path):
    for module, names, line in imports(path):
        private = [n for n in names
                   if n.startswith('_') and not n.endswith('__')]
        assert not private or module == name, \
            f'{path.name}:{line} imports {private} from {module}'


def test_no_import_cycle():
    graph = {name: {m for m, _, _ in imports(path)} for name, path in ALL}
    state = {}

    def visit(node, trail):
        if state.get(node) == 'done':
            return
        assert state.get(node) != 'open', \
            'import cycle: ' + ' -> '.join(trail + [node])
        state[node] = 'open'
        for other in graph.get(node, ()):
            if other in graph and other != node and \
                    not node.startswith(other + '.'):  # a package's init
                visit(other, trail + [node])
        state[node] = 'done'

    for node in graph:
        visit(node, [])


@pytest.mark.parametrize('name, path', ALL, ids=[n for n, _ in ALL])
def test_modules_are_short_and_say_what_they_own(name, path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_LINES, \
        f'{path.name} has {len(text.splitlines())} lines'
    doc = ast.get_docstring(ast.parse(text))
    assert doc and len(doc) > 40, f'{path.name} has no docstring to speak of'


def test_every_top_level_module_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if p.suffix == '.py' or (p.is_dir() and (p / '__init__.py')
                                     .exists())}
    assert tops - {'__init__'} <= set().union(*LAYERS)
