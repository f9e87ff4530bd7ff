"""Training throughput on this machine: `python bench/train.py --help`.

The same as `dasktrain bench train`; prints a Markdown table for README.
"""
import sys

from dasktrain.cli import main

if __name__ == '__main__':
    sys.exit(main(['bench', 'train', *sys.argv[1:]]))
