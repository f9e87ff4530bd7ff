"""Rank 0's address file, where a launch's ranks meet without a
scheduler: what rank 0 writes is read back whole; what is not a regular
file of this user's holding an address is refused in one line, never
dialled; a rank 0 that never writes is a timeout, said."""
import os
import threading
import time

import pytest

from dasktrain.parallel.comm.base import CollectiveError
from dasktrain.parallel.comm.rendezvous import (
    read_rank0_address,
    write_rank0_address,
)


def test_written_later_is_waited_for(tmp_path):
    path = tmp_path / 'rank0'
    later = threading.Timer(
        0.3, write_rank0_address, (str(path), 'tls://127.0.0.1:40999'))
    later.daemon = True
    later.start()
    started = time.monotonic()
    assert read_rank0_address(str(path), 10) == 'tls://127.0.0.1:40999'
    assert 0.25 < time.monotonic() - started < 5
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_never_written_is_a_timeout(tmp_path):
    with pytest.raises(CollectiveError, match=r'rank 0 of 3 did not start '
                       r'within 0.2 s'):
        read_rank0_address(str(tmp_path / 'rank0'), 0.2, 3)


@pytest.mark.parametrize('plant', ['symlink', 'fifo', 'garbage', 'huge',
                                   'other owner'])
def test_what_is_not_rank0s_is_refused(tmp_path, plant):
    path = tmp_path / 'rank0'
    if plant == 'symlink':
        (tmp_path / 'real').write_text('tls://127.0.0.1:1')
        path.symlink_to(tmp_path / 'real')
    elif plant == 'fifo':
        os.mkfifo(path)
    elif plant == 'garbage':
        path.write_text('tls://evil.example:1; rm -rf ~')
    elif plant == 'huge':
        path.write_text('tls://127.0.0.1:' + '1' * 100000)
    else:
        if os.geteuid() != 0:
            pytest.skip('only root can give a file to another user')
        path.write_text('tls://127.0.0.1:1')
        os.chown(path, 65534, 65534)
    with pytest.raises(CollectiveError, match="rank 0's address file .* is "
                       'refused'):
        read_rank0_address(str(path), 1)
