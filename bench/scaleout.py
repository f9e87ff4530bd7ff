"""One job across Dask worker processes: `python bench/scaleout.py --help`.

The same as `dasktrain bench scaleout`; prints a Markdown table for README.
"""
import sys

from dasktrain.cli import main

if __name__ == '__main__':
    sys.exit(main(['bench', 'scaleout', *sys.argv[1:]]))
