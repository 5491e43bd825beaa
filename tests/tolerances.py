"""Float tolerances that hold on any CPU kernel set (AVX512, AVX2, the default kernels).

Two float32 computations of the same quantity that sum the same terms in another order (another
kernel set blocks a matmul differently, a chunked pass adds its chunks in another order) agree to
about n x eps32 x (the size of the terms), n the number of terms in the longest sum: each partial
sum rounds once, at most eps32 / 2 of its own magnitude. A bound relative to each entry (rtol)
does not hold there: an entry that is a small difference of large terms carries the error of the
large ones (issue 72: a gradient entry of 0.03 in a tensor whose largest is 9.2 differed by
3.8e-6 under AVX2). So the bound here is relative to the largest magnitude of the expected tensor.
"""

import torch

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7


def float32_error(actual, expected):
    """max |actual - expected| / max |expected| (0 for an all-zero expected tensor), in eps32."""
    scale = expected.abs().max().clamp(min=torch.finfo(expected.dtype).tiny)
    return ((actual - expected).abs().max() / scale).item() / EPS32


def assert_float32_close(actual, expected, terms, what="tensor"):
    """max |actual - expected| <= terms x eps32 x max |expected|: equal up to float32 sums of
    `terms` terms taken in another order (the bound the module docstring derives)."""
    error = float32_error(actual, expected)
    assert error <= terms, f"{what}: off by {error:.1f} eps32 of its largest entry (bound {terms})"
