"""dg steps between two worker processes with the all-reduce overlapped
with the backward pass in buckets of several sizes:
`python bench/overlap.py --help`.

The same as `dasktrain bench overlap`; prints a Markdown table for README
(`--sockets` for the path between machines).
"""
import sys

from dasktrain.cli import main

if __name__ == '__main__':
    sys.exit(main(['bench', 'overlap', *sys.argv[1:]]))
