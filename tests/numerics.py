"""Tolerances that follow the arithmetic, not one machine's kernels.

Two kernels (AVX2 and AVX-512, fused and unfused) add the same terms in different orders.
The rounding error of a sum of n terms is bounded by n * eps * (the sum of the terms' sizes),
so an element that cancels towards zero still carries an error on the scale of its terms:
a purely elementwise relative tolerance fails on it by luck of the summation order.
"""

import torch


def assert_close_sums(got: torch.Tensor, want: torch.Tensor, terms: int, msg: str | None = None) -> None:
    """``got`` equals ``want`` up to the rounding of sums of ``terms`` terms in their dtype, the
    terms taken at the scale of ``want``'s largest element."""
    eps = torch.finfo(want.dtype).eps
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=4 * eps, atol=terms * eps * scale + 1e-12, msg=msg)
