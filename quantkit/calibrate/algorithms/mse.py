"""MSE scale search: per block, the candidate scale with the least (optionally activation-weighted)
squared weight error, instead of the amax-derived one.

Candidates, by the block-scale type of the format:

- E4M3 block scales (NVFP4): the E4M3 codes ``-1 … +6`` steps around the round-to-nearest scale
  that maps the block max to 6 (also for ``nvfp4-4over6``, whose round-to-nearest rule picks 4 or
  6 per block: :func:`amax_scales`). ``+3 … +5`` (×1.5) is "4 over 6": the block max lands on the
  grid point 4 instead of 6, which often fits the block's values better; negative steps clip the
  block max. The FP32 tensor scale
  shared by a fused group can be searched too, over ``tensor_scale_steps`` points of one octave
  (a factor 2 shifts every E4M3 scale by an exact power of two and changes nothing); off by
  default: on Gemma-3-270M NVFP4, 4 steps gave a lower weight error but not a lower perplexity.
- E8M0 block scales (MX): the exponent ``-1, 0, +1`` around the OCP one.
- FP32 block scales (FP8): ``amax/448`` times shrink factors ``1, 0.98, …, 0.82``.

``weighted`` (default): weight the error of input channel ``k`` by the activation second moment
``E[x_k²]`` (the Hessian diagonal when the recipe collects it, else ``mean|x_k|²``); on
Gemma-3-270M NVFP4 it lowers WikiText-2 perplexity 35.6 → 34.4 (docs/accuracy.md).
"""
from __future__ import annotations

import torch

from quantkit.calibrate.algorithms.base import Algorithm, LayerContext, check_option
from quantkit.formats import Format, QuantizedWeight
from quantkit.formats.nvfp4 import NVFP4Weight

E4M3_STEPS = tuple(range(-1, 7))
E8M0_STEPS = (-1, 0, 1)
FP8_SHRINK = tuple(1 - 0.02 * i for i in range(10))
_E4M3_TINY_CODE, _E4M3_MAX_CODE = 0x08, 0x7E  # 2**-6 and 448: the NVFP4 block-scale range


def qdq(fmt: Format, w: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
    """FP32 ``[N, K]``: ``w`` quantized under the given scales, then dequantized."""
    data = fmt.weight.quantize(w, scale, tensor_scale)
    return fmt.weight.dequantize(QuantizedWeight(fmt.name, data, scale, tensor_scale, tuple(w.shape)))


def weighted_error(fmt: Format, w: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None,
                   importance: torch.Tensor | None) -> torch.Tensor:
    """FP32 ``[N, K]``: ``importance[k]·(w − ŵ)²`` under the given scales (``importance`` ``[K]``
    or ``None``: 1)."""
    err = (w - qdq(fmt, w, scale, tensor_scale)).pow(2)
    return err if importance is None else err * importance.to(err.device)


def block_sum(x: torch.Tensor, block: tuple[int, int], scale_shape: torch.Size) -> torch.Tensor:
    """Sum of FP32 ``x [N, K]`` over each scale block: ``[R, C]`` = ``scale_shape`` (``block``
    ``(rows, cols)``, 0 = the whole dimension; a ragged last row block is allowed)."""
    rows, cols = x.shape
    r, c = scale_shape
    br = block[0] or rows
    padded = torch.nn.functional.pad(x, (0, 0, 0, r * br - rows))
    return padded.reshape(r, br, c, cols // c).sum((1, 3))


def amax_scales(fmt: Format, w: torch.Tensor, amax: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(scale, tensor_scale)`` of FP32 ``w [N, K]`` rounded to nearest with each block max mapped
    to the top of the element grid: the format's own round-to-nearest scales, except for
    ``nvfp4-4over6``, whose rule may map a block max to 4 (its 4-scales are among the candidates).
    Searches step from these, and AWQ judges its smoothing scales with them, so ``nvfp4-4over6``
    weights calibrate exactly as ``nvfp4`` ones under the same activations."""
    weight = NVFP4Weight() if isinstance(fmt.weight, NVFP4Weight) else fmt.weight
    return weight.compute_scales(w, amax)


def candidate_scales(scale: torch.Tensor) -> list[torch.Tensor]:
    """Candidate block scales around the round-to-nearest ``scale`` (same shape and dtype)."""
    if scale.dtype == torch.float8_e4m3fn:
        codes = scale.view(torch.uint8).int()
        return [(codes + d).clamp(_E4M3_TINY_CODE, _E4M3_MAX_CODE).to(torch.uint8).view(torch.float8_e4m3fn)
                for d in E4M3_STEPS]
    if scale.dtype == torch.uint8:
        return [(scale.int() + d).clamp(0, 254).to(torch.uint8) for d in E8M0_STEPS]
    return [scale * f for f in FP8_SHRINK]


def _where(mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == torch.float8_e4m3fn:
        return torch.where(mask, a.view(torch.uint8), b.view(torch.uint8)).view(torch.float8_e4m3fn)
    return torch.where(mask, a, b)


def search_block_scales(fmt: Format, w: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None,
                        importance: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Per block of FP32 ``w [N, K]``, the candidate scale (see :func:`candidate_scales` of the
    round-to-nearest ``scale``) with the least ``Σ importance[k]·(w − ŵ)²``; ``importance``: FP32
    ``[K]`` or ``None`` (uniform). Returns ``(scale, total error)``."""
    best, best_err = None, None
    for cand in candidate_scales(scale):
        err = block_sum(weighted_error(fmt, w, cand, tensor_scale, importance), fmt.weight.block, cand.shape)
        if best is None:
            best, best_err = cand, err
        else:
            better = err < best_err
            best, best_err = _where(better, cand, best), torch.where(better, err, best_err)
    return best, best_err.sum().item()


class MSE(Algorithm):
    """Scales stage: MSE-optimal block scales (and NVFP4 group tensor scales); see the module doc."""

    name = "mse"
    stage = "scales"

    def __init__(self, weighted: bool = True, tensor_scale_steps: int = 1):
        check_option("mse", "weighted", weighted, bool)
        check_option("mse", "tensor_scale_steps", tensor_scale_steps, int, 1)
        self.weighted, self.tensor_scale_steps = weighted, tensor_scale_steps

    def _importance(self, ctx: LayerContext, name: str) -> torch.Tensor | None:
        if not self.weighted:
            return None
        stats = ctx.stats[name]
        return stats.hessian.diagonal().clone() if stats.hessian is not None else stats.channel_mean_abs.pow(2)

    def _search_group(self, ctx: LayerContext, weights: dict[str, torch.Tensor], amax_factor: float):
        """Per member of a fused group, the searched ``(scale, tensor_scale)`` under tensor scales
        from ``amax_factor × amax``; and the group's total error. A per-tensor scale (FP8
        ``(0, 0)`` blocks) is the group's: its candidates are tried on all members at once."""
        fmt = ctx.format_of(next(iter(weights)))  # a fused group has one format
        rtn = {n: amax_scales(fmt, w, ctx.weight_amax[n] * amax_factor) for n, w in weights.items()}
        importance = {n: self._importance(ctx, n) for n in weights}
        if fmt.weight.block != (0, 0):
            chosen = {n: search_block_scales(fmt, w, *rtn[n], importance[n]) for n, w in weights.items()}
            return {n: (s, rtn[n][1]) for n, (s, _) in chosen.items()}, sum(e for _, e in chosen.values())
        best = None
        for cand in candidate_scales(next(iter(rtn.values()))[0]):
            err = sum(weighted_error(fmt, w, cand, None, importance[n]).sum().item() for n, w in weights.items())
            if best is None or err < best[1]:
                best = ({n: (cand, None) for n in weights}, err)
        return best

    @torch.no_grad()
    def apply(self, ctx: LayerContext) -> None:
        grouped = {n for g in ctx.groups for n in g}
        for group in [*ctx.groups, *[[n] for n in ctx.linears if n not in grouped]]:
            weights = {n: ctx.linears[n].weight.detach().float() for n in group}
            fmt = ctx.format_of(group[0])
            has_tensor_scale = fmt.weight.storage(1, fmt.k_multiple)[2]
            steps = self.tensor_scale_steps if has_tensor_scale else 1
            best = min((self._search_group(ctx, weights, 2 ** (j / steps)) for j in range(steps)), key=lambda r: r[1])
            ctx.scales.update(best[0])
