"""Round to nearest: values rounded under the chosen (default: max-derived) scales."""
from __future__ import annotations

from quantkit.calibrate.algorithms.base import Algorithm, LayerContext


class RTN(Algorithm):
    """``q = round(w / s)`` with ``s`` from ``ctx.scales`` or the format's amax rule."""

    name = "rtn"
    stage = "round"

    def apply(self, ctx: LayerContext) -> None:
        for name, linear in ctx.linears.items():
            scale, tensor_scale = ctx.rtn_scales(name)
            ctx.qweights[name] = ctx.format_of(name).quantize_weight(linear.weight.detach().float(), scale, tensor_scale)
