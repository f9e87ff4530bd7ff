"""The package keeps the shape docs/design.md describes: imports run one
way down the layers (inside ``jobs/`` too: client, scheduler, worker, then
the modules every side reads), no module reaches for another's private
names, no import cycle, each opens with a docstring that says what it
owns, and design.md's module map names every module there is and no
other. Read from the source (``ast``), nothing imported."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / 'dasktrain'
# Lowest first; a module may import its own layer and those below it.
LAYERS = [
    {'errors', 'files', 'config', '_compat', '_lazy', 'keeper', 'as_user',
     'shared_install', 'spawn', 'userspec', 'notify', 'containment',
     'numerics', 'writers', 'sweep'},
    {'data'},
    {'kernels'},
    {'parallel'},
    {'training', 'chainermn'},
    {'cluster'},
    {'run'},
    {'jobs'},
    {'tuning'},
    {'results'},
    {'bench', 'commands', 'cli'},
    {'entry'},
]
# Inside jobs/, by where the code runs; lowest first, as above.
JOBS = ['', 'worker', 'scheduler', 'client']
# A smell alarm, not a rule that splits files: cut by concept.
MAX_LINES = 600


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


def jobs_side(module):
    """Where in jobs/ ``module`` runs (an index of :data:`JOBS`), or None
    outside jobs/."""
    parts = module.split('.')
    if parts[1:2] != ['jobs']:
        return None
    return JOBS.index(parts[2]) if len(parts) > 2 and parts[2] in JOBS \
        else 0


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
    for module, names, line in imports(path):
        if module == 'dasktrain':  # `from dasktrain import keeper`
            module = f'dasktrain.{names[0]}'
        theirs = layer(module)
        assert theirs is None or theirs <= mine, \
            f'{path.name}:{line} imports {module} from a layer above'


@pytest.mark.parametrize('name, path', [(n, p) for n, p in ALL
                                        if jobs_side(n) is not None],
                         ids=[n for n, _ in ALL if jobs_side(n) is not None])
def test_inside_jobs_no_arrow_runs_back_up(name, path):
    # A worker's code never imports the scheduler's, the scheduler's
    # never the client's, and the modules every side reads none of them.
    for module, _, line in imports(path):
        theirs = jobs_side(module)
        if module == 'dasktrain.jobs' or theirs is None:
            continue
        assert theirs <= jobs_side(name), \
            f'{path.relative_to(PACKAGE)}:{line} imports {module}, which ' \
            f'runs in the {JOBS[theirs]}'


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
def test_modules_say_what_they_own_and_stay_readable(name, path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_LINES, \
        f'{path.name} has {len(text.splitlines())} lines: more than one ' \
        'concept?'
    doc = ast.get_docstring(ast.parse(text))
    assert doc and len(doc) > 40, f'{path.name} has no docstring to speak of'


def test_every_top_level_module_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if p.suffix == '.py' or (p.is_dir() and (p / '__init__.py')
                                     .exists())}
    assert tops - {'__init__'} <= set().union(*LAYERS)


def mapped():
    """The modules docs/design.md's module map names: its table's first
    column, a file (``jobs/job.py``) or a package's face (``jobs/``)."""
    text = (ROOT / 'docs' / 'design.md').read_text()
    table = text[text.index('## The module map'):text.index('## Rules')]
    return {m for m in re.findall(r'^\| `([^`]+)`', table, re.MULTILINE)}


def test_the_module_map_names_every_module_and_no_other():
    files = {path.relative_to(PACKAGE).as_posix() for _, path in ALL}
    files = {f[:-len('__init__.py')] if f.endswith('/__init__.py') else f
             for f in files}
    named = mapped()
    assert files - named == set(), 'in the package, not in design.md'
    assert named - files == set(), 'in design.md, not in the package'


def test_the_pictures_name_modules_there_are():
    import design_figures  # tools/design_figures.py
    for module in design_figures.modules():
        assert (PACKAGE / module).exists(), module
    text = (ROOT / 'docs' / 'design.md').read_text()
    for picture in ('design_run.png', 'design_job.png'):
        assert f'figures/{picture}' in text
        assert (ROOT / 'docs' / 'figures' / picture).stat().st_size > 10000


# Names of other projects design.md cites in a module's row: MPI's,
# ChainerUI's and ChainerMN's, which the module implements or reads.
FOREIGN = {'Comm_Split', 'CommandsExtension', 'adjust_hyperparams',
           'allreduce_grad_dtype'}


def defined(path):
    """The names ``path`` defines (functions, classes, their methods and
    attributes, assignments, imports, a package's lazy ``_EXPORTS``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                             ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) \
                else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target)
                          if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(target)
                          if isinstance(n, ast.Attribute)}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.isidentifier():
            names.add(node.value)  # a lazy export's key
    return names


def module_path(parts):
    """The file of the module ``dasktrain.<parts>``, or None."""
    path = PACKAGE.joinpath(*parts)
    for found in (path.with_suffix('.py'), path / '__init__.py'):
        if found.is_file():
            return found
    return None


def cited():
    """``(where, name)`` of each dotted name of the package that
    docs/design.md cites (``run.train.train``), and of each class or
    function a module's row of its map names (``JobRecord``,
    ``ending_words``)."""
    text = (ROOT / 'docs' / 'design.md').read_text()
    tops = {p.stem for p in PACKAGE.iterdir()}
    for m in re.finditer(r'`(?:dasktrain\.)?([a-z_]\w*(?:\.\w+)+)(?:\(\))?`',
                         text):
        if m.group(1).split('.')[0] in tops and \
                not m.group(1).endswith('.py'):
            yield 'prose', m.group(1)
    table = text[text.index('## The module map'):text.index('## Rules')]
    for row in re.finditer(r'^\| `([^`]+\.py)` \| (.*?) \|', table, re.M):
        for m in re.finditer(r'`([A-Za-z_]\w*)(\(\))?`', row.group(2)):
            name = m.group(1)
            looks_defined = m.group(2) or '_' in name.strip('_') or \
                re.fullmatch(r'[A-Z][a-z]\w*', name)
            if looks_defined and not name.isupper() and name not in FOREIGN:
                yield row.group(1), name


@pytest.mark.parametrize('where, name', list(cited()))
def test_the_names_design_md_cites_are_defined(where, name):
    if where == 'prose':
        parts = name.split('.')
        found = next(((module_path(parts[:k]), parts[k:])
                      for k in range(len(parts), 0, -1)
                      if module_path(parts[:k])), (None, None))
        assert found[0] is not None, f'no module for {name}'
        path, rest = found
        assert not rest or rest[0] in defined(path), \
            f'{name}: {path.relative_to(PACKAGE)} defines no {rest[0]}'
    else:
        assert name in defined(PACKAGE / where), \
            f'design.md says {where} owns {name}; it defines none'
