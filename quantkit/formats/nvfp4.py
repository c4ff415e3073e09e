"""NVFP4: E2M1 values, one E4M3 scale per 16 contiguous K elements, one FP32 tensor scale.

Numerics (given the tensor scale, bit-identical to torchao's ``nvfp4_quantize``):

- tensor scale ``s_g = fl(1/g)`` with ``g = fl(fl(1/amax)·2688)`` (FP32, multiply convention).
  ``g`` is what ``2688 / amax`` computes in PyTorch and in llm-compressor; compressed-tensors and
  vLLM keep it as ``weight_global_scale``, so
  ``s_g`` is defined from it: a checkpoint stores ``g`` exactly and ``1/g`` reloads to the same
  ``s_g``. (torchao's ``amax/2688`` differs from this by at most one FP32 ulp, for ~16 % of amax
  values.) An all-zero tensor uses ``amax = 1``;
- block scale ``s_b = e4m3(clamp((block_amax / 6) / s_g, 2**-6, 448))``: never zero or subnormal,
  so an all-zero block gets ``s_b = 2**-6`` and quantizes to zeros;
- values ``q = e2m1(clamp(x · ((1/s_g) / s_b), ±6))``, RNE;
- dequantized ``x̂ = (e2m1(q) · s_b) · s_g``: the first product is exact, so this is the
  correctly rounded FP32 value of the exact product.

NaN/Inf in weights are rejected by :func:`quantkit.formats.check_weight`; in activations they
propagate to the block's outputs.
"""
from __future__ import annotations

import torch

from quantkit.formats.base import QuantizedWeight
from quantkit.formats.codecs import E2M1_MAX, E4M3_MAX, e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles

BLOCK = 16
_E4M3_TINY = torch.finfo(torch.float8_e4m3fn).tiny  # 2**-6


def tensor_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """FP32 per-tensor scale ``1 / (2688 / amax)`` (module docstring); amax 0 is treated as amax 1."""
    amax = amax.float()
    return 1.0 / ((E2M1_MAX * E4M3_MAX) / torch.where(amax > 0, amax, torch.ones_like(amax)))


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the last dim divisible by {BLOCK}, got {x.shape[-1]}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def block_scales(x: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales ``[..., K/16]`` for ``x [..., K]`` under FP32 ``tensor_scale``."""
    block_amax = _blocks(x).abs().amax(-1)  # true divisions: a scalar divisor is a reciprocal multiply on CUDA
    return ((block_amax / torch.full_like(block_amax, E2M1_MAX)) / tensor_scale).clamp(_E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_values(x: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (unpacked, uint8 ``[..., K]``) of ``x`` under block ``scale`` and ``tensor_scale``."""
    reciprocal = (1.0 / tensor_scale) / scale.float()
    scaled = (_blocks(x) * reciprocal.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    return e2m1_encode(scaled.reshape(x.shape))


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """FP32 ``[..., K]`` from unpacked codes, E4M3 block scales and the FP32 tensor scale."""
    vals = e2m1_decode(codes)
    vals = vals.reshape(*vals.shape[:-1], -1, BLOCK) * scale.float().unsqueeze(-1)  # exact
    return vals.reshape(codes.shape) * tensor_scale  # one rounding


class NVFP4Weight:
    """Weights ``[N, K]``: packed uint8 ``[N, K/2]``, E4M3 scales ``[N, K/16]``, FP32 tensor scale."""

    block = (1, BLOCK)

    def compute_scales(self, w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ts = tensor_scale_from_amax(w.float().abs().amax() if amax is None else amax)
        return block_scales(w, ts), ts

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
        return pack_nibbles(quantize_values(w, scale, tensor_scale))

    def dequantize(self, qw: QuantizedWeight) -> torch.Tensor:
        return dequantize_codes(unpack_nibbles(qw.data), qw.scale, qw.tensor_scale)

    def storage(self, n: int, k: int):
        return ((n, k // 2), torch.uint8), ((n, k // BLOCK), torch.float8_e4m3fn), True


class NVFP4Activation:
    """Activations: dynamic E4M3 block scales per 16, FP32 tensor scale static (calibrated
    ``input_scale = amax/(6·448)``) or, uncalibrated, from the current tensor's amax."""

    block = BLOCK
    static = True

    def input_scale_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        return tensor_scale_from_amax(amax)

    def qdq(self, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
        ts = tensor_scale_from_amax(x.float().abs().amax()) if input_scale is None else input_scale.float()
        scale = block_scales(x, ts)
        return dequantize_codes(quantize_values(x, scale, ts), scale, ts)
