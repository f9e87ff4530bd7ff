"""``mpiexec -n N python under_mpi.py SCRIPT ARGS...``: SCRIPT, unchanged,
with real ChainerMN, whose multi-node iterator (ChainerMN 7.8.1's) fails
on NumPy 2 (``int()`` of a one-element array): its other ranks are
dasktrain.chainermn's fixed copy, which talks to any ChainerMN
communicator. The reference runs of
tests/chainermn/test_chainermn_examples.py."""
import os
import runpy
import sys

import chainermn.iterators.multi_node_iterator as upstream

from dasktrain.chainermn.iterators import MultiNodeIteratorSlave

upstream._MultiNodeIteratorSlave = MultiNodeIteratorSlave
script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name='__main__')
