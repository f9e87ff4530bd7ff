"""The all-reduce between two processes of this machine against OpenMPI's:
`python bench/allreduce.py --help`.

The same as `dasktrain bench allreduce`; prints a Markdown table for README.
mpi4py (with an MPI) is a bench-only extra: `pip install mpi4py`.
"""
import sys

from dasktrain.cli import main

if __name__ == '__main__':
    sys.exit(main(['bench', 'allreduce', *sys.argv[1:]]))
