"""FP8 E4M3 with FP32 scales over rectangular blocks of a 2-D tensor.

One rule for every granularity: a block's scale is ``s = amax/448`` (an all-zero block, or one
so small that ``amax/448`` underflows to 0, gets ``s = 1``), values are ``q = e4m3(x / s)`` (RNE,
saturating) and ``x̂ = q · s``.

Non-finite activations (weights reject them: :func:`quantkit.formats.check_weight`) are never
clipped silently: the amax ignores NaN, as the GPU's ``max.f32`` does, so a NaN stays NaN in its
place and the rest of its block quantizes as without it (the GEMM output row is NaN either way);
an Inf makes its block's scale Inf, so the block dequantizes to NaN (``0 · Inf``). Under a static
(calibrated) scale an Inf saturates to ±448 like any value out of range, as ``cvt.rn.satfinite`` does.

Granularities (block = (rows, cols); 0 means the whole dimension):

- per-tensor ``(0, 0)``; per-channel weights ``(1, 0)``; per-token activations ``(1, 0)``;
- DeepSeek-V3 blocks: weights ``(128, 128)``, activations ``(1, 128)``.

Scales are FP32 of shape ``[ceil(rows/br), ceil(cols/bc)]`` (a ragged last block is allowed for
rows; K must divide by the column block).
"""
from __future__ import annotations

import torch

from quantkit.formats.base import QuantizedWeight
from quantkit.formats.codecs import E4M3_MAX, abs_ignoring_nan, e4m3_encode


def _block_dims(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    rows, cols = shape
    br, bc = block[0] or rows, block[1] or cols
    if cols % bc:
        raise ValueError(f"K={cols} is not divisible by the FP8 block width {bc}")
    return br, bc


def _expand(scale: torch.Tensor, shape: tuple[int, int], br: int, bc: int) -> torch.Tensor:
    return scale.repeat_interleave(br, 0)[: shape[0]].repeat_interleave(bc, 1)


def block_scales(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP32 scales ``amax/448`` per block of the 2-D tensor ``x``."""
    rows, cols = x.shape
    br, bc = _block_dims((rows, cols), block)
    pad = (-rows) % br
    a = torch.nn.functional.pad(abs_ignoring_nan(x), (0, 0, 0, pad))
    amax = a.reshape((rows + pad) // br, br, cols // bc, bc).amax((1, 3))
    # a true division on every device (CUDA turns a scalar divisor into a reciprocal multiply)
    scale = amax / torch.full_like(amax, E4M3_MAX)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_with(x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``float8_e4m3fn`` values of 2-D ``x`` under per-block FP32 ``scale``."""
    br, bc = _block_dims(tuple(x.shape), block)
    return e4m3_encode(x.float() / _expand(scale.float(), tuple(x.shape), br, bc))


def dequantize_with(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP32 ``q · s`` for 2-D FP8 ``q`` and per-block ``scale``."""
    br, bc = _block_dims(tuple(q.shape), block)
    return q.float() * _expand(scale.float(), tuple(q.shape), br, bc)


def quantize(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn, scale FP32)`` for 2-D ``x`` with per-block amax scaling."""
    scale = block_scales(x, block)
    return quantize_with(x, scale, block), scale


class FP8Weight:
    """FP8 weights ``[N, K]`` with FP32 scales over ``block``."""

    def __init__(self, block: tuple[int, int]):
        self.block = block

    def compute_scales(self, w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """Per-block ``amax/448``; a per-tensor scheme uses ``amax`` when given (a fused group's)."""
        if amax is not None and self.block == (0, 0):
            return block_scales(amax.reshape(1, 1), (0, 0)), None
        return block_scales(w, self.block), None

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
        return quantize_with(w, scale, self.block)

    def dequantize(self, qw: QuantizedWeight) -> torch.Tensor:
        return dequantize_with(qw.data, qw.scale, self.block)

    def storage(self, n: int, k: int):
        br, bc = _block_dims((n, k), self.block)
        return ((n, k), torch.float8_e4m3fn), ((-(-n // br), k // bc), torch.float32), False


class FP8Activation:
    """FP8 activations ``[..., K]``: dynamic per token / per 1×``block`` group, or per tensor
    (``block = 0``), which is static when a calibrated ``input_scale`` is given."""

    def __init__(self, block: int, per_token: bool):
        self.block, self.per_token = block, per_token
        self.static = not per_token

    def input_scale_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        return block_scales(amax.reshape(1, 1), (0, 0)).reshape(())

    def qdq(self, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.per_token:
            out = dequantize_with(*quantize(x2, (1, self.block)), (1, self.block))
        else:
            scale = block_scales(x2, (0, 0)) if input_scale is None else input_scale.float().reshape(1, 1)
            out = dequantize_with(quantize_with(x2, scale, (0, 0)), scale, (0, 0))
        return out.reshape(x.shape)
