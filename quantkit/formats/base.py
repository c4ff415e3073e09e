"""The objects every format shares: :class:`QuantizedWeight` and the scheme interfaces."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class QuantizedWeight:
    """A quantized ``[N, K]`` weight: what calibration produces, QuantLinear holds, kernels read
    and export writes.

    ``data``: packed values (``uint8 [N, K/2]`` for 4-bit formats, ``float8_e4m3fn [N, K]`` for
    FP8 ones). ``scale``: block scales in canonical row-major layout (dtype and shape per format).
    ``tensor_scale``: FP32 scalar multiplying every block (NVFP4), else ``None``.
    """

    format: str
    data: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor | None
    shape: tuple[int, int]
    layouts: dict[str, Any] = field(default_factory=dict, repr=False)  # kernel re-layouts, reference copies

    def dequantize(self) -> torch.Tensor:
        """FP32 ``[N, K]``: the weight this object represents."""
        from quantkit.formats import get_format

        return get_format(self.format).weight.dequantize(self)

    def cached(self, name: str, build: Callable[[], Any]) -> Any:
        """``layouts[name]``, built by ``build()`` when absent and kept, except inside a
        torch.compile trace: a cache filled there is guarded as empty, so the next call would
        recompile; the trace computes the value in its graph instead. For reference-path copies
        (dequantized weights); kernel layouts are filled ahead of any trace
        (:func:`quantkit.kernels.prepare_layouts`)."""
        if name in self.layouts:
            return self.layouts[name]
        value = build()
        if not torch.compiler.is_compiling():
            self.layouts[name] = value
        return value


class WeightScheme(Protocol):
    """How a format stores weights. ``block`` = (rows, cols) one scale covers (0: the whole dim)."""

    block: tuple[int, int]

    def compute_scales(self, w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Round-to-nearest scales for FP32 ``w [N, K]``: ``(scale, tensor_scale)``."""

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
        """Packed values of ``w`` under the given scales."""

    def dequantize(self, qw: QuantizedWeight) -> torch.Tensor:
        """FP32 ``[N, K]`` from a :class:`QuantizedWeight` of this scheme."""

    def storage(self, n: int, k: int) -> tuple[tuple[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype], bool]:
        """``((data shape, dtype), (scale shape, dtype), has_tensor_scale)`` for an ``[n, k]`` weight."""


class ActivationScheme(Protocol):
    """How a format quantizes activations ``x [..., K]`` on the fly.

    ``static``: the scheme uses a calibrated FP32 ``input_scale`` (amax-derived); when none is
    given it computes the same quantity from the current tensor (dynamic)."""

    block: int
    static: bool

    def input_scale_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """The calibrated FP32 scalar scale for an observed activation amax."""

    def qdq(self, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize then dequantize ``x`` (FP32 result, same shape): what the kernel multiplies."""
