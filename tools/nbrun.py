"""Execute notebooks headless with parameters, keep copies and figures.

Parameters follow papermill's convention: the cell tagged ``parameters``
holds the defaults, and a cell tagged ``injected-parameters`` inserted after
it overrides them. The kernel runs in the caller's working directory, so a
relative path given as a parameter means what it means where it was typed
(the notebooks' own defaults are absolute: the checkout's ``data/`` and
``runs/``). Each executed notebook is written to the output folder with
every figure it drew as ``<notebook>-<n>.png``.

    python tools/nbrun.py --out notebooks/executed notebooks/*.ipynb
    python tools/nbrun.py -p epochs=1 -p train_size=500 \\
        notebooks/01_single_vs_multi_gpu.ipynb
"""
import argparse
import ast
import base64
import sys
from pathlib import Path

from dasktrain.errors import UserError
from dasktrain.files import atomic_write


class NotebookError(UserError):
    pass


GENERATED = ('injected-parameters', 'execution-note')  # cells we insert


def clean(nb):
    """``nb`` as its author wrote it: no outputs, no execution counts, and
    none of the cells a run inserted (a committed notebook is executed:
    running it again starts from its source)."""
    nb.cells = [c for c in nb.cells if not set(GENERATED) &
                set(c.get('metadata', {}).get('tags', ()))]
    for cell in nb.cells:
        if cell.cell_type == 'code':
            cell.outputs, cell.execution_count = [], None
    return nb


def add_note(nb, text):
    """Put ``text`` (markdown) first, tagged ``execution-note``."""
    import nbformat
    cell = nbformat.v4.new_markdown_cell(text)
    cell.metadata['tags'] = ['execution-note']
    nb.cells.insert(0, cell)
    return nb


def inject_parameters(nb, parameters):
    """Insert a cell assigning ``parameters`` after the ``parameters`` cell."""
    import nbformat
    if not parameters:
        return nb
    index = next((i for i, cell in enumerate(nb.cells)
                  if 'parameters' in cell.get('metadata', {}).get('tags', ())),
                 None)
    if index is None:
        raise NotebookError('the notebook has no cell tagged "parameters"')
    source = '\n'.join(f'{k} = {v!r}' for k, v in parameters.items())
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata['tags'] = ['injected-parameters']
    nb.cells.insert(index + 1, cell)
    return nb


def run_notebook(path, out_dir, parameters=None, timeout=3600, cwd=None,
                 note=None):
    """Execute ``path`` (:func:`clean` first) in ``cwd`` (default: the
    working directory); write the executed copy, with ``note`` (markdown)
    first if given, and its PNGs to ``out_dir``.

    Returns
    -------
    (Path, list of Path)
        The executed notebook and the figures.

    Raises
    ------
    NotebookError
        A cell failed; the executed copy up to that cell is still written.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path, out_dir = Path(path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    nb = inject_parameters(clean(nbformat.read(path, as_version=4)),
                           parameters)
    client = NotebookClient(nb, timeout=timeout, kernel_name='python3',
                            resources={'metadata': {
                                'path': str(cwd or Path.cwd())}})
    failure = None
    try:
        client.execute()
    except CellExecutionError as e:
        failure = e
    if note:
        add_note(nb, note)
    executed = out_dir / path.name
    atomic_write(executed, lambda f: f.write(nbformat.writes(nb).encode()))
    if failure is not None:
        summary = f'{failure.ename}: {failure.evalue}'.strip()
        raise NotebookError(f'{path.name}: a cell failed ({summary}); '
                            f'executed copy in {executed}')
    figures = []
    for cell in nb.cells:
        for output in cell.get('outputs', ()):
            data = output.get('data', {})
            if 'image/png' in data:
                figure = out_dir / f'{path.stem}-{len(figures) + 1}.png'
                png = base64.b64decode(data['image/png'])
                atomic_write(figure, lambda f, png=png: f.write(png))
                figures.append(figure)
    return executed, figures


def _parameter(text):
    key, sep, value = text.partition('=')
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f'expected NAME=VALUE, got {text!r}')
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value  # a bare string


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python tools/nbrun.py',
                                     description=__doc__.splitlines()[0])
    parser.add_argument('notebooks', nargs='+', type=Path)
    parser.add_argument('--out', type=Path, default=Path('notebooks/executed'),
                        help='folder for executed copies and PNGs '
                             '(default: %(default)s)')
    parser.add_argument('-p', '--parameter', type=_parameter, action='append',
                        default=[], metavar='NAME=VALUE',
                        help='override a parameter (Python literal)')
    args = parser.parse_args(argv)
    for notebook in args.notebooks:
        try:
            executed, figures = run_notebook(notebook, args.out,
                                             dict(args.parameter))
        except UserError as e:
            print(f'error: {e}', file=sys.stderr)
            return 1
        print(f'{executed} ({len(figures)} figures)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
