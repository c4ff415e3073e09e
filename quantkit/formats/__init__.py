"""Low-precision formats by name.

=================  ==========================================  ==========================================
name               weights                                     activations
=================  ==========================================  ==========================================
``nvfp4``          E2M1, E4M3 scale / 16, FP32 tensor scale    NVFP4, dynamic blocks, static tensor scale
``nvfp4-4over6``   as nvfp4; RTN block scales by the 4-or-6    as nvfp4, block scales by the 4-or-6 rule
                   rule (see below)
``nvfp4-w4a16``    as nvfp4                                    bf16 (not quantized)
``nvfp4-w4a8``     as nvfp4 (GEMM: see below)                  E4M3, FP32 scale / token, dynamic,
                                                               when ``use_w4a8(M, N')``; else bf16
``mxfp8``          E4M3, E8M0 scale / 32                       MXFP8, dynamic
``mxfp4``          E2M1, E8M0 scale / 32                       MXFP4, dynamic
``fp8-block``      E4M3, FP32 scale / 128×128                  E4M3, FP32 scale / 1×128, dynamic
``fp8-dynamic``    E4M3, FP32 scale / output channel           E4M3, FP32 scale / token, dynamic
``fp8``            E4M3, FP32 scale / tensor                   E4M3, FP32 scale / tensor, static
=================  ==========================================  ==========================================

``nvfp4-w4a8`` stores exactly the ``nvfp4-w4a16`` weights; its GEMM is
:func:`quantkit.formats.w4a8.format_accumulate`: W4A16 for decode-sized inputs, and for
prefill-sized ones (``use_w4a8``) W4A8 — each weight rounded once to E4M3 under a per-row power
of two, activations E4M3 per token (:mod:`quantkit.formats.w4a8`).

``nvfp4-4over6`` is ``nvfp4`` with the *Four Over Six* block-scale rule (Cook et al. 2025): each
16-block's scale maps its max to 4 or to 6, whichever reconstructs the block with the lower squared
error (:func:`quantkit.formats.nvfp4.block_scales`). Its bits and checkpoint tensors are ordinary
NVFP4: vLLM serves its checkpoint as ``nvfp4`` (activation scales by the 6 rule), quantkit with
the 4-or-6 rule. (The sm_100 kernel's fused requantization, ``Epilogue(requant="nvfp4")``,
applies the 6 rule.)
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantkit.formats import w4a8
from quantkit.formats.base import ActivationScheme, QuantizedWeight, WeightScheme
from quantkit.formats.fp8 import FP8Activation, FP8Weight
from quantkit.formats.mx import MXActivation, MXWeight
from quantkit.formats.nvfp4 import NVFP4Activation, NVFP4Weight


@dataclass(frozen=True)
class Format:
    """A named pair of weight and activation schemes (activation ``None``: no activation scheme
    applies to every input — weight-only, or quantized inside ``accumulate``).

    ``accumulate``: for a format whose GEMM is not ``qdq(x) @ dequant(w).T``, its FP32 accumulator
    ``[M, N']`` from ``x [M, K]``, the :class:`QuantizedWeight` and an optional cached dequantized
    weight (``nvfp4-w4a8``: :func:`quantkit.formats.w4a8.format_accumulate`)."""

    name: str
    weight: WeightScheme
    activation: ActivationScheme | None
    accumulate: Callable[[torch.Tensor, QuantizedWeight, torch.Tensor | None], torch.Tensor] | None = None

    @property
    def static_activation(self) -> bool:
        """Whether the activations take a calibrated (static) ``input_scale``."""
        return self.activation is not None and self.activation.static

    @property
    def k_multiple(self) -> int:
        """K must be a multiple of this for the format (its K block)."""
        return self.weight.block[1] or 1

    def quantize_weight(self, w: torch.Tensor, scale: torch.Tensor | None = None,
                        tensor_scale: torch.Tensor | None = None) -> QuantizedWeight:
        """Quantize ``w [N, K]`` (round to nearest), with RTN scales unless ``scale`` is given."""
        check_weight(w, self)
        if scale is None:
            scale, computed_ts = self.weight.compute_scales(w)
            tensor_scale = computed_ts if tensor_scale is None else tensor_scale
        elif tensor_scale is None and self.weight.storage(*w.shape)[2]:
            raise ValueError(f"{self.name}: a given block scale needs its tensor_scale too")
        data = self.weight.quantize(w, scale, tensor_scale)
        return QuantizedWeight(self.name, data, scale, tensor_scale, (w.shape[0], w.shape[1]))


_FORMATS = {
    f.name: f
    for f in (
        Format("nvfp4", NVFP4Weight(), NVFP4Activation()),
        Format("nvfp4-4over6", NVFP4Weight(four_over_six=True), NVFP4Activation(four_over_six=True)),
        Format("nvfp4-w4a16", NVFP4Weight(), None),
        Format("nvfp4-w4a8", NVFP4Weight(), None, w4a8.format_accumulate),
        Format("mxfp8", MXWeight(8), MXActivation(8)),
        Format("mxfp4", MXWeight(4), MXActivation(4)),
        Format("fp8-block", FP8Weight((128, 128)), FP8Activation(128, per_token=True)),
        Format("fp8-dynamic", FP8Weight((1, 0)), FP8Activation(0, per_token=True)),
        Format("fp8", FP8Weight((0, 0)), FP8Activation(0, per_token=False)),
    )
}
FORMAT_NAMES = tuple(_FORMATS)


def get_format(name: str | Format) -> Format:
    """The :class:`Format` called ``name``; a ``ValueError`` listing the valid names otherwise."""
    if isinstance(name, Format):
        return name
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; valid formats: {', '.join(FORMAT_NAMES)}") from None


WEIGHT_LIMIT = 2.0**127  # weights at or above this magnitude are refused (check_weight)


def check_weight(w: torch.Tensor, fmt: Format) -> None:
    """Raise ``ValueError`` naming the problem if ``w`` cannot be quantized to ``fmt``."""
    if w.dim() != 2:
        raise ValueError(f"{fmt.name}: weights must be 2-D [N, K], got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"{fmt.name}: weights must be floating point, got {w.dtype}")
    if w.shape[1] % fmt.k_multiple:
        raise ValueError(f"{fmt.name}: K={w.shape[1]} is not divisible by the block size {fmt.k_multiple}")
    amax = w.abs().max().item() if w.numel() else 0.0  # NaN if any is: one pass for both checks
    if not math.isfinite(amax):
        raise ValueError(f"{fmt.name}: weights contain NaN or Inf ({(~torch.isfinite(w)).sum().item()} values)")
    if amax >= WEIGHT_LIMIT:
        raise ValueError(f"{fmt.name}: a weight of magnitude {amax:.3g} is at or above 2**127, where the NVFP4 and MX "
                         "scales overflow FP32 (the dequantized weight would be Inf)")


__all__ = ["Format", "FORMAT_NAMES", "QuantizedWeight", "check_weight", "get_format"]
