import dask.array as da
import numpy as np
import pytest

from dasktrain.data.augment import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    MAX_TTA_VIEWS,
    augment,
    image_hashes,
    normalize,
    tta_views,
)

MEAN = np.array(CIFAR10_MEAN, np.float32).reshape(1, 3, 1, 1)
STD = np.array(CIFAR10_STD, np.float32).reshape(1, 3, 1, 1)


def images(n=50, seed=0):
    return np.random.RandomState(seed).randint(0, 256, (n, 3, 32, 32)) \
        .astype(np.uint8)


def reference(x, seed, epoch, pad, padding, flip=True):
    """Per-image loop, written plainly, from the same per-image draws."""
    out = np.empty(x.shape, np.float32)
    h = image_hashes(seed, epoch, np.arange(len(x)))
    for i, img in enumerate(x):
        dy = int(h[i] % np.uint64(2 * pad + 1))
        dx = int((h[i] >> np.uint64(8)) % np.uint64(2 * pad + 1))
        mode = 'reflect' if padding == 'reflect' else 'constant'
        p = np.pad(img, ((0, 0), (pad, pad), (pad, pad)), mode=mode)
        crop = p[:, dy:dy + 32, dx:dx + 32]
        if flip and (h[i] >> np.uint64(16)) & np.uint64(1):
            crop = crop[:, :, ::-1]
        out[i] = (crop.astype(np.float32) - MEAN[0]) / STD[0]
    return out


@pytest.mark.parametrize('padding', ['zero', 'reflect'])
def test_matches_a_per_image_reference(padding):
    x = images(200)
    got = augment(da.from_array(x, chunks=64), 3, 1,
                  padding=padding).compute()
    np.testing.assert_allclose(got, reference(x, 3, 1, 4, padding),
                               rtol=1e-6, atol=1e-6)


def test_shape_dtype_and_range():
    out = augment(da.from_array(images(), chunks=20), 0, 0, cutout=8)
    assert out.dtype == np.float32 and out.chunks == ((20, 20, 10), (3,),
                                                      (32,), (32,))
    values = out.compute()
    assert values.shape == (50, 3, 32, 32) and values.dtype == np.float32
    lo, hi = (0 - MEAN) / STD, (255 - MEAN) / STD
    assert ((values >= lo - 1e-5) & (values <= hi + 1e-5)).all()


def test_normalisation_statistics():
    rng = np.random.RandomState(1)
    # Half CIFAR-10's spread, so that clipping to 0..255 hardly bites.
    raw = MEAN + 0.5 * STD * rng.randn(4000, 3, 32, 32).astype(np.float32)
    x = np.clip(np.rint(raw), 0, 255).astype(np.uint8)
    out = normalize(x).compute()
    x64 = x.astype(np.float64)
    expect_mean = (x64.mean(axis=(0, 2, 3)) - MEAN.ravel()) / STD.ravel()
    expect_std = x64.std(axis=(0, 2, 3)) / STD.ravel()
    np.testing.assert_allclose(out.mean(axis=(0, 2, 3)), expect_mean,
                               atol=1e-4)
    np.testing.assert_allclose(out.std(axis=(0, 2, 3)), expect_std, rtol=1e-4)
    np.testing.assert_allclose(expect_mean, 0, atol=0.01)
    np.testing.assert_allclose(expect_std, 0.5, atol=0.01)


def test_deterministic_across_chunkings_and_local_schedulers():
    x = images(97)
    results = []
    for chunks in (97, 10, 33, 7):
        for scheduler in ('sync', 'threads', 'processes'):
            results.append(augment(da.from_array(x, chunks=chunks), 5, 2,
                                   cutout=6).compute(scheduler=scheduler))
    for r in results[1:]:
        assert np.array_equal(r, results[0])


def test_deterministic_on_a_distributed_cluster(dask_client):
    x = images(97)
    local = augment(da.from_array(x, chunks=97), 5, 2).compute(
        scheduler='sync')
    # An active client is used by default, and a given one explicitly.
    assert np.array_equal(augment(da.from_array(x, chunks=9), 5, 2)
                          .compute(), local)
    future = dask_client.compute(augment(da.from_array(x, chunks=20), 5, 2))
    assert np.array_equal(future.result(), local)
    assert len(dask_client.scheduler_info()['workers']) == 2


def test_epochs_and_seeds_differ():
    x = da.from_array(images(), chunks=50)
    a = augment(x, 0, 0).compute()
    assert np.array_equal(a, augment(x, 0, 0).compute())
    assert not np.array_equal(a, augment(x, 0, 1).compute())
    assert not np.array_equal(a, augment(x, 1, 0).compute())


def marked(n, y, x):
    img = np.zeros((n, 3, 32, 32), np.uint8)
    img[:, 0, y, x] = 255
    return img


def test_flips_are_real():
    out = augment(marked(64, 10, 5), 0, 0, pad=0)
    out = out.compute()[:, 0]
    peak = out.reshape(64, -1).argmax(axis=1)
    cols = peak % 32
    assert set(cols) == {5, 26}
    assert (peak // 32 == 10).all()
    assert 15 < (cols == 26).sum() < 49


def test_crops_are_real():
    n = 400
    out = augment(marked(n, 16, 16), 0, 0, pad=4, flip=False).compute()[:, 0]
    peak = out.reshape(n, -1).argmax(axis=1)
    dy, dx = peak // 32 - 16, peak % 32 - 16
    assert set(dy) == set(range(-4, 5)) and set(dx) == set(range(-4, 5))
    # The pixel survives, moved, everything else is background.
    hi = (255 - CIFAR10_MEAN[0]) / CIFAR10_STD[0]
    assert np.allclose(out.reshape(n, -1).max(axis=1), hi)
    assert ((out > 0).reshape(n, -1).sum(axis=1) == 1).all()


def test_zero_padding_shifts_in_zero_pixels():
    x = np.full((200, 3, 32, 32), 200, np.uint8)
    out = augment(x, 0, 0, padding='zero', flip=False).compute()
    zero = (0 - MEAN) / STD
    black = np.isclose(out, zero).all(axis=1)  # all channels at pixel 0
    assert black.any() and not black.all()
    # Shifted-in zeros form whole rows or columns at the border.
    assert not black[:, 4:28, 4:28].any()


def test_cutout_blanks_a_square_in_every_channel():
    x = np.full((100, 3, 32, 32), 200, np.uint8)
    out = augment(x, 0, 0, pad=0, flip=False, cutout=8).compute()
    blank = out == 0
    assert (blank[:, 0] == blank[:, 1]).all()
    per_image = blank[:, 0].reshape(100, -1).sum(axis=1)
    assert per_image.max() == 64 and per_image.min() >= 16


@pytest.mark.parametrize('call,message', [
    (lambda: augment(np.zeros((2, 3, 32, 32), np.int64), 0, 0),
     'x must be uint8 or float images, got dtype int64'),
    (lambda: augment(np.zeros((2, 32, 32), np.uint8), 0, 0),
     r'x must have shape \(N, C, H, W\) with C 1 or 3, got \(2, 32, 32\)'),
    (lambda: augment(np.zeros((2, 2, 32, 32), np.uint8), 0, 0),
     r'got \(2, 2, 32, 32\)'),
    (lambda: augment(np.zeros((2, 3, 32, 32), np.uint8), 0, 0, pad=-1),
     'pad must be an int >= 0, got -1'),
    (lambda: augment(np.zeros((2, 3, 32, 32), np.uint8), 0, 0,
                     padding='wrap'), "padding must be 'reflect' or 'zero'"),
    (lambda: augment(np.zeros((2, 3, 32, 32), np.uint8), 0, 0, cutout=-2),
     'cutout must be an int >= 0'),
    (lambda: tta_views(np.zeros((2, 3, 32, 32), np.uint8), 0),
     f'k must be an int in 1..{MAX_TTA_VIEWS}, got 0'),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_tta_views():
    x = images(6)
    views = [v.compute() for v in tta_views(x, MAX_TTA_VIEWS)]
    plain = (x.astype(np.float32) - MEAN) / STD
    np.testing.assert_allclose(views[0], plain, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(views[1], plain[..., ::-1], rtol=1e-6,
                               atol=1e-6)
    # View 2 is shifted by (-2, -2): output pixel (y, x) shows input
    # (y-2, x-2).
    np.testing.assert_allclose(views[2][:, :, 2:, 2:], plain[:, :, :-2, :-2],
                               rtol=1e-6, atol=1e-6)
    assert len({v.tobytes() for v in views}) == MAX_TTA_VIEWS
    again = [v.compute() for v in tta_views(x, 3)]
    assert all(np.array_equal(a, b) for a, b in zip(again, views))
