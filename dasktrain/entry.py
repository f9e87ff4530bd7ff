"""The ``dasktrain`` console script: :func:`dasktrain.cli.main`, with a
Ctrl-C that arrives while the command is still importing reported as one
line, as one that arrives later is."""
import sys


def main() -> int:
    try:
        from dasktrain.cli import finish
        from dasktrain.cli import main as run
    except KeyboardInterrupt:
        print('dasktrain: interrupted', file=sys.stderr)
        return 130
    return finish(run())
