"""Every code block of README.md and docs/ runs as written, in the order
given, in a fresh copy of the checkout (its own data/, no CIFAR-10, no
network needed, a home of its own): what a newcomer reading the page
would type.

How a block is read, by its fence's language and its first line:

* a first line ``# needs ...`` (any language): not run here, for the
  reason it gives the reader (``# needs 4 GPUs``, ``# needs root and a
  lab server``); :data:`NEEDS` lists the reasons allowed, and a test
  keeps their number small;
* ``python`` (or ``yaml``) whose first line names a file (``# mynet.py``,
  ``# space.yaml``): that file is written into the folder, as the reader
  saves it; any other ``python`` block is run as a script there;
* no language, ``sh`` or ``bash``: its lines run in bash, stopping at
  the first that fails; ``make test`` (the suite running this test) is
  the one line skipped, and a ``--watch`` command gets the reader's
  Ctrl-C after a few seconds;
* ``text``, ``ini``, ``json``: shown, not run (output, a unit file);
* a block that is, word for word, one an earlier page (README first,
  then docs/ by name) already ran: run there, once (install.md repeats
  README's first commands, chainermn.md its launch lines).

Pages not run (:data:`NOT_RUN_PAGES`), each for its reason.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r'^```([^\n]*)\n(.*?)^```', re.M | re.S)
NOT_RUN_PAGES = {
    'docs/gpu-check.md': 'a report a GPU machine wrote: its block is that '
                         "machine's output",
    'docs/design.md': 'its one block is a diagram, not marked ```text yet',
}
SHOWN = {'text', 'ini', 'json'}
SHELL = {'', 'sh', 'bash'}
# What a block may need that this machine (2 CPUs, no GPU, no network,
# one host) cannot give; the first words after "# needs".
NEEDS = ('GPU', 'GPUs', 'a GPU', '2 GPUs', '4 GPUs', 'root', 'a lab server',
         'the internet', 'a lab mirror', 'your own')
# Of about 65 blocks, those that need GPUs, root, a lab's other machines
# or the internet; no more may join without a reason that cannot wait
# (the 35th: gpus.md's check with the system CUDA toolkit hidden).
MAX_NOT_RUN = 35
FILE_LINE = re.compile(r'^# ([\w./-]+\.(py|yaml))\b')
SELF = {'make test'}  # the suite this test is part of
WATCH_S = 5


def pages():
    found = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
    return [p for p in found
            if str(p.relative_to(ROOT)) not in NOT_RUN_PAGES]


def blocks(page):
    """(language, text) of each fenced block of ``page``, in order."""
    return [(m.group(1).strip(), m.group(2))
            for m in FENCE.finditer(page.read_text())]


def repeats():
    """{(page name, block index)} of the blocks that repeat, word for
    word, a block of an earlier page (in :func:`pages` order)."""
    seen, found = set(), set()
    for page in pages():
        here = set()
        for i, (language, text) in enumerate(blocks(page)):
            key = (language, text.strip())
            if key in seen:
                found.add((page.name, i))
            here.add(key)
        seen |= here
    return found


def needs(text):
    """The reason a block gives for not running here, or None."""
    first = text.splitlines()[0] if text.strip() else ''
    return first[len('# needs '):] if first.startswith('# needs ') \
        else None


def fresh_copy(dest):
    """The checkout's files (tracked and new, not ignored) copied with
    their times (so make sees the installed venv as current), and .venv
    as this test's own. A venv older than pyproject.toml is not used: the
    copy's ``make`` would install the copy into it."""
    current = subprocess.run(['make', '-q', 'install'], cwd=ROOT,
                             capture_output=True)
    if current.returncode != 0 or Path(sys.prefix) != ROOT / '.venv':
        pytest.skip('the docs run with the checkout\'s own .venv, '
                    'installed and current: run `make install` (or `make '
                    'test`) first')
    listed = subprocess.run(
        ['git', 'ls-files', '-co', '--exclude-standard', '-z'], cwd=ROOT,
        capture_output=True, check=True).stdout.decode().split('\0')
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    os.symlink(Path(sys.prefix), dest / '.venv')


def shell_script(text):
    """A block's lines as a bash script: each must succeed; ``make test``
    skipped; a ``--watch`` stopped by Ctrl-C (SIGINT) after
    :data:`WATCH_S` seconds, as the reader would."""
    lines = ['set -e']
    for line in text.replace('\\\n', ' ').splitlines():
        command = line.split(' #')[0].strip()
        if command in SELF:
            lines.append(f'echo "(skipped: {command}, the running suite)"')
        elif '--watch' in command:
            lines.append(f'timeout -s INT {WATCH_S} {command} || '
                         '[ $? = 124 ] || [ $? = 130 ]')
        else:
            lines.append(line)
    return '\n'.join(lines) + '\n'


class Reader:
    """A fresh folder, a home of its own, the venv on PATH (as after
    ``source .venv/bin/activate``): runs a page's blocks in order."""

    def __init__(self, folder):
        self.folder = folder
        self.home = folder.parent / 'home'
        self.home.mkdir()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(('DASKTRAIN_', 'PYTEST_'))}
        self.env = dict(env, HOME=str(self.home), PATH=os.pathsep.join(
            [str(Path(sys.prefix) / 'bin'), env.get('PATH', '')]),
            DASKTRAIN_SHARED_DIR=str(folder.parent / 'no-shared-queue'))
        self.ran = []

    def run(self, language, text, where):
        reason = needs(text)
        if reason is not None:
            assert reason.split(':')[0].split(' (')[0] in NEEDS or \
                reason.startswith(NEEDS), f'{where}: # needs {reason}'
            return
        if language in SHOWN:
            return
        first = text.splitlines()[0]
        named = FILE_LINE.match(first)
        if language in ('python', 'yaml') and named:
            (self.folder / named.group(1)).write_text(text)
            return
        if language == 'yaml':
            import yaml
            yaml.safe_load(text)
            return
        if language == 'python':
            script = self.folder / f'.block-{len(self.ran)}.py'
            script.write_text(text)
            argv = [str(Path(sys.prefix) / 'bin' / 'python'), script.name]
        else:
            assert language in SHELL, f'{where}: a ```{language} block'
            argv = ['bash', '-c', shell_script(text)]
        self.ran.append(where)
        with subprocess.Popen(argv, cwd=self.folder, env=self.env,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) as child:
            try:
                out, _ = child.communicate(timeout=600)
            finally:
                if child.poll() is None:
                    os.killpg(child.pid, signal.SIGKILL)
        assert child.returncode == 0, \
            f'{where} failed (exit {child.returncode}):\n{text}\n{out[-4000:]}'

    def close(self):
        """Stop what the page started (a cluster of its own)."""
        if (self.home / '.dasktrain').exists():
            subprocess.run([str(Path(sys.prefix) / 'bin' / 'dasktrain'),
                            'cluster', 'stop'], cwd=self.folder,
                           env=self.env, capture_output=True, timeout=120)


def test_few_blocks_are_not_run_and_each_says_why():
    marked = [(page.name, reason) for page in pages()
              for _, text in blocks(page)
              if (reason := needs(text)) is not None]
    assert len(marked) <= MAX_NOT_RUN, marked
    for name, reason in marked:
        assert reason.startswith(NEEDS), (name, reason)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize('page', pages(), ids=lambda p: p.name)
def test_every_block_runs_as_written(page, tmp_path):
    folder = tmp_path / 'dasktrain'
    folder.mkdir()
    fresh_copy(folder)
    reader = Reader(folder)
    start = time.monotonic()
    repeated = repeats()
    try:
        for i, (language, text) in enumerate(blocks(page)):
            if (page.name, i) in repeated:
                continue  # an earlier page ran these very lines
            reader.run(language, text, f'{page.name} block {i + 1}')
    finally:
        reader.close()
    print(f'{page.name}: {len(reader.ran)} blocks ran in '
          f'{time.monotonic() - start:.0f} s')


def test_a_repeated_block_is_an_earlier_page_s_word_for_word():
    # install.md opens with README's two commands, chainermn.md repeats
    # README's launch lines: they run once, where README has them.
    repeated = repeats()
    assert {('install.md', 0), ('chainermn.md', 0)} <= repeated
    order = pages()
    for name, i in repeated:
        at = [p.name for p in order].index(name)
        language, text = blocks(order[at])[i]
        assert any((lang, t.strip()) == (language, text.strip())
                   for page in order[:at] for lang, t in blocks(page)), \
            (name, i)
