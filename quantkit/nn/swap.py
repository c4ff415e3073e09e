"""quantize_model: swap a model's ``nn.Linear`` layers for :class:`QuantLinear` in place."""
from __future__ import annotations

import fnmatch
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.formats import QuantizedWeight, get_format
from quantkit.nn.experts import is_fused_experts, linearize_experts, router_names, unsupported_reason
from quantkit.nn.linear import QuantLinear

# Left in high precision: lm_head; MoE routers and Qwen2-MoE's shared-expert gate (N=1), which
# vLLM builds as unquantized layers; and the vision / audio encoders and projectors of multimodal
# models (Gemma 3, LLaVA, Llama 4: vision_tower, multi_modal_projector; Mllama: vision_model;
# Qwen-VL: visual; Gemma 3n: embed_vision, embed_audio, audio_tower), which the calibration
# pipeline does not run and which llm-compressor's and ModelOpt's multimodal recipes keep too.
DEFAULT_IGNORE = ("lm_head", "*.lm_head", "*mlp.gate", "*router*", "*shared_expert_gate",
                  "*vision_tower*", "*vision_model*", "*visual.*", "*multi_modal_projector*", "*audio_tower*",
                  "*embed_vision*", "*embed_audio*")
# Sibling projections that inference engines fuse into one GEMM: they must share tensor scales.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


@dataclass
class LayerResult:
    """One Linear layer: quantized (``reason`` empty) or skipped (``reason`` says why)."""

    name: str
    shape: tuple[int, int]
    reason: str = ""
    format: str = ""  # the layer's format when quantized
    sqnr_db: float | None = None
    bytes_before: int = 0
    bytes_after: int = 0


@dataclass
class QuantizationReport:
    """What :func:`quantize_model` did to every ``nn.Linear`` of the model."""

    format: str  # the format of the layers no ``layer_formats`` pattern matched
    layers: list[LayerResult] = field(default_factory=list)
    calibration: object | None = None  # quantkit.calibrate.pipeline.CalibrationInfo when data was used

    @property
    def quantized(self) -> list[LayerResult]:
        return [r for r in self.layers if not r.reason]

    @property
    def formats(self) -> dict[str, int]:
        """Quantized layers per format, most frequent first."""
        return dict(Counter(r.format for r in self.quantized).most_common())

    @property
    def skipped(self) -> list[LayerResult]:
        return [r for r in self.layers if r.reason]


def check_patterns(patterns: Iterable[str], what: str = "ignore") -> None:
    """Raise ``TypeError`` if ``patterns`` is one string (a collection of patterns is meant: a
    string would be read as its characters), or naming the first ``re:`` pattern (a ``what``
    pattern) that is not a valid regular expression."""
    if isinstance(patterns, str):
        raise TypeError(f"{what} takes a list of patterns, not the string {patterns!r}: write [{patterns!r}]")
    for p in patterns:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as err:
                raise ValueError(f"{what} pattern {p!r} is not a valid regular expression: {err}") from None


def matches(name: str, patterns: Iterable[str]) -> bool:
    """True if module ``name`` matches a glob pattern or a ``re:``-prefixed regular expression."""
    for p in patterns:
        if p.startswith("re:") and re.fullmatch(p[3:], name) or fnmatch.fnmatchcase(name, p):
            return True
    return False


def fused_groups(names: Iterable[str]) -> list[list[str]]:
    """Groups of module names (same parent) that engines fuse, e.g. ``[a.q_proj, a.k_proj, a.v_proj]``."""
    names = set(names)
    groups = []
    for members in FUSED_GROUPS:
        for name in sorted(names):
            parent, _, leaf = name.rpartition(".")
            if leaf == members[0]:
                group = [f"{parent}.{m}" if parent else m for m in members]
                if all(g in names for g in group):
                    groups.append(group)
    return groups


def assign_formats(names: Iterable[str], format: str, layer_formats: Mapping[str, str] | None = None) -> dict[str, str]:
    """The format of each module name: that of the first ``layer_formats`` pattern (glob or ``re:``)
    it matches, else ``format``. Raises ``ValueError`` for an unknown format or an invalid pattern, and
    where siblings that engines fuse (q/k/v, gate/up: :data:`FUSED_GROUPS`) would get different
    formats: they run as one GEMM in vLLM and share tensor scales and smoothing here."""
    layer_formats = dict(layer_formats or {})
    check_patterns(layer_formats, "layer_formats")
    for f in (format, *layer_formats.values()):
        get_format(f)
    out = {n: next((f for p, f in layer_formats.items() if matches(n, [p])), format) for n in names}
    check_shared_formats(out)
    return out


_EXPERT = re.compile(r"(.+\.experts)\.\d+\.[^.]+")  # a per-expert Linear: ...experts.{e}.gate_proj


def shared_format_groups(names: Iterable[str]) -> list[list[str]]:
    """Groups of module ``names`` that must have one format: the siblings engines fuse into one GEMM
    (:data:`FUSED_GROUPS`, those present), and every expert Linear of an MoE block (vLLM builds one
    quantized MoE layer from them)."""
    names = list(names)
    groups: dict[str, list[str]] = {}
    for name in names:
        expert = _EXPERT.fullmatch(name)
        parent, _, leaf = name.rpartition(".")
        fused = next((i for i, members in enumerate(FUSED_GROUPS) if leaf in members), None)
        if expert:
            groups.setdefault(expert.group(1), []).append(name)
        elif fused is not None:
            groups.setdefault(f"{parent}/{fused}", []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def check_shared_formats(formats: Mapping[str, str]) -> None:
    """Raise ``ValueError`` where a :func:`shared_format_groups` group has different ``formats``
    (module name -> format)."""
    for group in shared_format_groups(formats):
        by_format: dict[str, list[str]] = {}
        for name in group:
            by_format.setdefault(formats[name], []).append(name)
        if len(by_format) > 1:
            shown = ", ".join(f"{m[0]}{f' (and {len(m) - 1} more)' if len(m) > 1 else ''} -> {f}" for f, m in by_format.items())
            raise ValueError(f"{shown}: engines run these as one GEMM or one MoE layer, so they must share a format; "
                             "widen or narrow the layer_formats pattern")


def sqnr_db(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10·log10(|w|² / |w - ŵ|²)`` in dB."""
    noise = (w.double() - w_hat.double()).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(w.double().pow(2).sum().item() / noise)


def _plan(model: nn.Module, fmt_name: str, ignore: Iterable[str],
          layer_formats: Mapping[str, str] | None) -> tuple[dict[str, nn.Linear], list[LayerResult]]:
    check_patterns(ignore)
    ignore = tuple(ignore)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    formats = assign_formats(linears, fmt_name, layer_formats)
    chosen, skipped = {}, []
    for name, module in linears.items():
        shape = tuple(module.weight.shape)
        k_multiple = get_format(formats[name]).k_multiple
        if matches(name, ignore):
            skipped.append(LayerResult(name, shape, "ignored by pattern"))
        elif module.in_features % k_multiple:
            skipped.append(LayerResult(name, shape, f"K={module.in_features} not divisible by {k_multiple} ({formats[name]})"))
        else:
            chosen[name] = module
    for name in router_names(model):
        skipped.append(LayerResult(name, tuple(model.get_submodule(name).weight.shape), "MoE router: kept in high precision"))
    for name, module in model.named_modules():
        if is_fused_experts(module):  # fused MoE experts [E, N, K] linearize_experts could not split
            reason = f"fused expert weights left unquantized: {unsupported_reason(module) or 'not linearized'}"
            for pname, param in module.named_parameters(recurse=False):
                skipped.append(LayerResult(f"{name}.{pname}", tuple(param.shape), reason))
    return chosen, skipped


def plan_layers(model: nn.Module, format: str, ignore: Iterable[str] | None = None,
                layer_formats: Mapping[str, str] | None = None) -> tuple[dict[str, nn.Linear], list[LayerResult]]:
    """The Linear layers :func:`quantize_model` would quantize, and those it would skip (with reasons).

    Fused MoE experts count as skipped until :func:`quantkit.nn.experts.linearize_experts` has
    split them into per-expert Linears (as :func:`quantize_model` does first)."""
    return _plan(model, format, DEFAULT_IGNORE if ignore is None else ignore, layer_formats)


def shared_weight_amax(layers: Mapping[str, nn.Linear]) -> dict[str, torch.Tensor]:
    """Per layer, the weight amax its tensor scale derives from: the max over its fused group."""
    amax = {n: m.weight.detach().float().abs().amax() for n, m in layers.items()}
    for group in fused_groups(layers):
        shared = torch.stack([amax[n] for n in group]).max()
        amax.update({n: shared for n in group})
    return amax


def rtn_quantize(layers: Mapping[str, nn.Linear], formats: Mapping[str, str]) -> dict[str, QuantizedWeight]:
    """Round-to-nearest weights for ``layers`` in their ``formats`` (by name), fused groups sharing one tensor scale."""
    amax = shared_weight_amax(layers)
    out = {}
    for name, m in layers.items():
        fmt = get_format(formats[name])
        w = m.weight.detach().float()
        scale, ts = fmt.weight.compute_scales(w, amax[name])
        out[name] = fmt.quantize_weight(w, scale, ts)
    return out


def check_finite(model: nn.Module) -> None:
    """Raise ``ValueError`` naming the parameters of ``model`` that hold NaN or Inf (a norm or an
    embedding row as much as a Linear weight: each poisons every output it reaches)."""
    bad = [f"{name} ({int((~torch.isfinite(p)).sum())} values)" for name, p in model.named_parameters()
           if p.is_floating_point() and not p.is_meta and not torch.isfinite(p).all()]
    if bad:
        raise ValueError(f"the model's weights contain NaN or Inf: {', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''}")


def quantize_model(model: nn.Module, format: str = "nvfp4", ignore: Iterable[str] | None = None, *,
                   layer_formats: Mapping[str, str] | None = None,
                   qweights: Mapping[str, QuantizedWeight] | None = None,
                   input_scales: Mapping[str, torch.Tensor] | None = None) -> QuantizationReport:
    """Replace every eligible ``nn.Linear`` of ``model`` by a :class:`QuantLinear`, in place.

    Fused MoE experts are first split into per-expert Linears (:func:`~quantkit.nn.experts.linearize_experts`,
    named ``...experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``; gate and up share tensor scales).
    Layers matching ``ignore`` (glob or ``re:`` patterns; default :data:`DEFAULT_IGNORE`) or whose K
    is not a multiple of the format's block are left as they are and reported with the reason, as
    are fused experts of a layout that cannot be split. ``layer_formats`` maps patterns to formats
    for the layers they match (first match wins, see :func:`assign_formats`); the rest get ``format``.
    ``qweights`` / ``input_scales`` (by module name) come from calibration; missing weights are
    quantized round-to-nearest. A model with NaN or Inf in any parameter is refused
    (:func:`check_finite`). Returns a :class:`QuantizationReport`.
    """
    get_format(format)
    check_finite(model)
    linearize_experts(model)
    layers, skipped = plan_layers(model, format, ignore, layer_formats)
    formats = assign_formats(layers, format, layer_formats)
    missing = {n: m for n, m in layers.items() if not qweights or n not in qweights}
    chosen = {**rtn_quantize(missing, formats), **{n: q for n, q in (qweights or {}).items() if n in layers}}
    report = QuantizationReport(format, skipped)
    for name, linear in layers.items():
        qw = chosen[name]
        q = QuantLinear.from_linear(linear, formats[name], qweight=qw, input_scale=(input_scales or {}).get(name))
        w = linear.weight.detach()
        report.layers.append(LayerResult(
            name, tuple(w.shape), format=formats[name], sqnr_db=sqnr_db(w, qw.dequantize()),
            bytes_before=w.numel() * w.element_size(),
            bytes_after=sum(t.numel() * t.element_size() for t in (q.weight, q.weight_scale))))
        model.set_submodule(name, q)
    _untie_quantized_head(model)
    return report


def _untie_quantized_head(model: nn.Module) -> None:
    """A quantized output layer no longer shares the embedding matrix: clear the config's
    ``tie_word_embeddings`` (else a later ``tie_weights()`` puts the float embedding in place of its
    packed weight)."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    config = getattr(model, "config", None)
    if isinstance(head, QuantLinear) and config is not None:
        for cfg in {id(c): c for c in (config, getattr(config, "get_text_config", lambda: config)())}.values():
            if getattr(cfg, "tie_word_embeddings", False):
                cfg.tie_word_embeddings = False
