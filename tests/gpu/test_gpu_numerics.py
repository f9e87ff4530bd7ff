"""How a step computes, on a real GPU: --tf32 rounds float32 products to
TF32 only inside the run (and only where the GPU has TF32), and Chainer's
mixed16 with loss scaling sums float16 gradients on the float16 wire to
the bits of the plain sums. Skipped without a GPU."""
import chainer
import numpy as np
from gpu_marks import needs
from test_parallel import Mirror
from test_precision import batch, mixed16, model, optimizer

from dasktrain.numerics import TF32_CAPABILITY, computing, tf32_allowed
from dasktrain.parallel import GPUDistributedGradient, precision

pytestmark = needs(1)


def _relative_error(a, b, exact):
    import cupy
    with cupy.cuda.Device(0):
        c = cupy.asnumpy(cupy.asarray(a) @ cupy.asarray(b))
    return float(np.abs(c - exact).max() / np.abs(exact).max())


def test_tf32_rounds_float32_products_inside_the_run_only():
    import cupy
    from cupy._core import _routines_linalg as linalg
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((512, 512)).astype(np.float32)
            for _ in range(2))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    before = cupy._core.get_compute_type(np.float32)
    full = _relative_error(a, b, exact)
    with computing(tf32=True, gpus=[0]):
        assert tf32_allowed()
        inside = cupy._core.get_compute_type(np.float32)
        rounded = _relative_error(a, b, exact)
    assert cupy._core.get_compute_type(np.float32) == before
    assert _relative_error(a, b, exact) <= 2 * full  # float32 again
    assert full < 1e-5
    if int(cupy.cuda.Device(0).compute_capability) < TF32_CAPABILITY:
        assert inside != linalg.COMPUTE_TYPE_TF32
        assert rounded <= 2 * full
        return
    # 10-bit mantissas in, float32 sums: ~1e-4 of the largest entry
    assert inside == linalg.COMPUTE_TYPE_TF32
    assert 10 * full < rounded < 1e-2
    # A run without --tf32 computes in float32 where CuPy was told TF32
    # (CUPY_TF32=1), and leaves it told so.
    cupy._core.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32)
    try:
        with computing(tf32=False, gpus=[0]):
            assert cupy._core.get_compute_type(np.float32) == \
                linalg.COMPUTE_TYPE_DEFAULT
            assert _relative_error(a, b, exact) <= 2 * full
        assert cupy._core.get_compute_type(np.float32) == \
            linalg.COMPUTE_TYPE_TF32
    finally:
        cupy._core.set_compute_type(np.float32, before)


def test_mixed16_sums_float16_gradients_on_the_wire_to_the_plain_bits():
    batches = [batch(4, seed) for seed in range(4)]
    runs = []
    for options in ({}, {'comm_dtype': 'float16'},
                    {'comm_dtype': 'float16', 'bucket_mb': 1e-3}):
        wrapped = GPUDistributedGradient(model(), ['@cupy:0'], comm=Mirror(),
                                         **options)
        wrapped.setup(optimizer('momentum'))
        with mixed16:
            for x, t in batches:
                wrapped.step(x, t, total=8)
        assert wrapped.optimizer._loss_scale == 16.0
        runs.append({n: chainer.backends.cuda.to_cpu(precision.value(p))
                     for n, p in sorted(wrapped.master.namedparams())})
        assert wrapped.master.predictor.conv1.W.dtype == np.float16
    for run in runs[1:]:
        for name, value in run.items():
            np.testing.assert_array_equal(value, runs[0][name], name)
    # and the CPU's mixed16 within float16's rounding of other sums
    cpu = GPUDistributedGradient(model(), ['@numpy'], comm=Mirror())
    cpu.setup(optimizer('momentum'))
    with mixed16:
        for x, t in batches:
            cpu.step(x, t, total=8)
    for name, p in sorted(cpu.master.namedparams()):
        np.testing.assert_allclose(runs[0][name], precision.value(p),
                                   rtol=0, atol=2e-2, err_msg=name)
