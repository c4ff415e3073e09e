"""Automatic mixed precision: which Linear layers get a wider format under a size budget.

In the spirit of ModelOpt's ``auto_quantize``, with a measured score instead of a gradient one:

1. a copy of the model is calibrated to the recipe's format everywhere by the recipe itself
   (AWQ's smoothing folded, MSE scales, static input scales, ...);
2. each *unit* (a decoder layer's siblings that engines fuse, q/k/v or gate/up; all experts of
   an MoE block; or one Linear) is put in ``fallback`` alone (round to nearest on its calibrated
   float weights), and the drop of the model's next-token loss on the calibration tokens is its
   score (nats per token);
3. units get ``fallback`` in order of score per extra weight byte, while the weights of the
   quantized layers stay within ``effective_bits`` per weight on average.

The result is ``Recipe.layer_formats`` (exact names); the recipe then calibrates every layer in
its format. Scores assume the units' losses add up, which Gemma-3-270M's per-layer recoveries
roughly do for weight-only NVFP4 (``docs/accuracy.md``, "Where the loss sits"). Scoring under the
calibrated recipe rather than round to nearest matters where calibration repairs some layers more
than others (AWQ and the MLP's ``down_proj`` under NVFP4 W4A4, ``docs/accuracy.md``).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.calibrate.recipe import Recipe
from quantkit.formats import get_format
from quantkit.nn.experts import linearize_experts
from quantkit.nn.swap import DEFAULT_IGNORE, plan_layers, shared_format_groups


@dataclass
class Unit:
    """Linears that get one format together; ``score``: loss recovered in the fallback format (nats per token);
    ``extra_bytes``: weight bytes the fallback format adds over the recipe's format."""

    names: tuple[str, ...]
    score: float
    extra_bytes: int


def weight_bytes(format: str, linear: nn.Linear) -> int:
    """Bytes of ``linear``'s weight in ``format``: values, block scales and tensor scale."""
    (data, data_dtype), (scale, scale_dtype), tensor_scale = get_format(format).weight.storage(*linear.weight.shape)
    return math.prod(data) * data_dtype.itemsize + math.prod(scale) * scale_dtype.itemsize + 4 * tensor_scale


def calibration_loss(model: nn.Module, ids: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy of ``model`` on token ids ``int64 [S, T]`` (nats per token),
    ``batch_size`` sequences per forward pass."""
    from quantkit.eval.perplexity import window_nll

    total = sum(window_nll(model, batch).sum().item() for batch in ids.split(batch_size))
    return total / (ids.shape[0] * (ids.shape[1] - 1))


@torch.no_grad()
def search_layer_formats(model: nn.Module, ids: torch.Tensor, recipe: Recipe | str, fallback: str, effective_bits: float, *,
                         batch_size: int = 8, device: str | torch.device | None = None) -> tuple[dict[str, str], list[Unit]]:
    """``(layer_formats, units)``: the Linears (exact names) to give ``fallback`` instead of the
    ``recipe``'s format (a format name: its default recipe) so that the quantized weights average
    at most ``effective_bits`` bits per weight (scales included), chosen by the scores above on
    calibration token ids ``ids`` (``int64 [S, T]``); and every unit with its score, best per byte
    first. ``model`` is left as it was: the search calibrates a copy, which runs whole on
    ``device`` (default: CUDA if present)."""
    from quantkit.calibrate.distributed import rank_device
    from quantkit.calibrate.pipeline import quantize
    from quantkit.nn.linear import QuantLinear

    recipe = recipe if isinstance(recipe, Recipe) else Recipe(recipe)
    if recipe.layer_formats:
        raise ValueError("search_layer_formats chooses the layer formats itself: give it a recipe without layer_formats")
    format, ignore = recipe.format, recipe.ignore
    device = torch.device(device) if device else rank_device()
    linearize_experts(model)  # as the pipeline will: the names below are of per-expert Linears
    model = copy.deepcopy(model)
    planned, _ = plan_layers(model, format, ignore)
    eligible, _ = plan_layers(model, fallback, ignore)
    groups = shared_format_groups(planned)
    grouped = {n for g in groups for n in g}
    units = [tuple(g) for g in groups] + [(n,) for n in planned if n not in grouped]
    units = [u for u in units if all(n in eligible for n in u)]
    low = {n: weight_bytes(format, m) for n, m in planned.items()}
    high = {n: weight_bytes(fallback, m) for n, m in eligible.items()}
    if any(high[n] <= low[n] for n in eligible):
        raise ValueError(f"fallback {fallback} does not take more bytes per weight than {format}")
    weights = sum(m.weight.numel() for m in planned.values())
    budget = effective_bits * weights / 8 - sum(low.values())
    if budget < 0:
        raise ValueError(f"{format} alone takes {8 * sum(low.values()) / weights:.2f} bits per weight, "
                         f"more than effective_bits={effective_bits}")

    # The pipeline folds smoothing into these float Linears in place, so after it they hold the
    # calibrated model's float weights.
    quantize(model, recipe, ids, batch_size=batch_size, device=device)
    model.to(device)
    base = calibration_loss(model, ids, batch_size)
    scored = []
    for unit in units:
        calibrated = {n: model.get_submodule(n) for n in unit}
        for n in unit:
            model.set_submodule(n, QuantLinear.from_linear(planned[n].to(device), fallback))
        scored.append(Unit(unit, base - calibration_loss(model, ids, batch_size),
                           sum(high[n] - low[n] for n in unit)))
        for n, module in calibrated.items():
            model.set_submodule(n, module)
    scored.sort(key=lambda u: u.score / max(u.extra_bytes, 1), reverse=True)
    chosen = {}
    for unit in scored:
        if unit.score > 0 and unit.extra_bytes <= budget:
            budget -= unit.extra_bytes
            chosen.update(dict.fromkeys(unit.names, fallback))
    return chosen, scored


def effective_bits(model: nn.Module, format: str, layer_formats: dict[str, str],
                   ignore: Iterable[str] = DEFAULT_IGNORE) -> float:
    """Bits per weight (scales included) of ``model``'s quantized Linears in ``format``, with
    ``layer_formats`` (exact names) overriding it."""
    planned, _ = plan_layers(model, format, ignore)
    total = sum(weight_bytes(layer_formats.get(n, format), m) for n, m in planned.items())
    return 8 * total / sum(m.weight.numel() for m in planned.values())
