"""NVFP4: E2M1 values, one E4M3 scale per 16 contiguous K elements, one FP32 tensor scale.

Numerics (given the tensor scale, bit-identical to torchao's ``nvfp4_quantize``):

- tensor scale ``s_g = fl(1/g)`` with ``g = fl(fl(1/amax)·2688)`` (FP32, multiply convention).
  ``g`` is what ``2688 / amax`` computes in PyTorch and in llm-compressor; compressed-tensors and
  vLLM keep it as ``weight_global_scale``, so
  ``s_g`` is defined from it: a checkpoint stores ``g`` exactly and ``1/g`` reloads to the same
  ``s_g``. (torchao's ``amax/2688`` differs from this by at most one FP32 ulp, for ~16 % of amax
  values.) An all-zero tensor uses ``amax = 1``;
- block scale ``s_b = e4m3(clamp((block_amax / 6) / s_g, 2**-6, 448))``: never zero or subnormal,
  so an all-zero block gets ``s_b = 2**-6`` and quantizes to zeros. Under the *Four Over Six*
  rule (Cook et al. 2025, arXiv 2512.02010; format ``nvfp4-4over6``) each block also tries the
  scale mapping its max to 4, ``e4m3(clamp((block_amax / 4) / s_g, ...))``, and keeps it when the
  block's FP32 squared reconstruction error ``Σ (x̂ − x)²`` is strictly lower (a tie keeps the
  6-scale). E2M1 has no value between 4 and 6, so under the 6-scale a value just below the
  max loses up to a fifth of itself; the stored bits are ordinary NVFP4;
- values ``q = e2m1(clamp(x · ((1/s_g) / s_b), ±6))``, RNE;
- dequantized ``x̂ = (e2m1(q) · s_b) · s_g``: the first product is exact, so this is the
  correctly rounded FP32 value of the exact product.

NaN/Inf in weights are rejected by :func:`quantkit.formats.check_weight`. In activations they are
never clipped silently. E2M1 has no NaN, so a NaN makes its block's scale NaN and the block
dequantizes to NaN; a tensor scale computed from the same tensor (no calibrated ``input_scale``)
ignores NaN, as the GPU's ``max.f32`` does, so the other blocks quantize as without it. An Inf
there makes the tensor scale degenerate and the whole tensor dequantizes to NaN. Under a
calibrated tensor scale an Inf saturates to its block's largest value, as out-of-range values do.
"""
from __future__ import annotations

import torch

from quantkit.formats.base import QuantizedWeight
from quantkit.formats.codecs import (E2M1_MAX, E4M3_MAX, abs_ignoring_nan, e2m1_decode, e2m1_encode, pack_nibbles,
                                    unpack_nibbles)

BLOCK = 16
_E4M3_TINY = torch.finfo(torch.float8_e4m3fn).tiny  # 2**-6
_AMAX_FLOOR = 2.0 ** -116  # tensor amax floor: 2688 / amax stays finite (2688 · 2**116 < 2**128)
_E2M1_SECOND = 4.0  # the largest E2M1 magnitude below E2M1_MAX: the other block-max target of Four Over Six


def tensor_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """FP32 per-tensor scale ``1 / (2688 / amax)`` (module docstring); amax 0 is treated as amax 1,
    amax below ``2**-116`` as ``2**-116`` (else ``2688 / amax`` overflows and the scale is 0); NaN
    gives NaN."""
    amax = amax.float()
    amax = torch.where(amax == 0, torch.ones_like(amax), amax).clamp(min=_AMAX_FLOOR)
    return 1.0 / ((E2M1_MAX * E4M3_MAX) / amax)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the last dim divisible by {BLOCK}, got {x.shape[-1]}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _scale_mapping_max_to(block_amax: torch.Tensor, top: float, tensor_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 scales mapping each ``block_amax`` to ``top`` under ``tensor_scale`` (clamped to [2**-6, 448])."""
    # true divisions: a scalar divisor is a reciprocal multiply on CUDA
    return ((block_amax / torch.full_like(block_amax, top)) / tensor_scale).clamp(_E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn)


def block_scales(x: torch.Tensor, tensor_scale: torch.Tensor, four_over_six: bool = False) -> torch.Tensor:
    """E4M3 block scales ``[..., K/16]`` for ``x [..., K]`` under FP32 ``tensor_scale``: each block's
    max maps to 6, or (``four_over_six``) to 4 or 6, whichever reconstructs the block with the
    lower squared error (module docstring)."""
    if four_over_six:
        return quantize_blocks(x, tensor_scale, True)[1]
    return _scale_mapping_max_to(_blocks(x).abs().amax(-1), E2M1_MAX, tensor_scale)


def quantize_blocks(x: torch.Tensor, tensor_scale: torch.Tensor, four_over_six: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of ``x [..., K]``: unpacked E2M1 codes uint8 ``[..., K]`` under the block
    scales of :func:`block_scales` (E4M3 ``[..., K/16]``); the 4-or-6 rule keeps the codes it
    compared instead of quantizing again."""
    block_amax = _blocks(x).abs().amax(-1)
    scale = _scale_mapping_max_to(block_amax, E2M1_MAX, tensor_scale)
    codes = quantize_values(x, scale, tensor_scale)
    if four_over_six:
        four = _scale_mapping_max_to(block_amax, _E2M1_SECOND, tensor_scale)
        codes4 = quantize_values(x, four, tensor_scale)
        better = _block_squared_error(x, codes4, four, tensor_scale) < _block_squared_error(x, codes, scale, tensor_scale)
        scale = torch.where(better, four.view(torch.uint8), scale.view(torch.uint8)).view(torch.float8_e4m3fn)
        codes = torch.where(better.repeat_interleave(BLOCK, -1), codes4, codes)
    return codes, scale


def _block_squared_error(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                         tensor_scale: torch.Tensor) -> torch.Tensor:
    """FP32 ``[..., K/16]``: ``Σ (x̂ − x)²`` per block of ``x [..., K]``, ``x̂`` decoded from ``codes``."""
    return (_blocks(dequantize_codes(codes, scale, tensor_scale)) - _blocks(x)).pow(2).sum(-1)


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
    """Weights ``[N, K]``: packed uint8 ``[N, K/2]``, E4M3 scales ``[N, K/16]``, FP32 tensor scale;
    round-to-nearest block scales by the 6 or (``four_over_six``) the 4-or-6 rule."""

    block = (1, BLOCK)

    def __init__(self, four_over_six: bool = False):
        self.four_over_six = four_over_six

    def compute_scales(self, w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ts = tensor_scale_from_amax(w.float().abs().amax() if amax is None else amax)
        return block_scales(w, ts, self.four_over_six), ts

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
        return pack_nibbles(quantize_values(w, scale, tensor_scale))

    def dequantize(self, qw: QuantizedWeight) -> torch.Tensor:
        return dequantize_codes(unpack_nibbles(qw.data), qw.scale, qw.tensor_scale)

    def storage(self, n: int, k: int):
        return ((n, k // 2), torch.uint8), ((n, k // BLOCK), torch.float8_e4m3fn), True


class NVFP4Activation:
    """Activations: dynamic E4M3 block scales per 16 (the 6 or, ``four_over_six``, the 4-or-6
    rule), FP32 tensor scale static (calibrated ``input_scale = amax/(6·448)``) or, uncalibrated,
    from the current tensor's amax."""

    block = BLOCK
    static = True

    def __init__(self, four_over_six: bool = False):
        self.four_over_six = four_over_six

    def input_scale_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        return tensor_scale_from_amax(amax)

    def quantize(self, x: torch.Tensor, input_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes, scale, tensor_scale)`` of ``x [..., K]``: unpacked E2M1 codes uint8 ``[..., K]``,
        E4M3 block scales ``[..., K/16]`` and the FP32 tensor scale (``input_scale`` if given)."""
        if input_scale is None:  # the amax ignores NaN (module docstring)
            ts = tensor_scale_from_amax(abs_ignoring_nan(x).amax())
        else:
            ts = input_scale.float()
        codes, scale = quantize_blocks(x, ts, self.four_over_six)
        return codes, scale, ts

    def qdq(self, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
        return dequantize_codes(*self.quantize(x, input_scale))
