"""Chainer's convolution and batch normalization arguments as the
dimensions, strides and paddings of a cuDNN graph: pure, no CUDA.

A cuDNN graph names every tensor by its dimensions and element strides,
and a convolution by its pre- and post-paddings, strides and dilations
(cuDNN's backend infers the group count from the image's channels over
the filter's). Chainer's functions say the same things another way:

* ``Convolution2DFunction(stride, pad, cover_all, dilate, groups)`` on
  ``x`` (n, c, h, w) and ``W`` (k, c / groups, kh, kw) gives ``y`` of
  ``get_conv_outsize(h, kh, sy, ph, cover_all, dy)`` rows. ``cover_all``
  adds the last, partial window: a post-padding of ``p + s - 1`` gives
  that size exactly, ``(h + 2p - dk + s - 1) // s + 1``, over the same
  zeros, so cuDNN computes Chainer's ``cover_all`` too.
* ``Deconvolution2DFunction`` is the data gradient of that convolution
  (its ``x`` is the convolution's output, ``W`` as it is, its output the
  convolution's image); its ``outsize`` may be any size whose convolution
  gives back ``x``'s: the post-padding is the one that does.
* ``Convolution2DGradW`` is the filter gradient, of the image and the
  output gradient as they are.

In all three the post-padding is found the same way (:func:`post_padding`):
the one in ``[p, p + s - 1]`` whose convolution maps the image's size onto
the output's. Every tensor here is packed in Chainer's (NCHW) order: the
hooks make an array contiguous before they name its strides.
"""
import dataclasses

#: dtypes a cuDNN graph takes for a convolution or a batch normalization
#: here (Chainer's float16 (mixed16 activations), float32, float64)
DTYPES = ('float16', 'float32', 'float64')


def extent(k, d):
    """A kernel of ``k`` taps dilated by ``d`` spans ``k + (k - 1)(d - 1)``
    pixels."""
    return k + (k - 1) * (d - 1)


def conv_outsize(size, k, s, pre, post, d=1):
    """Rows of a convolution of ``size`` rows padded ``pre`` before and
    ``post`` after (Chainer's ``get_conv_outsize`` is the case ``pre ==
    post == p``, or ``post == p + s - 1`` with ``cover_all``).

    >>> conv_outsize(32, 3, 1, 1, 1), conv_outsize(32, 3, 2, 1, 1)
    (32, 16)
    >>> conv_outsize(5, 2, 2, 0, 0), conv_outsize(5, 2, 2, 0, 1)
    (2, 3)
    """
    return (size + pre + post - extent(k, d)) // s + 1


def post_padding(size, out, k, s, p, d=1):
    """The post-padding in ``[p, p + s - 1]`` that maps ``size`` rows onto
    ``out`` (pre-padding ``p``), or None where none does.

    >>> post_padding(32, 32, 3, 1, 1)            # a plain 3x3
    1
    >>> post_padding(5, 3, 2, 2, 0)              # cover_all's last window
    1
    >>> post_padding(5, 4, 2, 2, 0) is None      # no padding gives 4
    True
    """
    for q in range(p, p + s):
        if conv_outsize(size, k, s, p, q, d) == out:
            return q
    return None


def packed_strides(dims):
    """Element strides of a C-contiguous array of ``dims``.

    >>> packed_strides((2, 3, 4, 5))
    (60, 20, 5, 1)
    """
    strides, step = [], 1
    for n in reversed(dims):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """One convolution as cuDNN names it: ``image`` (n, c, h, w),
    ``filter`` (k, c / groups, kh, kw) and ``output`` (n, k, oh, ow), all
    packed NCHW; paddings, strides and dilations as (rows, columns)."""
    image: tuple
    filter: tuple
    output: tuple
    pre_padding: tuple
    post_padding: tuple
    stride: tuple
    dilation: tuple

    @property
    def groups(self):
        return self.image[1] // self.filter[1]


def _pair(v):
    return tuple(v) if hasattr(v, '__getitem__') else (v, v)


def _geometry(image, filt, output, stride, pad, dilate):
    """The geometry of ``image`` * ``filt`` -> ``output``, or a reason
    (str) why cuDNN cannot be told it."""
    n, c, h, w = image
    k, cg, kh, kw = filt
    if cg < 1 or c % cg or k % (c // cg):
        return (f'channels {c} are not a multiple of the filter\'s {cg} '
                f'with {k} outputs')
    if output[:2] != (n, k):
        return f'output {output} does not fit image {image}, filter {filt}'
    posts = []
    for size, out, kk, s, p, d in zip((h, w), output[2:], (kh, kw), stride,
                                      pad, dilate):
        if min(kk, s, d) < 1 or p < 0:
            return f'kernel {kk}, stride {s}, dilation {d}, pad {p}'
        q = post_padding(size, out, kk, s, p, d)
        if q is None:
            return (f'{size} rows padded {p} do not convolve to {out} '
                    f'(kernel {kk}, stride {s}, dilation {d})')
        posts.append(q)
    return ConvGeometry(tuple(image), tuple(filt), tuple(output),
                        tuple(pad), tuple(posts), tuple(stride),
                        tuple(dilate))


def forward(x_shape, w_shape, stride=1, pad=0, cover_all=False, dilate=1):
    """``Convolution2DFunction``'s forward as a cuDNN convolution, or the
    reason it cannot be one.

    >>> g = forward((8, 3, 32, 32), (16, 3, 3, 3), 1, 1)
    >>> g.output, g.pre_padding, g.post_padding
    ((8, 16, 32, 32), (1, 1), (1, 1))
    >>> forward((1, 1, 5, 5), (1, 1, 2, 2), 2, 0, cover_all=True).output
    (1, 1, 3, 3)
    """
    stride, pad, dilate = _pair(stride), _pair(pad), _pair(dilate)
    n, _, h, w = x_shape
    k, _, kh, kw = w_shape
    out = []
    for size, kk, s, p, d in zip((h, w), (kh, kw), stride, pad, dilate):
        q = p + s - 1 if cover_all else p
        out.append(conv_outsize(size, kk, s, p, q, d))
    if min(out) <= 0:
        return f'the output would have {out[0]} x {out[1]} pixels'
    return _geometry(tuple(x_shape), tuple(w_shape), (n, k, *out), stride,
                     pad, dilate)


def data_gradient(gy_shape, w_shape, x_size, groups=1, stride=1, pad=0,
                  dilate=1):
    """The convolution whose data gradient maps ``gy_shape`` onto an image
    of ``x_size`` (h, w) with ``W`` of ``w_shape`` (in, out / groups, kh,
    kw): ``Deconvolution2DFunction``'s forward (its input is ``gy``, its
    ``outsize`` the image's), or the reason it cannot be one.

    >>> data_gradient((8, 16, 16, 16), (16, 8, 3, 3), (32, 32), 1, 2,
    ...               1).image
    (8, 8, 32, 32)
    >>> data_gradient((2, 8, 4, 4), (8, 2, 3, 3), (4, 4), 4, 1, 1).image
    (2, 8, 4, 4)
    """
    stride, pad, dilate = _pair(stride), _pair(pad), _pair(dilate)
    n, k, _, _ = gy_shape
    if w_shape[0] != k:
        return f'W has {w_shape[0]} input channels, gy has {k}'
    if groups < 1 or k % groups:
        return f'{k} channels do not split into {groups} groups'
    image = (n, w_shape[1] * groups, *x_size)
    return _geometry(image, tuple(w_shape), tuple(gy_shape), stride, pad,
                     dilate)


def filter_gradient(x_shape, gy_shape, w_shape, stride=1, pad=0, dilate=1):
    """``Convolution2DGradW``'s forward: the filter gradient of the
    convolution of ``x_shape`` onto ``gy_shape`` (any ``cover_all`` is in
    the sizes), or the reason it cannot be one.

    >>> filter_gradient((8, 3, 32, 32), (8, 16, 32, 32), (16, 3, 3, 3), 1,
    ...                 1).post_padding
    (1, 1)
    """
    stride, pad, dilate = _pair(stride), _pair(pad), _pair(dilate)
    return _geometry(tuple(x_shape), tuple(w_shape), tuple(gy_shape), stride,
                     pad, dilate)


def batchnorm_view(x_shape, gamma_ndim, axis):
    """The (n, c, r) view of ``x`` that a per-channel batch normalization
    reduces over axes 0 and 2 (``r``: the pixels per image and channel),
    or the reason there is none: ``gamma`` one-dimensional, on axis 1,
    and every other axis reduced (Chainer's default axis).

    >>> batchnorm_view((8, 16, 32, 32), 1, (0, 2, 3))
    (8, 16, 1024)
    >>> batchnorm_view((8, 100), 1, (0,))
    (8, 100, 1)
    >>> batchnorm_view((8, 16, 32, 32), 1, (0, 2))
    'axis (0, 2) is not every axis but the channels'
    """
    ndim = len(x_shape)
    if gamma_ndim != 1 or ndim < 2:
        return f'gamma of {gamma_ndim} dimensions on x of {ndim}'
    if tuple(axis) != (0, *range(2, ndim)):
        return f'axis {tuple(axis)} is not every axis but the channels'
    r = 1
    for n in x_shape[2:]:
        r *= n
    return (x_shape[0], x_shape[1], r)
