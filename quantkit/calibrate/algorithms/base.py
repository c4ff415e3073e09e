"""The interface every calibration algorithm implements, and the per-layer context it works on.

An algorithm belongs to one *stage*; a recipe runs its algorithms stage by stage on each decoder
layer: ``transform`` (change the float weights/norms so they quantize better, output unchanged:
AWQ, SmoothQuant), ``scales`` (choose weight scales: MSE search), ``round`` (turn weights + scales
into a :class:`QuantizedWeight`: RTN, GPTQ). A recipe without a ``round`` algorithm gets RTN.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from quantkit.calibrate.observers import InputStats
from quantkit.formats import Format, QuantizedWeight

STAGES = ("transform", "scales", "round")


@dataclass
class LayerContext:
    """One decoder layer during calibration.

    ``fmt``: the format of every Linear, or a format per Linear name (see :meth:`format_of`). ``linears``: the layer's Linear modules to quantize, by full model name. ``stats``: their input
    statistics. ``groups``: fused sibling groups (share tensor scales). ``weight_amax``: per layer,
    the amax its NVFP4 tensor scale derives from (max over its fused group). ``run_block(batches)``:
    runs the decoder layer (as its modules are now) on the calibration batches ``batches``
    (indices; ``None``: all) and returns its outputs, for algorithms that measure output error.
    ``targets``: the float model's outputs of this layer (the layer fed the float model's hidden
    states, not the quantized ones), when an algorithm ``needs_float_targets``; else ``None``.
    Algorithms fill ``scales`` (``(scale, tensor_scale)`` by name) and ``qweights``."""

    fmt: Format | dict[str, Format]
    block: nn.Module
    linears: dict[str, nn.Linear]
    stats: dict[str, InputStats]
    groups: list[list[str]]
    weight_amax: dict[str, torch.Tensor]
    run_block: Callable[..., list[torch.Tensor]]
    targets: list[torch.Tensor] | None = None
    scales: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    qweights: dict[str, QuantizedWeight] = field(default_factory=dict)

    def format_of(self, name: str) -> Format:
        """The format Linear ``name`` is quantized to."""
        return self.fmt[name] if isinstance(self.fmt, dict) else self.fmt

    def rtn_scales(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Round-to-nearest scales of layer ``name`` (fused-group tensor scale), unless a ``scales``
        algorithm already chose them."""
        if name not in self.scales:
            w = self.linears[name].weight.detach().float()
            self.scales[name] = self.format_of(name).weight.compute_scales(w, self.weight_amax[name])
        return self.scales[name]

    def input_scales(self) -> dict[str, torch.Tensor]:
        """Static activation tensor scales by name, for formats that calibrate them (else empty):
        one per fused group (one format: see :func:`quantkit.nn.swap.assign_formats`), from the
        largest calibration ``amax`` of its members."""
        grouped = {n for g in self.groups for n in g}
        scales = {}
        for group in [*self.groups, *[[n] for n in self.linears if n not in grouped]]:
            fmt = self.format_of(group[0])
            if not fmt.static_activation:
                continue
            act = fmt.activation
            amax = torch.stack([self.stats[n].amax for n in group]).max()
            scales.update({n: act.input_scale_from_amax(amax) for n in group})
        return scales


def check_option(algorithm: str, name: str, value, kind: type, low: float | None = None, high: float | None = None) -> None:
    """Raise ``ValueError`` naming ``algorithm``'s option ``name`` unless ``value`` is a ``kind``
    (``float`` accepts ints; a bool is no number) within ``[low, high]``."""
    kinds = (int, float) if kind is float else (kind,)
    ok = isinstance(value, kinds) and (kind is bool or not isinstance(value, bool))
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        bounds = "" if low is None else f" >= {low}" if high is None else f" in [{low}, {high}]"
        raise ValueError(f"{algorithm} option {name} must be {'a number' if kind is float else f'an {kind.__name__}'}"
                         f"{bounds}, got {value!r}")


class Algorithm:
    """A calibration algorithm: ``stage``, options from the recipe, ``apply(ctx)``."""

    name: ClassVar[str]
    stage: ClassVar[str]
    needs_hessian: ClassVar[bool] = False
    needs_float_targets: bool = False

    def apply(self, ctx: LayerContext) -> None:
        raise NotImplementedError
