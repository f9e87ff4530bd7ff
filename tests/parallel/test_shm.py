"""Sums through shared memory among the ranks of one machine: every path
(written through, gathered into a copy, each rank choosing alone, small,
over TCP with shared memory off) against a reference written here, bit
for bit, and rank 0's arrays broadcast through the same segments, on 2
and 3 ranks that ``dasktrain launch`` starts (real processes, real
segments)."""
import doctest
import glob
import os
import sys
import textwrap

import pytest

from dasktrain.parallel.comm import board, regions, shm
from tests.children import child

# Each rank of the script below sums, over every path, arrays it draws
# from its rank's seed; it draws every other rank's too and checks the
# sums against `reference` (rank order, then the scale, in each dtype).
RANKS = textwrap.dedent('''
    import os, sys
    import numpy as np
    import dasktrain.chainermn as chainermn

    SHAPES = [((301, 7), 'float32'), ((4099,), 'float32'),
              ((11, 13, 17), 'float64'), ((2500,), 'float16'),
              ((1,), 'float32'), ((200003,), 'float32')]

    def draw(rank, call):
        rng = np.random.default_rng(1000 * call + rank)
        return [(rng.standard_normal(shape) * 3).astype(dtype)
                for shape, dtype in SHAPES]

    def reference(size, call, scale):
        parts = [draw(r, call) for r in range(size)]
        out = []
        for k in range(len(SHAPES)):
            total = np.add(parts[0][k], parts[1][k])
            for p in parts[2:]:
                total += p[k]
            out.append(total if scale is None else
                       np.multiply(total, scale, out=total))
        return out

    comm = chainermn.create_communicator('naive').comm  # the DaskComm
    rank, size = comm.rank, comm.size
    failed = []
    for call, (scale, how) in enumerate([
            (None, 'through'), (1.0 / size, 'through'), (0.5, 'through'),
            (1.0 / size, 'aliased'), (None, 'strided'),
            (1.0 / size, 'mixed'), (1.0 / size, 'through'),
            (1.0 / size, 'small'), (1.0 / size, 'one'),
            (1.0 / size, 'one-mixed'), (None, 'one')]):
        arrays = draw(rank, call)
        want = reference(size, call, scale)
        if how == 'aliased':  # two views of one buffer: gathered
            both = np.concatenate([arrays[1], arrays[1]])
            arrays[1], extra = both[:4099], both[2049:]
            theirs = [np.concatenate([draw(r, call)[1]] * 2)[2049:]
                      for r in range(size)]
            want_extra = sum(theirs[1:], theirs[0]) * np.float32(scale)
        if how == 'strided' or (how == 'mixed' and rank == 1):
            # a view with steps: gathered into one copy (in 'mixed' on one
            # rank alone: the others write through)
            wide = np.zeros((301, 14), np.float32)
            wide[:, ::2] = arrays[0]
            arrays[0] = wide[:, ::2]
        if how == 'small':
            arrays, want = arrays[:2], want[:2]
            arrays[1], want[1] = arrays[1][:3000], None
        if how.startswith('one'):  # one small array: its own path
            arrays = [arrays[1][:3000].copy()]
            if how == 'one-mixed' and rank == 1:  # the general one here
                wide = np.zeros(6000, np.float32)
                wide[::2] = arrays[0]
                arrays = [wide[::2]]
            part = [draw(r, call)[1][:3000] for r in range(size)]
            total = sum(part[1:], part[0])
            want = [total if scale is None else np.multiply(total, scale)]
        sent = arrays + ([extra] if how == 'aliased' else [])
        comm.allreduce(sent, scale=scale)
        if how == 'small':  # a slice of one draw: summed alone
            part = [draw(r, call)[1][:3000] for r in range(size)]
            want[1] = np.multiply(sum(part[1:], part[0]), scale)
        for k, (got, expected) in enumerate(zip(arrays, want)):
            if how == 'aliased' and k == 1:
                continue  # overwritten by `extra`, its later view
            if got.dtype != expected.dtype or \\
                    got.tobytes() != np.ascontiguousarray(expected).tobytes():
                failed.append(f'call {call} ({how}) array {k}')
        if how == 'aliased' and not np.array_equal(extra, want_extra):
            failed.append(f'call {call} (aliased) the second view')
    # rank 0's arrays everywhere, through the segments of their sums
    for call in (10, 11):
        arrays = draw(rank, call)
        comm.bcast_arrays(arrays)
        if any(got.tobytes() != want.tobytes()
               for got, want in zip(arrays, draw(0, call))):
            failed.append(f'bcast {call}')
    board = comm._shm is not None and comm._shm.board is not None
    print(f'rank {rank} on a board: {board}', flush=True)
    print(f'rank {rank} of {size} via {comm.route}:',
          'ok' if not failed else failed, flush=True)
    sys.exit(1 if failed else 0)
''')


def launched(tmp_path, n, shared):
    script = tmp_path / 'sums.py'
    script.write_text(RANKS)
    env = {'DASKTRAIN_SHARED_MEMORY': shared}
    argv = [sys.executable, '-m', 'dasktrain.cli', 'launch', '-n', str(n),
            '--out', str(tmp_path / 'ranks'), '--timeout', '60', '--',
            sys.executable, str(script)]
    with child(argv, env=dict(os.environ, **env), cwd=tmp_path) as proc:
        code = proc.wait(120)
        err = proc.stderr()
        out = ''.join(proc.lines)
    logs = ''.join(p.read_text() for p in
                   sorted((tmp_path / 'ranks').glob('rank*.log')))
    return code, out + logs, err


@pytest.mark.equivalence
@pytest.mark.parametrize('n', [2, 3])
@pytest.mark.parametrize('shared', ['1', '0'], ids=['shm', 'tcp'])
def test_every_path_sums_the_reference_bits(tmp_path, n, shared):
    before = set(glob.glob('/dev/shm/dasktrain-*'))  # others' are theirs
    code, out, err = launched(tmp_path, n, shared)
    assert code == 0, out + err
    route = 'shared memory' if shared == '1' else 'links'
    for rank in range(n):
        assert f'rank {rank} of {n} via {route}: ok' in out, out + err
        # the barriers and small sums meet in shared memory (on x86)
        on_board = shared == '1' and board.supported()
        assert f'rank {rank} on a board: {on_board}' in out, out + err
    assert set(glob.glob('/dev/shm/dasktrain-*')) <= before  # unlinked


def test_the_slices_and_their_pieces():
    for module in (shm, regions):
        assert doctest.testmod(module).failed == 0
    assert doctest.testmod(shm).attempted >= 2
    assert doctest.testmod(regions).attempted >= 6
    # every rank's slice, cut into pieces of arrays, covers each element
    # once, in order, whatever the sizes and the chunk
    sizes = [5, 1, 0, 17, 3]
    total = sum(sizes)
    for size in (1, 2, 3, 7):
        seen = []
        for lo, hi in regions.bounds(total, size):
            for step in (None, 1, 4):
                got = regions.pieces(sizes, lo, hi, step)
                flat = [f + j for _, _, f, n in got for j in range(n)]
                assert flat == list(range(lo, hi))
                for index, start, f_lo, n in got:
                    assert 0 < n <= (step or n)
                    assert f_lo == sum(sizes[:index]) + start
                    assert start + n <= sizes[index]
            seen.extend(range(lo, hi))
        assert seen == list(range(total))


@pytest.mark.parametrize('align', [1, 4, 16])
def test_each_array_and_slice_starts_on_a_cache_line(align):
    # the region's layout: each array on a multiple of `align` elements
    # (a cache line), each rank's slice too, and every piece of a slice
    # (cut in chunks of a multiple of it) starts on one; the pieces still
    # cover every element of every array once, in order
    sizes = [5, 1, 0, 17, 3, 32, 2107]
    begins, count = regions.starts(sizes, align)
    assert all(b % align == 0 for b in begins)
    assert all(b + n <= after for b, n, after in
               zip(begins, sizes, begins[1:]))
    assert count == begins[-1] + sizes[-1]
    for size in (1, 2, 3, 7):
        edges = regions.bounds(count, size, align)
        assert edges[0][0] == 0 and edges[-1][1] == count
        assert all(hi == lo for (_, hi), (lo, _) in zip(edges, edges[1:]))
        assert all(lo % align == 0 for lo, _ in edges)
        for step in (None, align, 4 * align):
            seen = []
            for lo, hi in edges:
                for index, start, f_lo, n in regions.pieces(
                        sizes, lo, hi, step, align):
                    assert f_lo == begins[index] + start
                    assert f_lo % align == 0  # never mid-line
                    assert 0 < n <= (step or n)
                    seen.extend((index, start + j) for j in range(n))
            assert seen == [(i, j) for i, n in enumerate(sizes)
                            for j in range(n)]
    # a dtype's cache line: 16 float32, 8 float64, 1 for odd item sizes
    assert [regions.unit(d) for d in ('<f4', '<f8', '<f2', 'V3')] == \
        [16, 8, 32, 1]
