"""Float64 reference numerics shared by the tests, independent of :mod:`quantkit.formats`."""
import torch

# Non-negative E4M3 values in increasing order; the index parity is the mantissa parity.
E4M3_GRID = torch.tensor([2.0 ** -9 * m for m in range(8)]
                         + [2.0 ** (e - 7) * (1 + m / 8) for e in range(1, 16) for m in range(8)][:-1], dtype=torch.float64)


def e4m3_round_f64(v: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value of float64 ``v`` (ties to even mantissa), saturating at 448."""
    a = v.abs().clamp(max=448.0)
    idx = torch.searchsorted(E4M3_GRID, a).clamp(1, len(E4M3_GRID) - 1)
    lo, hi = E4M3_GRID[idx - 1], E4M3_GRID[idx]
    take_hi = ((hi - a) < (a - lo)) | (((hi - a) == (a - lo)) & (idx % 2 == 0))
    return torch.where(take_hi, hi, lo) * torch.where(v < 0, -1.0, 1.0).double()
