"""OCP Microscaling: MXFP8 (E4M3) and MXFP4 (E2M1) values, one E8M0 scale per 32 K elements.

Scale ``X``, stored as the E8M0 byte ``e`` with ``X = 2**(e-127)``
(:func:`quantkit.formats.codecs.e8m0_from_amax`); an all-zero block gets ``e = 0``:

- MXFP8: ``X = 2**ceil(log2(block_amax / 448))`` (the division in FP32), NVIDIA's rounded-up rule
  (``cvt.rp.satfinite.ue8m0x2.f32``; torchao's ``ScaleCalculationMode.RCEIL``, bit for bit): no
  block max is clipped, and a larger scale costs an E4M3 grid no relative precision. The OCP
  spec's ``2**(floor(log2(block_amax)) - 8)`` saturates the maxima above 448 of about a fifth of
  the blocks (Gemma-3-270M MXFP8: WikiText-2 ppl 27.99 → 27.42 with round to nearest).
- MXFP4: the OCP rule ``X = 2**(floor(log2(block_amax)) - 2)`` (torchao's ``FLOOR``, bit for bit):
  rounding up would clip nothing but doubles the step of the 31 other values of a 3-bit grid in
  ~60 % of the blocks, which costs more (Gemma-3-270M MXFP4 RTN: ppl 73.7 → 89.4).

Values are ``elem(x / X)`` rounded to nearest even and saturated. The stored bytes mean the same
under either rule. MXFP4 values are packed two per byte like NVFP4.
"""
from __future__ import annotations

import torch

from quantkit.formats.base import QuantizedWeight
from quantkit.formats.codecs import (
    E2M1_MAX,
    E4M3_MAX,
    e2m1_decode,
    e2m1_encode,
    e4m3_encode,
    e8m0_decode,
    e8m0_from_amax,
    pack_nibbles,
    unpack_nibbles,
)

BLOCK = 32


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % BLOCK:
        raise ValueError(f"MX formats need the last dim divisible by {BLOCK}, got {x.shape[-1]}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


class MXElement:
    """One MX element type: E4M3 (``bits=8``) or E2M1 (``bits=4``)."""

    def __init__(self, bits: int):
        self.bits = bits
        self.max = E4M3_MAX if bits == 8 else E2M1_MAX
        self.round_up = bits == 8  # the scale rule: module docstring

    def scales(self, x: torch.Tensor) -> torch.Tensor:
        """E8M0 bytes ``[..., K/32]`` for ``x [..., K]``."""
        return e8m0_from_amax(_blocks(x).abs().amax(-1), self.max, self.round_up)

    def encode(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Values of ``x`` under E8M0 ``scale``: FP8 ``[..., K]`` or packed uint8 ``[..., K/2]``."""
        scaled = (_blocks(x) / e8m0_decode(scale).unsqueeze(-1)).reshape(x.shape)
        return e4m3_encode(scaled) if self.bits == 8 else pack_nibbles(e2m1_encode(scaled.clamp(-E2M1_MAX, E2M1_MAX)))

    def decode(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """FP32 ``[..., K]`` from values and E8M0 scales."""
        vals = data.float() if self.bits == 8 else e2m1_decode(unpack_nibbles(data))
        return (_blocks(vals) * e8m0_decode(scale).unsqueeze(-1)).reshape(vals.shape)


class MXWeight:
    """MX weights ``[N, K]`` with E8M0 scales ``[N, K/32]`` (uint8)."""

    block = (1, BLOCK)

    def __init__(self, bits: int):
        self.elem = MXElement(bits)

    def compute_scales(self, w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return self.elem.scales(w), None

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
        return self.elem.encode(w, scale)

    def dequantize(self, qw: QuantizedWeight) -> torch.Tensor:
        return self.elem.decode(qw.data, qw.scale)

    def storage(self, n: int, k: int):
        data = ((n, k), torch.float8_e4m3fn) if self.elem.bits == 8 else ((n, k // 2), torch.uint8)
        return data, ((n, k // BLOCK), torch.uint8), False


class MXActivation:
    """Dynamic MX activations: E8M0 scale per 32 computed on the fly."""

    block = BLOCK
    static = False

    def __init__(self, bits: int):
        self.elem = MXElement(bits)

    def input_scale_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        raise TypeError("MX activations are dynamic: they take no calibrated input scale")

    def qdq(self, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
        scale = self.elem.scales(x)
        return self.elem.decode(self.elem.encode(x, scale), scale)
