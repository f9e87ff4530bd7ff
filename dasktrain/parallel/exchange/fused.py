"""A float16 gradient bucket filled in one pass on a GPU.

:meth:`~dasktrain.parallel.exchange.flat.FlatBuckets.fill` writes each gradient
of a bucket into the bucket's float16 buffer times its power of two, and each
one's largest magnitude into the bucket's probe. Array by array that is
about six kernels per gradient (a multiply, a max, a min, a negation,
their maximum, a scaling), launched from the communication thread: for
ResNet-50's 161 gradients some 1,000 launches a step. Here two kernels do
a whole bucket:

1. one block per *chunk* of :data:`CHUNK` elements of one gradient (the
   chunk table, :func:`chunks`, is fixed by the bucket's sizes): each
   element times its scale, rounded once to float16 (the PTX conversion
   ``cvt.rn.f16.f32``, round to nearest even, as CuPy's casts), into its
   place in the buffer; the chunk's largest magnitude (NaN kept) into a
   partial;
2. one thread per gradient: the largest of its chunks' partials times its
   probe factor, raised to :data:`~dasktrain.parallel.exchange.wire.TINY` where
   not zero (NaN kept), rounded to float16, into its probe.

The same bits as the array-by-array path (a GPU test compares them), for
float32 gradients; others take that path. Per step only the gradients'
addresses, scales and factors travel to the GPU, in one copy on the
stream the kernels run on.
"""
import numpy as np

from dasktrain.parallel.exchange.wire import TINY

#: Elements per block of the first kernel: 16 per thread of 256.
CHUNK = 4096
THREADS = 256

_SOURCE = r'''
__device__ __forceinline__ unsigned short to_half(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// The larger of two magnitudes, NaN winning (max(NaN, x) is NaN).
__device__ __forceinline__ float larger(float a, float b) {
    return (a != a || a > b) ? a : b;
}

extern "C" __global__ void fill_chunks(
        const long long* table,   // [3 * n]: pointer, size, offset
        const double* scales,     // [n]
        const long long* chunk_of, const long long* chunk_at,
        unsigned short* out, float* partial) {
    __shared__ float best[@THREADS@];
    const long long b = blockIdx.x;
    const long long i = chunk_of[b];
    const float* g = (const float*) table[3 * i];
    const long long size = table[3 * i + 1];
    unsigned short* o = out + table[3 * i + 2];
    const float s = (float) scales[i];
    long long end = chunk_at[b] + @CHUNK@;
    if (end > size) end = size;
    float m = 0.0f;
    for (long long j = chunk_at[b] + threadIdx.x; j < end;
         j += blockDim.x) {
        const float x = g[j];
        o[j] = to_half(x * s);
        m = larger(fabsf(x), m);
    }
    best[threadIdx.x] = m;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half)
            best[threadIdx.x] = larger(best[threadIdx.x],
                                       best[threadIdx.x + half]);
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[b] = best[0];
}

extern "C" __global__ void fill_probes(
        const long long* first,   // [n + 1]: each array's first chunk
        const double* factors, const float* partial, int n,
        unsigned short* probes) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float m = 0.0f;
    for (long long c = first[i]; c < first[i + 1]; ++c)
        m = larger(partial[c], m);
    const float top = m * (float) factors[i];
    const float tiny = @TINY@;
    // where(top == 0, 0, maximum(top, TINY)), NaN kept
    probes[i] = to_half(top == 0.0f ? 0.0f
                        : (top != top || top > tiny) ? top : tiny);
}
''' \
    .replace('@THREADS@', str(THREADS)).replace('@CHUNK@', str(CHUNK)) \
    .replace('@TINY@', repr(float(TINY)))


def chunks(sizes, chunk=CHUNK):
    """The chunk table of arrays of ``sizes`` elements: for each block of
    the first kernel, its array and first element; and each array's first
    block (one past the last at the end). An empty array has no chunk.

    Examples
    --------
    >>> of, at, first = chunks([5, 0, 9], chunk=4)
    >>> of.tolist(), at.tolist(), first.tolist()
    ([0, 0, 2, 2, 2], [0, 4, 0, 4, 8], [0, 2, 2, 5])
    """
    counts = [-(-int(n) // chunk) for n in sizes]
    of = np.repeat(np.arange(len(sizes), dtype=np.int64), counts)
    at = np.concatenate([np.arange(c, dtype=np.int64) * chunk
                         for c in counts]) if counts else \
        np.zeros(0, np.int64)
    first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return of, at.astype(np.int64), first


def fusable(grads):
    """Whether the two kernels can fill ``grads``: CuPy float32 arrays,
    C-contiguous (their elements in order from their address)."""
    return bool(grads) and all(
        not isinstance(g, np.ndarray) and g.dtype == np.float32 and
        g.flags.c_contiguous for g in grads)


class FusedFill:
    """The kernels and fixed tables of one bucket: ``sizes`` and
    ``offsets`` (each gradient's element count and place in the bucket's
    float16 buffer); made once per bucket plan, on the bucket's device,
    then :meth:`__call__` every step on the current stream.

    Per call, the gradients' addresses, scales and factors go to the GPU
    in one asynchronous copy from pinned memory, on the stream the
    kernels run on (a copy from pageable memory would first wait for that
    stream); that memory is written again only after the copy is done
    (an event of it)."""

    _module = None

    def __init__(self, sizes, offsets):
        import cupy
        import cupyx
        if FusedFill._module is None:
            FusedFill._module = cupy.RawModule(code=_SOURCE)
        self.n = n = len(sizes)
        of, at, first = chunks(sizes)
        self.blocks = len(of)
        self._of, self._at = cupy.asarray(of), cupy.asarray(at)
        self._first = cupy.asarray(first)
        # pointer, size, offset per array; then scales and factors (the
        # float64 bits of the same buffer)
        self._host = cupyx.empty_pinned(5 * n, np.int64)
        self._host[1:3 * n:3] = sizes
        self._host[2:3 * n:3] = offsets
        self._numbers = self._host.view(np.float64)
        self._device = cupy.empty(5 * n, np.int64)
        self._copied = None
        self._partial = cupy.empty(max(1, self.blocks), np.float32)

    def __call__(self, grads, scales, out, factors=None, probes=None):
        """Fill ``out`` (a uint16 view of the float16 buffer) from
        ``grads`` times ``scales`` (a float each); with ``factors`` and
        ``probes`` (the probes' uint16 view) the probes too."""
        import cupy
        n, module = self.n, FusedFill._module
        if self._copied is not None:
            self._copied.synchronize()  # the last copy read the memory
        self._host[0:3 * n:3] = [g.data.ptr for g in grads]
        self._numbers[3 * n:4 * n] = scales
        self._numbers[4 * n:] = factors if factors is not None else 0.0
        stream = cupy.cuda.get_current_stream()
        self._device.set(self._host, stream=stream)
        numbers = self._device.view(np.float64)
        if self.blocks:
            module.get_function('fill_chunks')(
                (self.blocks,), (THREADS,),
                (self._device, numbers[3 * n:4 * n], self._of, self._at,
                 out, self._partial))
        if probes is not None:
            module.get_function('fill_probes')(
                (-(-n // THREADS),), (THREADS,),
                (self._first, numbers[4 * n:], self._partial,
                 np.int32(n), probes))
        # After the kernels too: they read the table and write _partial,
        # which the next call (maybe on another stream) overwrites.
        self._copied = cupy.cuda.Event(disable_timing=True)
        self._copied.record(stream)
