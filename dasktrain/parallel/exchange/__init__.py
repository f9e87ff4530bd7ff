"""How dg's gradients travel between the processes of one job: gradient
buckets in, sums out (``gradients``: :class:`GradientExchange`), overlapped
with the backward pass (``backprop`` reports each gradient once final),
in a fixed bucket order (``buckets``), through persistent flat buffers
(``flat``; on a GPU filled by fused kernels, ``fused``), in float16 on the
wire where asked (``wire``). The communicators that carry the buckets are
``parallel.comm``'s.
"""
