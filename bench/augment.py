"""Augmentation throughput on this machine: `python bench/augment.py --help`.

The same as `dasktrain bench augment`; prints a Markdown table for README.
"""
import sys

from dasktrain.cli import main

if __name__ == '__main__':
    sys.exit(main(['bench', 'augment', *sys.argv[1:]]))
