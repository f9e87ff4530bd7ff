import os
import tarfile
from pathlib import Path

import dask
import numpy as np
import pytest
from cifar_fixture import batch_file, make_batches, py2_pickle, write_archive

from dasktrain.cli import main
from dasktrain.data import (
    ARCHIVE_NAME,
    BATCHES_DIR,
    CIFAR10_MD5,
    DataError,
    download_cifar10,
    extract_archive,
    load_cifar10,
)

FAST = dict(backoff=0.01, progress=False)


def _expected(batches, names):
    images = np.concatenate([batches[n][0] for n in names])
    labels = np.concatenate([batches[n][1] for n in names]).astype(np.int32)
    return images, labels


def _leftovers(folder):
    return sorted(p.name for p in Path(folder).iterdir()
                  if p.name.startswith('.') or p.name.endswith('.part'))


# --------------------------------------------------------------- download

def test_download_fetches_verifies_and_extracts(tmp_path, archive_server,
                                                cifar_archive):
    out = download_cifar10(tmp_path, url=archive_server.url(),
                           md5=cifar_archive[1], **FAST)
    assert out == tmp_path / BATCHES_DIR
    assert sorted(p.name for p in out.iterdir()) == [
        'batches.meta', 'data_batch_1', 'data_batch_2', 'data_batch_3',
        'data_batch_4', 'data_batch_5', 'test_batch']
    assert (tmp_path / ARCHIVE_NAME).read_bytes() == \
        cifar_archive[0].read_bytes()
    assert _leftovers(tmp_path) == []
    assert len(archive_server.requests) == 1


def test_url_from_environment(tmp_path, archive_server, cifar_archive,
                              monkeypatch):
    monkeypatch.setenv('DASKTRAIN_CIFAR10_URL', archive_server.url())
    download_cifar10(tmp_path, md5=cifar_archive[1], **FAST)
    assert archive_server.requests[0][0] == '/cifar-10-python.tar.gz'


def test_md5_from_environment(tmp_path, archive_server, cifar_archive,
                              monkeypatch):
    # A lab mirror with its own archive, set once for every command.
    monkeypatch.setenv('DASKTRAIN_CIFAR10_URL', archive_server.url())
    monkeypatch.setenv('DASKTRAIN_CIFAR10_MD5', cifar_archive[1].upper())
    assert (download_cifar10(tmp_path, **FAST) / 'test_batch').is_file()


def test_local_archive_and_folder_need_no_network(tmp_path, cifar_archive):
    dead = 'http://127.0.0.1:9/cifar-10-python.tar.gz'
    (tmp_path / ARCHIVE_NAME).write_bytes(cifar_archive[0].read_bytes())
    download_cifar10(tmp_path, url=dead, md5=cifar_archive[1], **FAST)
    (tmp_path / ARCHIVE_NAME).unlink()
    assert download_cifar10(tmp_path, url=dead, **FAST).is_dir()


def test_resumes_a_broken_stream_with_range(tmp_path, archive_server,
                                            cifar_archive):
    archive_server.faults = [('cut', 5000)]
    download_cifar10(tmp_path, url=archive_server.url(),
                     md5=cifar_archive[1], **FAST)
    assert [r for _, r in archive_server.requests] == [None, 'bytes=5000-']
    assert (tmp_path / ARCHIVE_NAME).read_bytes() == \
        cifar_archive[0].read_bytes()


def test_resumes_a_partial_file_left_by_an_earlier_run(tmp_path,
                                                       archive_server,
                                                       cifar_archive):
    data = cifar_archive[0].read_bytes()
    (tmp_path / (ARCHIVE_NAME + '.part')).write_bytes(data[:7000])
    download_cifar10(tmp_path, url=archive_server.url(),
                     md5=cifar_archive[1], **FAST)
    assert archive_server.requests[0][1] == 'bytes=7000-'
    assert (tmp_path / ARCHIVE_NAME).read_bytes() == data


def test_restarts_when_server_ignores_range(tmp_path, archive_server,
                                            cifar_archive):
    data = cifar_archive[0].read_bytes()
    (tmp_path / (ARCHIVE_NAME + '.part')).write_bytes(b'x' * 7000)
    archive_server.faults = ['no-range']
    download_cifar10(tmp_path, url=archive_server.url(),
                     md5=cifar_archive[1], **FAST)
    assert (tmp_path / ARCHIVE_NAME).read_bytes() == data


def test_retries_transient_server_errors(tmp_path, archive_server,
                                         cifar_archive):
    archive_server.faults = [503, 502]
    download_cifar10(tmp_path, url=archive_server.url(),
                     md5=cifar_archive[1], **FAST)
    assert len(archive_server.requests) == 3


def test_gives_up_after_retries(tmp_path, archive_server, cifar_archive):
    archive_server.faults = [503] * 10
    with pytest.raises(DataError, match=r': the server kept failing \(too '
                                        r'many 503 error responses\); check '
                                        r'the mirror \(url'):
        download_cifar10(tmp_path, url=archive_server.url(),
                         md5=cifar_archive[1], retries=2, **FAST)
    assert len(archive_server.requests) == 3
    assert not (tmp_path / ARCHIVE_NAME).exists()


def test_http_404_is_one_clear_error(tmp_path, archive_server):
    with pytest.raises(DataError, match=r'HTTP 404.*url'):
        download_cifar10(tmp_path, url=archive_server.url('nope.tar.gz'),
                         **FAST)
    assert list(tmp_path.iterdir()) == []


def test_no_network_is_one_clear_error(tmp_path):
    with pytest.raises(DataError) as error:
        download_cifar10(tmp_path, url='http://127.0.0.1:9/x.tar.gz',
                         retries=1, **FAST)
    # What failed, in words; not urllib3's nested reprs.
    assert str(error.value) == (
        'cannot download http://127.0.0.1:9/x.tar.gz: 127.0.0.1:9 refused '
        'the connection; check the mirror (url or $DASKTRAIN_CIFAR10_URL), '
        'or put cifar-10-python.tar.gz into the data dir')


def test_a_failed_first_download_leaves_no_empty_folder(tmp_path):
    data = tmp_path / 'data'
    with pytest.raises(DataError):
        download_cifar10(data, url='http://127.0.0.1:9/x.tar.gz',
                         retries=0, **FAST)
    assert not data.exists()


def test_a_name_that_does_not_resolve_is_said_so(tmp_path):
    # .invalid never resolves (RFC 6761): no network is needed to fail.
    with pytest.raises(DataError, match=r'^cannot download http://cifar\.'
                       r'invalid/x\.tar\.gz: the name cifar\.invalid cannot '
                       r'be resolved \(offline, or no DNS\); check the '
                       r'mirror'):
        download_cifar10(tmp_path, url='http://cifar.invalid/x.tar.gz',
                         retries=0, **FAST)


def test_md5_mismatch_removes_the_file(tmp_path, archive_server):
    with pytest.raises(DataError, match=f'does not match the expected '
                                        f'{CIFAR10_MD5}.*removed'):
        download_cifar10(tmp_path, url=archive_server.url(), **FAST)
    assert list(tmp_path.iterdir()) == []


def test_md5_mismatch_of_a_local_archive(tmp_path, cifar_archive):
    (tmp_path / ARCHIVE_NAME).write_bytes(cifar_archive[0].read_bytes())
    with pytest.raises(DataError, match='pass md5'):
        download_cifar10(tmp_path, url='http://127.0.0.1:9/', **FAST)
    assert not (tmp_path / BATCHES_DIR).exists()


def test_unwritable_data_dir(tmp_path):
    blocker = tmp_path / 'file'
    blocker.write_text('not a folder')
    with pytest.raises(DataError, match='not writable.*data_dir'):
        download_cifar10(blocker / 'data', **FAST)


def test_a_read_only_data_dir_that_holds_the_batches_is_used(cifar_dir,
                                                              tmp_path):
    import subprocess
    ro = tmp_path / 'ro'
    ro.mkdir()
    if subprocess.run(['mount', '--bind', '-o', 'ro', str(cifar_dir),
                       str(ro)], capture_output=True).returncode != 0:
        pytest.skip('cannot make a read-only bind mount here (needs root)')
    try:
        with pytest.raises(OSError):  # read-only indeed, even for root
            (ro / 'probe').write_text('')
        assert download_cifar10(ro, url='http://127.0.0.1:9/', **FAST) == \
            ro / BATCHES_DIR
        assert load_cifar10(ro, download=True).train_images.shape[0] == 100
    finally:
        subprocess.run(['umount', '-l', str(ro)], check=False)


@pytest.mark.parametrize('kind', ['archive is a folder',
                                  'batches folder is a file'])
def test_something_else_in_the_place_of_the_data(tmp_path, archive_server,
                                                  kind):
    if kind == 'archive is a folder':
        (tmp_path / ARCHIVE_NAME).mkdir()
        message = f'{tmp_path / ARCHIVE_NAME} is not a file'
    else:
        (tmp_path / BATCHES_DIR).write_text('not a folder')
        message = f'{tmp_path / BATCHES_DIR} is not a folder'
    with pytest.raises(DataError) as caught:
        download_cifar10(tmp_path, url=archive_server.url(), **FAST)
    assert message in str(caught.value) and '\n' not in str(caught.value)
    assert archive_server.requests == []  # said before any download


def test_an_empty_archive_is_one_line(tmp_path, capsys):
    (tmp_path / ARCHIVE_NAME).write_bytes(b'')
    empty_md5 = 'd41d8cd98f00b204e9800998ecf8427e'
    assert main(['download', '--data-dir', str(tmp_path), '--md5',
                 empty_md5]) == 1
    err = capsys.readouterr().err
    assert err.count('\n') == 1
    assert f'{tmp_path / ARCHIVE_NAME} (0 bytes) is corrupt' in err
    assert "method gz: ReadError('empty file')" in err


# --------------------------------------------------------------- extraction

def test_truncated_archive(tmp_path, cifar_archive):
    data = cifar_archive[0].read_bytes()
    bad = tmp_path / 'src' / ARCHIVE_NAME
    bad.parent.mkdir()
    bad.write_bytes(data[:len(data) // 2])
    with pytest.raises(DataError, match='corrupt or truncated'):
        extract_archive(bad, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['src']


def _evil(name, kind=tarfile.REGTYPE, link=''):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    content = b'pwned' if kind == tarfile.REGTYPE else None
    info.size = len(content) if content else 0
    return info, content


@pytest.mark.parametrize('member,reason', [
    (_evil('../escaped'), 'leaves the target'),
    (_evil('cifar-10-batches-py/../../escaped'), 'leaves the target'),
    (_evil('/tmp/dasktrain-absolute-escape'), 'absolute'),
    (_evil('cifar-10-batches-py/link', tarfile.SYMTYPE, '/etc/passwd'),
     'links'),
    (_evil('cifar-10-batches-py/hard', tarfile.LNKTYPE, '/etc/passwd'),
     'links'),
    (_evil('cifar-10-batches-py/dev', tarfile.CHRTYPE), 'regular files'),
])
def test_members_that_escape_are_refused(tmp_path, cifar_batches, member,
                                         reason):
    data = tmp_path / 'deep' / 'data'
    data.mkdir(parents=True)
    md5 = write_archive(data / ARCHIVE_NAME, cifar_batches, extra=[member])
    with pytest.raises(DataError, match=reason):
        download_cifar10(data, url='http://127.0.0.1:9/', md5=md5, **FAST)
    assert not (tmp_path / 'escaped').exists()
    assert not (tmp_path / 'deep' / 'escaped').exists()
    assert not Path('/tmp/dasktrain-absolute-escape').exists()
    assert not (data / BATCHES_DIR).exists()
    assert _leftovers(data) == []


def test_archive_without_batches_folder(tmp_path):
    src = tmp_path / ARCHIVE_NAME
    with tarfile.open(src, 'w:gz') as tar:
        info, content = _evil('readme.txt')
        import io
        tar.addfile(info, io.BytesIO(content))
    with pytest.raises(DataError, match='no cifar-10-batches-py'):
        extract_archive(src, tmp_path)


# --------------------------------------------------------------- loading

def test_load_returns_lazy_dask_arrays(cifar_dir, cifar_batches):
    cifar = load_cifar10(cifar_dir, download=False)
    assert cifar.train_images.shape == (100, 3, 32, 32)
    assert cifar.train_images.dtype == np.uint8
    assert cifar.train_images.chunks[0] == (20,) * 5
    assert cifar.test_images.chunks[0] == (20,)
    assert cifar.train_labels.dtype == np.int32
    assert cifar.label_names[:3] == ('airplane', 'automobile', 'bird')
    names = [f'data_batch_{i}' for i in range(1, 6)]
    images, labels = _expected(cifar_batches, names)
    np.testing.assert_array_equal(cifar.train_images.compute(), images)
    np.testing.assert_array_equal(cifar.train_labels.compute(), labels)
    test_images, test_labels = _expected(cifar_batches, ['test_batch'])
    np.testing.assert_array_equal(cifar.test_images.compute(), test_images)
    np.testing.assert_array_equal(cifar.test_labels.compute(), test_labels)


def test_pixels_are_read_only_when_computed(cifar_dir, cifar_batches):
    cifar = load_cifar10(cifar_dir, download=False)
    images, labels = cifar_batches['test_batch']
    changed = (255 - images).astype(np.uint8)
    # Same size, same labels: only a lazy reader sees the new pixels.
    path = cifar_dir / BATCHES_DIR / 'test_batch'
    path.write_bytes(batch_file(changed, labels))
    np.testing.assert_array_equal(cifar.test_images.compute(), changed)


def test_one_task_per_batch_file(cifar_dir):
    cifar = load_cifar10(cifar_dir, download=False)
    graph = dict(cifar.train_images.__dask_graph__())
    reads = [k for k in graph if str(k).startswith('cifar-data_batch')]
    assert len(reads) == 5


def test_any_number_of_images_per_batch(tmp_path):
    batches = make_batches(n_train=(3, 7, 1, 4, 5), n_test=6)
    write_archive(tmp_path / 'a.tar.gz', batches)
    extract_archive(tmp_path / 'a.tar.gz', tmp_path)
    cifar = load_cifar10(tmp_path, download=False)
    assert cifar.train_images.chunks[0] == (3, 7, 1, 4, 5)
    assert cifar.test_labels.shape == (6,)


def test_load_downloads_when_missing(tmp_path, archive_server, cifar_archive):
    cifar = load_cifar10(tmp_path, url=archive_server.url(),
                         md5=cifar_archive[1])
    assert cifar.train_images.shape[0] == 100


def test_missing_folder_without_download(tmp_path):
    with pytest.raises(DataError, match='dasktrain download'):
        load_cifar10(tmp_path, download=False)


def _replace_batch(folder, name, content):
    (folder / BATCHES_DIR / name).write_bytes(content)


def test_doctored_pickle_is_refused_not_executed(cifar_dir, tmp_path):
    marker = tmp_path / 'pwned'
    # A GLOBAL os.system + REDUCE, as a malicious batch would carry.
    evil = (b'\x80\x02cposix\nsystem\n' +
            b'U' + bytes([len(f'touch {marker}')]) +
            f'touch {marker}'.encode() + b'\x85R.')
    _replace_batch(cifar_dir, 'data_batch_2', evil)
    with pytest.raises(DataError, match=r'data_batch_2.*refusing to load '
                                        r'posix\.system'):
        load_cifar10(cifar_dir, download=False)
    assert not marker.exists()


@pytest.mark.parametrize('content,message', [
    (b'garbage that is no pickle', 'not a valid CIFAR pickle'),
    (py2_pickle({b'data': np.zeros((2, 3072), np.uint8)})[:-40],
     'not a valid CIFAR pickle'),
    (py2_pickle([1, 2, 3]), 'holds a list'),
    (py2_pickle({b'labels': [1]}), "no 'data' entry"),
    (batch_file(np.zeros((2, 3, 16, 16), np.uint8), [1, 2]),
     r'uint8 array of shape \(N, 3072\), got uint8 \(2, 768\)'),
    (py2_pickle({b'data': np.zeros((2, 3072), np.float32), b'labels': [1, 2]}),
     'got float32'),
    (batch_file(np.zeros((2, 3, 32, 32), np.uint8), [1, 10]),
     r'labels must lie in 0\.\.9, found 1\.\.10'),
    (batch_file(np.zeros((2, 3, 32, 32), np.uint8), [1]),
     '1 labels for 2 images'),
])
def test_bad_batch_files(cifar_dir, content, message):
    _replace_batch(cifar_dir, 'data_batch_3', content)
    with pytest.raises(DataError, match=message) as info:
        load_cifar10(cifar_dir, download=False)
    assert 'data_batch_3' in str(info.value)
    assert '\n' not in str(info.value)


def test_missing_batch_file(cifar_dir):
    (cifar_dir / BATCHES_DIR / 'data_batch_4').unlink()
    with pytest.raises(DataError, match='missing batch file .*data_batch_4'):
        load_cifar10(cifar_dir, download=False)


def test_equals_chainer_get_cifar10(tmp_path, monkeypatch):
    """Image for image what chainer reads from the same (full-size) archive."""
    import hashlib

    import chainer
    from chainer.datasets import cifar as chainer_cifar
    batches = make_batches(n_train=(10000,) * 5, n_test=10000, seed=1)
    archive = tmp_path / ARCHIVE_NAME
    md5 = write_archive(archive, batches)
    root = tmp_path / 'chainer'
    url = 'https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz'
    cache = root / '_dl_cache'
    cache.mkdir(parents=True)
    os.link(archive, cache / hashlib.md5(url.encode()).hexdigest())
    monkeypatch.setattr(chainer.dataset.download, '_dataset_root', str(root))
    # (chainer caches what it read with savez_compressed: 10 s of zlib on
    # 180 MB of random pixels, for a cache this test never reads again)
    monkeypatch.setattr(np, 'savez_compressed', np.savez)
    train, test = chainer_cifar.get_cifar10(scale=255.)

    cifar = load_cifar10(tmp_path, md5=md5)
    with dask.config.set(scheduler='threads'):
        ours_train = cifar.train_images.compute()
        ours_test = cifar.test_images.compute()
    theirs_x, theirs_t = train._datasets
    np.testing.assert_array_equal(ours_train.astype(np.float32), theirs_x)
    np.testing.assert_array_equal(cifar.train_labels.compute(), theirs_t)
    np.testing.assert_array_equal(ours_test.astype(np.float32),
                                  test._datasets[0])
    np.testing.assert_array_equal(cifar.test_labels.compute(),
                                  test._datasets[1])
