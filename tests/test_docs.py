"""README and docs/ tell the truth about the tree and the command line:
every relative link resolves (to a file, and an ``#anchor`` to one of its
headings), and every ``dasktrain ...`` command shown in a code block names
a real subcommand whose ``--help`` lists each flag the line uses."""
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from dasktrain.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')
FENCE = re.compile(r'^```[^\n]*\n(.*?)^```', re.M | re.S)
# A fenced block with its info string; one a program printed (```text)
# is output, not commands to run
INFO_FENCE = re.compile(r'^```([^\n]*)\n(.*?)^```', re.M | re.S)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped,
    spaces to hyphens."""
    text = re.sub(r'[`*_]', '', heading.strip().lower())
    return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def anchors(page):
    text = FENCE.sub('', page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r'^#+\s+(.*)$', text,
                                                  re.M)}


def links():
    for page in PAGES:
        text = FENCE.sub('', page.read_text())
        for target in LINK.findall(text):
            if not re.match(r'[a-z]+:', target):  # http:, mailto: ...
                yield page, target


@pytest.mark.parametrize('page, target', list(links()),
                         ids=lambda v: str(v).replace(str(ROOT), ''))
def test_relative_links_resolve(page, target):
    path, _, anchor = target.partition('#')
    file = (page.parent / path).resolve() if path else page
    assert file.exists(), f'{page.name}: {target} does not exist'
    if anchor and file.suffix == '.md':
        assert anchor in anchors(file), \
            f'{page.name}: no heading #{anchor} in {file.name}'


def commands():
    """(page, line) of each ``dasktrain`` command in a code block, its
    ``\\`` continuations joined and a ``$ `` prompt dropped."""
    for page in PAGES:
        for info, block in INFO_FENCE.findall(page.read_text()):
            if info.strip() == 'text':
                continue
            block = block.replace('\\\n', ' ')
            for line in block.splitlines():
                line = line.strip().removeprefix('$ ')
                if line.startswith('dasktrain ') and '...' not in line \
                        and '<' not in line:
                    yield page, line.split('#')[0].strip()


def _subcommands(parser):
    for action in parser._actions:  # argparse keeps its subparsers here
        if getattr(action, 'choices', None) and \
                isinstance(action.choices, dict):
            return action.choices
    return {}


def _help(path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*path, '--help']) == 0, f'dasktrain {path} --help'
    return out.getvalue()


@pytest.mark.parametrize('page, line', list(commands()),
                         ids=lambda v: str(v).replace(str(ROOT), ''))
def test_commands_shown_exist_with_their_flags(page, line):
    words = shlex.split(line)[1:]
    # After `--` come training options (submit, tune) or a program.
    own, rest = (words[:words.index('--')], words[words.index('--') + 1:]) \
        if '--' in words else (words, [])
    parser, path = build_parser(), []
    for word in own:
        sub = _subcommands(parser)
        if word.startswith('-') or word not in sub:
            break
        parser, path = sub[word], path + [word]
    assert path, f'{page.name}: `{line}` names no dasktrain command'
    helps = [_help(path)]
    if rest and rest[0].startswith('-'):
        helps.append(_help(['train']))  # options of the training run
    elif rest:  # a program's own arguments are not ours to check
        rest = []
    flags = {w.split('=')[0] for w in own + rest if w.startswith('--')}
    for flag in flags:
        assert any(re.search(rf'{re.escape(flag)}\b', h) for h in helps), \
            f'{page.name}: `{line}`: dasktrain {" ".join(path)} has no {flag}'
