"""How dg would scale to many GPUs: a cost model, not a measurement.

A dg step on N GPUs takes the compute of one GPU's share plus whatever of
the gradient all-reduce is not hidden behind the backward pass. A ring
all-reduce of B bytes over N GPUs sends 2 (N - 1) / N * B bytes per GPU in
2 (N - 1) steps, each paying the link's latency:

    t_allreduce(N) = 2 (N - 1) * latency + 2 (N - 1) / N * B / bandwidth

Without overlap all of it is exposed; with overlap (gradient buckets
all-reduced while back-propagation continues) up to ``hidden`` of the
step's compute covers it. Scaling efficiency is compute / (compute +
exposed). :func:`fit_link` fits latency and bandwidth to all-reduces
measured at two sizes (``bench allreduce``); :data:`LINKS` holds nominal
figures for the links a lab names. ChainerMN's published figure, for
comparison: 96 % scaling efficiency from 8 to 32 GPUs (its documentation,
cited in the lab's notes).
"""

# Nominal one-direction bandwidth (bytes/s) and per-message latency (s).
LINKS = {
    'NVLink (A100, 300 GB/s)': (300e9, 5e-6),
    'PCIe 4.0 x16': (25e9, 10e-6),
    '100 GbE': (12.5e9, 30e-6),
    '25 GbE': (3.1e9, 30e-6),
    '10 GbE': (1.25e9, 50e-6),
}
CHAINERMN_32_GPUS = 0.96  # ChainerMN: efficiency of 32 GPUs vs 8


def allreduce_time(nbytes, gpus, bandwidth, latency):
    """Seconds of a ring all-reduce of ``nbytes`` over ``gpus``."""
    if gpus < 2:
        return 0.0
    return 2 * (gpus - 1) * latency + \
        2 * (gpus - 1) / gpus * nbytes / bandwidth


def efficiency(compute, nbytes, gpus, bandwidth, latency, hidden=0.0):
    """Predicted scaling efficiency of dg on ``gpus``: ``compute`` seconds
    per step on one GPU; ``hidden`` the share of it that communication can
    overlap (0: none; 2/3 is the backward pass's usual share)."""
    comm = allreduce_time(nbytes, gpus, bandwidth, latency)
    exposed = max(0.0, comm - hidden * compute)
    return compute / (compute + exposed)


def fit_link(small, large):
    """(bandwidth, latency) of a 2-rank all-reduce measured at two sizes:
    ``small`` and ``large`` are (bytes, seconds); for N = 2 the model is
    2 latency + bytes / bandwidth."""
    (b1, t1), (b2, t2) = small, large
    bandwidth = (b2 - b1) / max(t2 - t1, 1e-12)
    latency = max(0.0, (t1 - b1 / bandwidth) / 2)
    return bandwidth, latency


def predict(compute, nbytes, gpus=(2, 4, 8, 16, 32, 64), links=None,
            hidden=2 / 3):
    """Rows (link, GPUs, efficiency without and with overlap)."""
    rows = []
    for name, (bandwidth, latency) in (links or LINKS).items():
        for n in gpus:
            rows.append((name, n,
                         efficiency(compute, nbytes, n, bandwidth, latency),
                         efficiency(compute, nbytes, n, bandwidth, latency,
                                    hidden)))
    return rows
