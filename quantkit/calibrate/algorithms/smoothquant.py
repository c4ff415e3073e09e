"""SmoothQuant: per-input-channel scales that move activation outliers into the weights.

A *smoothing pair* is an op whose output feeds some Linear layers and can absorb a per-channel
factor exactly: an RMSNorm/LayerNorm before q/k/v or gate/up, ``v_proj`` before ``o_proj``
(repeated over the query heads of a KV group under GQA), ``up_proj`` before ``down_proj``.
Smoothing with ``s [C]`` divides the producer's output channel ``c`` by ``s[c]`` and multiplies
the matching weight columns of its consumers by ``s[c]``: the float model computes the same
function, the checkpoint needs no extra op, and the consumers' inputs are ``x / s``.

Pairs are found by module path (:data:`PAIRS`), then each is checked on the layer itself: a
random scale is folded into it and every Linear output of the layer, and the layer's output, must
stay the same on a calibration batch. That drops the pairs the paths get wrong: a norm that also
feeds other modules (parallel attention/MLP blocks: Phi, Cohere; Gemma 3n's LAuReL), a norm that
normalises a branch's output (post-norm layers: OLMo 2), a nonlinearity between the pair (ReLU²
MLPs without a gate: Nemotron), a norm on the values (Gemma 4's ``v_norm``).

SmoothQuant chooses ``s = max|x|^α / max|W|^(1-α)`` (Xiao et al., 2023); AWQ
(:mod:`quantkit.calibrate.algorithms.awq`) searches ``s`` on the output error and folds it
with :func:`fold`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.calibrate.algorithms.base import Algorithm, LayerContext, check_option
from quantkit.calibrate.distributed import all_reduce_
from quantkit.calibrate.observers import InputStats
from quantkit.nn.swap import shared_weight_amax

# (producer, consumers) by module path inside a decoder layer. The MLP's input norm is
# ``pre_feedforward_layernorm`` where it exists (Gemma: ``post_attention_layernorm`` normalises
# the attention output there), else ``post_attention_layernorm`` (Llama, Qwen, Mistral).
_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj")
PAIRS = (
    ("input_layernorm", _ATTN),
    (("pre_feedforward_layernorm", "post_attention_layernorm"), _MLP),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
    ("mlp.up_proj", ("mlp.down_proj",)),
)


@dataclass
class SmoothingPair:
    """``producer`` (a norm or an ``nn.Linear``) feeding the Linear ``consumers`` (all with the
    same input; by full name when being quantized, else by path inside the layer). ``index``:
    int64 ``[K]``, the producer channel of each consumer input channel (``None``: identity).
    ``offset``: a norm's output is ``x̂·(offset + weight)``."""

    producer: nn.Module
    consumers: dict[str, nn.Linear]
    index: torch.Tensor | None
    offset: float = 0.0

    @property
    def channels(self) -> int:
        """Number of producer output channels ``C`` (the length of a smoothing scale)."""
        p = self.producer
        return p.out_features if isinstance(p, nn.Linear) else p.weight.numel()

    def to_producer(self, per_input: torch.Tensor, reduce: str) -> torch.Tensor:
        """Reduce a consumer per-input-channel FP32 ``[K]`` statistic to producer channels ``[C]``
        (``reduce``: ``"amax"`` or ``"mean"`` over the input channels sharing a producer channel)."""
        if self.index is None:
            return per_input
        out = torch.zeros(self.channels, dtype=per_input.dtype, device=per_input.device)
        return out.scatter_reduce(0, self.index.to(per_input.device), per_input, reduce, include_self=False)

    def to_input(self, s: torch.Tensor) -> torch.Tensor:
        """A producer-channel ``[C]`` scale expanded to the consumers' input channels ``[K]``."""
        return s if self.index is None else s[self.index.to(s.device)]


def _norm_offset(norm: nn.Module) -> float | None:
    """0 when ``norm`` multiplies by ``weight`` (Llama), 1 when by ``1 + weight`` (Gemma); ``None``
    when it is not a per-channel norm (probed with a ±1 input, whose normalised value is ±1)."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.numel() % 2:
        return None
    x = torch.ones(weight.numel(), dtype=torch.float32, device=weight.device)
    x[1::2] = -1
    with torch.no_grad():
        plus, minus = norm(x.to(weight.dtype)).float(), norm((-x).to(weight.dtype)).float()
    gain = (plus - minus) / (2 * x)
    w = weight.detach().float()
    tol = 1e-2 * (1 + w.abs())
    for offset in (0.0, 1.0):
        if ((gain - (offset + w)).abs() <= tol).all():
            return offset
    return None


def _gqa_index(attn: nn.Module, v: nn.Linear, o: nn.Linear) -> torch.Tensor | None:
    """``o_proj`` input channel → ``v_proj`` output channel when query heads share KV heads
    (grouped-query attention: head ``h`` reads KV head ``h // rep``); ``None`` if unknown."""
    head_dim = getattr(attn, "head_dim", None)
    if not head_dim or o.in_features % v.out_features or v.out_features % head_dim:
        return None
    rep = o.in_features // v.out_features
    c = torch.arange(o.in_features)
    return (c // head_dim // rep) * head_dim + c % head_dim


def smoothing_pairs(ctx: LayerContext) -> list[SmoothingPair]:
    """The smoothing pairs of ``ctx.block`` (see :data:`PAIRS`) that have at least one consumer
    being quantized, every consumer existing and taking the producer's whole output, and whose
    folding leaves the layer's function unchanged (:func:`_folds_exactly`)."""
    pairs = _candidate_pairs(ctx)
    if not pairs:
        return pairs
    before = _layer_outputs(ctx)
    broken = all_reduce_(torch.tensor([float(not _folds_exactly(pair, ctx, before)) for pair in pairs])).tolist()  # any rank
    for pair, bad in zip(pairs, broken):
        if bad:
            warnings.warn(f"smoothing pair {type(pair.producer).__name__} -> {', '.join(n.rpartition('.')[2] for n in pair.consumers)} "
                          "skipped: folding a scale into it changes the layer's function (its producer feeds other "
                          "modules too, or a norm or nonlinearity sits between them)", stacklevel=3)
    return [pair for pair, bad in zip(pairs, broken) if not bad]


def _layer_outputs(ctx: LayerContext) -> dict[nn.Module, torch.Tensor]:
    """FP32 outputs of every Linear of the layer (by module) and of the layer (key ``ctx.block``),
    on calibration batch 0."""
    seen: dict[nn.Module, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.__setitem__(mod, out.detach().float()))
             for m in ctx.block.modules() if isinstance(m, nn.Linear)]
    try:
        seen[ctx.block] = ctx.run_block([0])[0].float()
    finally:
        for h in hooks:
            h.remove()
    return seen


@torch.no_grad()
def _folds_exactly(pair: SmoothingPair, ctx: LayerContext, before: dict[nn.Module, torch.Tensor]) -> bool:
    """Whether folding a random scale (log-uniform in [1/4, 4]) into ``pair`` leaves every Linear
    output of the layer (the producer's aside) and the layer's output (``before``:
    :func:`_layer_outputs`) unchanged on a calibration batch, up to the weights' rounding; the
    weights are restored either way."""
    params = [p for m in (pair.producer, *pair.consumers.values()) for p in (m.weight, getattr(m, "bias", None))
              if p is not None]
    saved = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(0)
    s = torch.exp2(torch.rand(pair.channels, generator=gen, dtype=torch.float64) * 4 - 2)
    _scale_weights(pair, s)
    try:
        after = _layer_outputs(ctx)
    finally:
        for p, old in zip(params, saved):
            p.copy_(old)
    tol = max(1e-4, 8 * torch.finfo(pair.producer.weight.dtype).eps)
    return all((after[m] - b).norm() <= tol * b.norm() for m, b in before.items() if m is not pair.producer)


def _candidate_pairs(ctx: LayerContext) -> list[SmoothingPair]:
    """:data:`PAIRS` as the layer's module paths match them (see :func:`smoothing_pairs`)."""
    modules = dict(ctx.block.named_modules())
    full = {id(m): n for n, m in ctx.linears.items()}
    pairs = []
    for producers, consumer_paths in PAIRS:
        producer_path = next((p for p in ((producers,) if isinstance(producers, str) else producers) if p in modules), None)
        consumers = [modules.get(c) for c in consumer_paths]
        if producer_path is None or any(not isinstance(c, nn.Linear) for c in consumers):
            continue
        if not any(id(c) in full for c in consumers):
            continue
        producer = modules[producer_path]
        index, offset = None, 0.0
        if isinstance(producer, nn.Linear):
            if len(consumers) != 1:
                continue
            if consumers[0].in_features != producer.out_features:
                index = _gqa_index(modules[producer_path.rpartition(".")[0]], producer, consumers[0])
                if index is None:
                    continue
        else:
            offset = _norm_offset(producer)
            if offset is None or any(c.in_features != producer.weight.numel() for c in consumers):
                continue
        named = {full.get(id(c), path): c for c, path in zip(consumers, consumer_paths)}
        pairs.append(SmoothingPair(producer, named, index, offset))
    return pairs


def _rescaled(stats: InputStats, s: torch.Tensor) -> InputStats:
    """Input statistics of a Linear whose inputs became ``x / s`` (``s [K]`` FP32)."""
    s = s.to(stats.channel_amax.device)
    channel_amax = stats.channel_amax / s
    hessian = None if stats.hessian is None else stats.hessian / torch.outer(s, s)
    return InputStats(channel_amax.max(), channel_amax, stats.channel_mean_abs / s, hessian, stats.tokens)


@torch.no_grad()
def _scale_weights(pair: SmoothingPair, s: torch.Tensor) -> torch.Tensor:
    """Divide the producer's output channel ``c`` by ``s[c]`` and multiply the consumers' matching
    weight columns, in place (in float64); returns ``s`` at the consumers' input channels."""
    p = pair.producer
    s64 = s.double().to(p.weight.device)
    if isinstance(p, nn.Linear):
        p.weight.copy_(p.weight.double() / s64[:, None])
    else:
        p.weight.copy_((p.weight.double() + pair.offset) / s64 - pair.offset)
    if getattr(p, "bias", None) is not None:
        p.bias.copy_(p.bias.double() / s64)
    s_in = pair.to_input(s64)
    for linear in pair.consumers.values():
        linear.weight.copy_(linear.weight.double() * s_in.to(linear.weight.device))
    return s_in


@torch.no_grad()
def fold(pair: SmoothingPair, s: torch.Tensor, ctx: LayerContext) -> None:
    """Smooth ``pair`` by ``s`` (FP32 ``[C]``, positive) in place: the producer's output channel
    ``c`` is divided by ``s[c]``, the consumers' matching weight columns multiplied; updates the
    consumers' ``ctx.stats`` and the layer's ``ctx.weight_amax``."""
    s_in = _scale_weights(pair, s)
    for name in pair.consumers:
        if name in ctx.stats:
            ctx.stats[name] = _rescaled(ctx.stats[name], s_in.float())
    ctx.weight_amax.update(shared_weight_amax(ctx.linears))


def input_stats(pair: SmoothingPair, ctx: LayerContext) -> InputStats:
    """The input statistics of ``pair``'s consumers (they share one input)."""
    return next(ctx.stats[n] for n in pair.consumers if n in ctx.stats)


class SmoothQuant(Algorithm):
    """``s = max|x|^α / max|W|^(1-α)`` per producer channel (max over the consumers' columns),
    folded into every smoothing pair of the layer. ``alpha``: migration strength (0.5)."""

    name = "smoothquant"
    stage = "transform"

    def __init__(self, alpha: float = 0.5):
        check_option("smoothquant", "alpha", alpha, float, 0, 1)
        self.alpha = alpha

    @torch.no_grad()
    def apply(self, ctx: LayerContext) -> None:
        for pair in smoothing_pairs(ctx):
            x_max = pair.to_producer(input_stats(pair, ctx).channel_amax, "amax")
            w_max = torch.stack([pair.to_producer(c.weight.detach().float().abs().amax(0).to(x_max.device), "amax")
                                 for c in pair.consumers.values()]).amax(0)
            s = x_max.pow(self.alpha) / w_max.pow(1 - self.alpha)
            s = torch.where((x_max > 0) & (w_max > 0), s, torch.ones_like(s)).clamp(min=1e-5)
            fold(pair, s, ctx)
