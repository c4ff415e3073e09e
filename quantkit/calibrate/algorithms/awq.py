"""AWQ: activation-aware per-input-channel scales, searched on the output error (Lin et al., 2024).

For each smoothing pair (:mod:`quantkit.calibrate.algorithms.smoothquant`) the scale is
``s = m^α / w^(1-α)`` (or ``m^α``), normalised so that ``max(s)·min(s) = 1``, with ``m`` the mean
``|x|`` of the consumers' input channels; ``s = 1`` or the ``α`` of a grid is chosen to minimise the consumers' output
error ``Σ ‖x Wᵀ − q(x/s) · q(W·s)ᵀ‖²`` on a sample of calibration tokens (summed over
data-parallel ranks), where ``q`` is the format's round-to-nearest quantization of weights and
(if the format quantizes them) activations. The chosen ``s`` is folded into the producer, so the
float model is unchanged.

With float activations and no more input channels ``K`` than tokens ``T``, the error is
``Σₙ dₙ G dₙᵀ`` over the rows ``dₙ`` of ``q(W·s) − W·s``, ``G = (xᵀx) / (s sᵀ)``: one
``[N, K] × [K, K]`` product per candidate instead of the ``[T, K] × [K, N]`` GEMM.
"""
from __future__ import annotations

import torch

from quantkit.calibrate.algorithms.base import Algorithm, LayerContext, check_option
from quantkit.calibrate.algorithms.mse import amax_scales
from quantkit.calibrate.algorithms.smoothquant import SmoothingPair, fold, input_stats, smoothing_pairs
from quantkit.calibrate.distributed import all_reduce_
from quantkit.formats import Format


def _capture_inputs(ctx: LayerContext, pairs: list[SmoothingPair], max_tokens: list[int]) -> list[torch.Tensor]:
    """Per pair, FP32 ``[T, K]`` consumer inputs: every ``n``-th token of a ``ctx.run_block()`` pass,
    ``n`` chosen so that ``T ≤`` the pair's ``max_tokens``."""
    captured: list[list[torch.Tensor]] = [[] for _ in pairs]
    hooks = []
    for i, pair in enumerate(pairs):
        name, linear = next((n, m) for n, m in pair.consumers.items() if n in ctx.stats)
        stride = -(-ctx.stats[name].tokens // max_tokens[i])

        def hook(module, args, i=i, stride=stride):
            captured[i].append(args[0].detach().reshape(-1, args[0].shape[-1])[::stride].float())

        hooks.append(linear.register_forward_pre_hook(hook))
    try:
        ctx.run_block()
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(c)[:t] for c, t in zip(captured, max_tokens)]


def _pair_format(ctx: LayerContext, pair: SmoothingPair) -> Format:
    """The format of ``pair``'s quantized consumers (fused siblings or one Linear: one format)."""
    return ctx.format_of(next(n for n in pair.consumers if n in ctx.stats))


# (grid points, max tokens) when not given, by whether the format quantizes activations. With
# quantized activations each candidate costs a GEMM over the tokens, and 10 x 2048 cost 2.5x less
# than AutoAWQ's 20 x 4096 at +0.4 % perplexity (Gemma-3-270M NVFP4 awq+mse 32.50 vs 32.37). With
# float activations (the Gram form) AutoAWQ's 20 x 4096 costs ~20 s more on CPU and, over 5
# calibration samples, gave W4A16 perplexity 29.05 vs 29.21 and LAMBADA 39.4 vs 38.5 (means), with
# half the spread between samples: docs/accuracy.md, "Calibration noise".
DEFAULTS = {True: (10, 2048), False: (20, 4096)}  # by "activations quantized"


class AWQ(Algorithm):
    """Grid search of ``α`` in ``[0, 1)`` (``grid`` points) per smoothing pair on at most
    ``max_tokens`` calibration tokens (``None``: :data:`DEFAULTS` for the format), then fold the
    best scale. ``duo`` (default): AutoAWQ's ``s = m^α / w^(1-α)`` (``w``: the consumers' mean
    relative ``|W|`` of the channel), which on Gemma-3-270M NVFP4 gave perplexity 32.7 against 33.0
    for ``m^α``."""

    name = "awq"
    stage = "transform"

    def __init__(self, grid: int | None = None, max_tokens: int | None = None, duo: bool = True):
        if grid is not None:
            check_option("awq", "grid", grid, int, 2)  # 1 would try only s = 1
        if max_tokens is not None:
            check_option("awq", "max_tokens", max_tokens, int, 1)
        check_option("awq", "duo", duo, bool)
        self.grid, self.max_tokens, self.duo = grid, max_tokens, duo

    def _group_of(self, ctx: LayerContext, name: str, pair: SmoothingPair) -> list[str]:
        group = next((g for g in ctx.groups if name in g), [name])
        return [n for n in group if n in pair.consumers]

    def _output_error(self, ctx: LayerContext, pair: SmoothingPair, fmt: Format, x: torch.Tensor, s: torch.Tensor,
                      reference: dict[str, torch.Tensor] | None) -> float:
        """Σ over the quantized consumers of ``‖x Wᵀ − q(x/s)·q(W·s)ᵀ‖²`` (shared tensor scales
        within a fused group computed from the scaled weights; a static activation scale from the
        calibration amax of ``x/s``: all tokens of all ranks, as the quantized layer will use), in
        the consumers' format ``fmt``.
        ``x``: the FP32 ``[T, K]`` tokens with ``reference``, each quantized consumer's ``x Wᵀ``;
        or (float activations only) their Gram matrix ``xᵀx`` ``[K, K]`` with ``reference=None``."""
        s_in = pair.to_input(s).to(x.device)
        act = fmt.activation
        if reference is None:
            gram = x / torch.outer(s_in, s_in)  # (x/s)ᵀ(x/s)
        else:
            xs = x / s_in
            if act is not None:
                amax = (input_stats(pair, ctx).channel_amax.to(x.device) / s_in).max()
                xs = act.qdq(xs, act.input_scale_from_amax(amax) if act.static else None)
        scaled = {n: c.weight.detach().float() * s_in for n, c in pair.consumers.items() if n in ctx.stats}
        error = 0.0
        for name, w in scaled.items():
            amax = torch.stack([scaled[n].abs().amax() for n in self._group_of(ctx, name, pair)]).max()
            w_hat = fmt.quantize_weight(w, *amax_scales(fmt, w, amax)).dequantize()
            if reference is None:
                d = w_hat - w
                error += ((d @ gram) * d).sum().item()
            else:
                error += (xs @ w_hat.T - reference[name]).pow(2).sum().item()
        return error

    def _settings(self, quantized_activations: bool) -> tuple[int, int]:
        """(grid points, max tokens): the given ones, else :data:`DEFAULTS` for a format that does or
        does not quantize activations."""
        grid, max_tokens = DEFAULTS[quantized_activations]
        return self.grid or grid, self.max_tokens or max_tokens

    def _candidates(self, ctx: LayerContext, pair: SmoothingPair, grid: int) -> list[torch.Tensor]:
        """The scales tried: ``1``, then ``m^α`` (or ``m^α / w^(1-α)`` with ``duo``) for ``α`` on a
        ``grid``-point grid, each normalised so that ``max(s)·min(s) = 1``."""
        x_mean = pair.to_producer(input_stats(pair, ctx).channel_mean_abs, "mean").clamp(min=1e-4)
        if self.duo:  # mean over the consumers' rows of |W| relative to its row max
            rel = torch.cat([c.weight.detach().float().abs() for c in pair.consumers.values()]).to(x_mean.device)
            w_mean = pair.to_producer((rel / rel.amax(1, keepdim=True).clamp(min=1e-12)).mean(0), "mean")
        candidates = [torch.ones_like(x_mean)]
        for k in range(1, grid):
            a = k / grid
            s = x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4) if self.duo else x_mean.pow(a)
            s = s.clamp(min=1e-4)
            candidates.append((s / (s.max() * s.min()).sqrt()).clamp(min=1e-4))
        return candidates

    @torch.no_grad()
    def apply(self, ctx: LayerContext) -> None:
        pairs = smoothing_pairs(ctx)
        if not pairs:
            return
        formats = [_pair_format(ctx, pair) for pair in pairs]
        settings = [self._settings(fmt.activation is not None) for fmt in formats]
        inputs = _capture_inputs(ctx, pairs, [max_tokens for _, max_tokens in settings])
        for pair, fmt, (grid, _), x in zip(pairs, formats, settings, inputs):
            x = x.to(pair.producer.weight.device)
            if fmt.activation is None and x.shape[1] <= x.shape[0]:  # the Gram matrix is the cheaper form
                x, reference = x.T @ x, None
            else:
                reference = {n: x @ c.weight.detach().float().T for n, c in pair.consumers.items() if n in ctx.stats}
            candidates = self._candidates(ctx, pair, grid)
            errors = torch.tensor([self._output_error(ctx, pair, fmt, x, s, reference) for s in candidates],
                                  dtype=torch.float64)
            best = candidates[int(all_reduce_(errors).argmin())]  # summed over data-parallel ranks
            if not torch.all(best == 1):
                fold(pair, best, ctx)
