"""Bit-level codecs: E2M1 (FP4), E4M3 (FP8), E8M0 (power-of-two scales) and nibble packing.

All encoders round to nearest, ties to even, and saturate to the largest finite value. They round
FP32 values: other dtypes are converted to FP32 first (exact for bf16/fp16; float64 input thus
rounds twice).

- E2M1: 4-bit code ``sign<<3 | index``; magnitudes ``E2M1_GRID[index]`` = 0, .5, 1, 1.5, 2, 3, 4, 6.
  A negative input keeps its sign bit even when it rounds to zero (``-0`` is code 8).
- E4M3 (``torch.float8_e4m3fn``): finite max 448, no infinities; NaN stays NaN.
- E8M0: unsigned byte ``e`` meaning ``2**(e-127)``; 255 is NaN.
"""
from __future__ import annotations

import math

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between grid neighbours; a tie goes to the neighbour with the even index.
_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)   # even index below: round down on a tie
_TIE_UP = (0.75, 1.75, 3.5)          # even index above: round up on a tie


def abs_ignoring_nan(x: torch.Tensor) -> torch.Tensor:
    """FP32 ``|x|`` with NaN as 0 (Inf kept): what an amax over activations reads, as the GPU's
    ``max.f32`` skips NaN."""
    return x.float().abs().nan_to_num(0.0, posinf=math.inf)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """FP32 (any shape) -> uint8 E2M1 codes in the low nibble, same shape. RNE, saturating."""
    a = x.float().abs()
    index = sum((a > t).to(torch.uint8) for t in _TIE_DOWN) + sum((a >= t).to(torch.uint8) for t in _TIE_UP)
    return index | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (low nibble) -> FP32 values, same shape (code 8 is ``-0.0``). One lookup in
    the 16-entry signed table (2x faster on CPU than magnitude lookup + sign select)."""
    table = torch.tensor(E2M1_GRID + tuple(-g for g in E2M1_GRID), dtype=torch.float32, device=code.device)
    return torch.take(table, (code & 15).long())


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., K]`` (K even) -> bytes ``[..., K/2]``: element 2j low nibble, 2j+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of 4-bit values ({codes.shape[-1]})")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., K/2]`` -> uint8 codes ``[..., K]`` (inverse of :func:`pack_nibbles`)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> ``torch.float8_e4m3fn``: RNE, saturating to ±448, NaN kept."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e8m0_from_amax(amax: torch.Tensor, elem_max: float, round_up: bool) -> torch.Tensor:
    """MX shared scale (uint8 E8M0, clamped to [0, 254]) of blocks with max ``|x| = amax`` whose
    elements reach ``elem_max`` (448 for E4M3, 6 for E2M1):

    - ``round_up=False``, the OCP spec: ``e = floor(log2(amax)) - floor(log2(elem_max)) + 127``.
      The block max lands in ``[2**emax, 2**(emax+1))`` and saturates above ``elem_max`` (up to
      12.5 % of an E4M3 max, 25 % of an E2M1 one);
    - ``round_up=True``: ``e = ceil(log2(fl(amax / elem_max))) + 127``, the FP32 quotient rounded up
      to a power of two, as NVIDIA's ``cvt.rp.satfinite.ue8m0x2.f32``, cuBLAS's MX recipe and
      torchao's ``RCEIL``: the block max is never clipped.

    ``amax == 0`` gives the smallest scale (e = 0); NaN gives 255."""
    a = amax.float()
    if round_up:
        descale = (a / torch.full_like(a, elem_max)).double()
        exp = torch.ceil(torch.log2(torch.where(a > 0, descale, torch.ones_like(descale)))) + 127
    else:  # floor(log2(a)) read from the exponent (FP32 log2 rounds a value just below 2**k up to k)
        finite = torch.where((a > 0) & (a < math.inf), a, torch.ones_like(a))
        exp = (torch.frexp(finite).exponent - 1).float() - math.floor(math.log2(elem_max)) + 127
        exp = torch.where(a == math.inf, torch.full_like(exp, 254), exp)
    exp = torch.where(a > 0, exp, torch.zeros_like(exp)).clamp(0, 254)
    return torch.where(torch.isnan(a), torch.full_like(exp, 255), exp).to(torch.uint8)


def e8m0_decode(e: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 -> FP32 ``2**(e-127)``; 255 -> NaN."""
    val = torch.exp2(e.float() - 127)
    return torch.where(e == 255, torch.full_like(val, float("nan")), val)
