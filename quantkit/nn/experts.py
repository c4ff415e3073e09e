"""Fused MoE experts as per-expert ``nn.Linear`` layers, so they can be calibrated and quantized.

transformers 5 stores a MoE block's experts as 3-D parameters of one ``...Experts`` module
(``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, or transposed, optionally with biases).
The module is decorated with ``use_experts_implementation``, which records the layout on each
instance: ``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated`` (``[gate; up]``
halves, else interleaved ``gate0, up0, gate1, ...`` rows) and ``has_post_expert_norm``; the
gating function is the class's ``_apply_gate`` on the fused ``[S, 2I]`` projection.

:func:`linearize_experts` replaces every such module by a :class:`LinearExperts`: a
``ModuleList`` of :class:`ExpertMLP` (``gate_proj``, ``up_proj``, ``down_proj``), so expert ``e``'s
layers are named ``experts.{e}.gate_proj`` etc., the names of the hub checkpoints and of vLLM's MoE
loaders. Weights are views of the fused tensors where the layout allows it (no second copy).
:func:`calibrating_all_experts` makes every expert see every token during calibration while the
block output keeps the router's top-k combination.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

_LAYOUT = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


class ExpertMLP(nn.Module):
    """One expert: ``down_proj(gate(gate_proj(x), up_proj(x)))`` for ``x [S, H]`` → ``[S, H]``.

    ``gate(g, u)`` (both ``[S, I]``) is the model's gating, e.g. ``silu(g) * u``."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor, gate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return self.down_proj(gate(self.gate_proj(x), self.up_proj(x)))


class LinearExperts(nn.ModuleList):
    """Drop-in for a transformers fused experts module, one :class:`ExpertMLP` per expert.

    ``forward(hidden_states [T, H], top_k_index int [T, k], top_k_weights [T, k]) -> [T, H]``:
    ``Σ_j w[t, j] · expert_{idx[t, j]}(x[t])``, as the fused module computes it (indices outside
    ``[0, E)``, expert-parallel sentinels, contribute nothing). ``interleaved`` / ``transposed``:
    the fused layout it replaced (gate/up rows alternating; ``[E, K, N]`` storage). With
    ``calibrate_all`` set, every expert runs on all ``T`` tokens (so hooks on its layers see them
    all) and the output still combines only the routed ones.
    """

    def __init__(self, experts: list[ExpertMLP], gate_fn: Callable[[torch.Tensor], torch.Tensor], *,
                 interleaved: bool = False, transposed: bool = False):
        super().__init__(experts)
        self._gate_fn = gate_fn  # the fused module's gating on [S, 2I] (a plain attribute: no tensors)
        self.interleaved, self.transposed = interleaved, transposed  # the fused layout it replaced
        self.calibrate_all = False

    def gate(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The model's gating of ``g, u [S, I]`` → ``[S, I]``, through its fused ``[S, 2I]`` layout."""
        fused = torch.stack((g, u), -1).flatten(-2) if self.interleaved else torch.cat((g, u), -1)
        return self._gate_fn(fused)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            pos, tokens = torch.where((top_k_index == e).T)
            if self.calibrate_all:
                y = expert(hidden_states, self.gate)[tokens]
            elif tokens.numel():
                y = expert(hidden_states[tokens], self.gate)
            else:
                continue
            out.index_add_(0, tokens, (y * top_k_weights[tokens, pos, None]).to(out.dtype))
        return out


def unsupported_reason(module: nn.Module) -> str | None:
    """Why fused experts ``module`` cannot become a :class:`LinearExperts` (``None`` if it can)."""
    missing = [a for a in _LAYOUT if not hasattr(module, a)]
    if missing:
        return f"{type(module).__name__} has no transformers experts layout attributes ({', '.join(missing)})"
    if not module.has_gate:
        return f"{type(module).__name__}: experts without gate_up_proj (up_proj only) are not supported"
    if getattr(module, "has_post_expert_norm", False):
        return f"{type(module).__name__}: experts with a post-expert norm are not supported"
    params = dict(module.named_parameters(recurse=False))
    for name in ("gate_up_proj", "down_proj") + (("gate_up_proj_bias", "down_proj_bias") if module.has_bias else ()):
        if name not in params:
            return f"{type(module).__name__} has no {name} parameter"
    extra = sorted(set(params) - {"gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"})
    if extra:
        return f"{type(module).__name__} has parameters {extra} beside the expert projections"
    return None


def is_fused_experts(module: nn.Module) -> bool:
    """True for a module holding 3-D expert weights (a ``gate_up_proj``, ``up_proj`` or ``down_proj``
    parameter with ``dim == 3``)."""
    return any(p.dim() == 3 for n, p in module.named_parameters(recurse=False) if n in ("gate_up_proj", "up_proj", "down_proj"))


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, requires_grad: bool) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight [N, K]`` (and ``bias [N]``) as they are: views stay views."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=requires_grad)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=requires_grad)
    return linear


def to_linear_experts(module: nn.Module) -> LinearExperts:
    """A :class:`LinearExperts` computing what fused experts ``module`` computes (see
    :func:`unsupported_reason` for the layouts accepted). The fused parameters are removed from
    ``module``; per-expert weights are views of them when the layout is concatenated and not
    transposed (Qwen-MoE, Mixtral, DeepSeek, ...), copies otherwise (gpt-oss)."""
    reason = unsupported_reason(module)
    if reason:
        raise ValueError(reason)
    gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
    gate_up_bias = module.gate_up_proj_bias.detach() if module.has_bias else None
    down_bias = module.down_proj_bias.detach() if module.has_bias else None
    interleaved = not module.is_concatenated
    inter = gate_up.shape[2 if module.is_transposed else 1] // 2
    halves = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (slice(0, inter), slice(inter, None))

    def weight(fused: torch.Tensor) -> torch.Tensor:  # [N, K] of one expert, transposed storage undone
        return fused.T if module.is_transposed else fused

    grad = module.gate_up_proj.requires_grad
    experts = []
    for e in range(gate_up.shape[0]):
        gate_w, up_w = (weight(gate_up[e])[h].contiguous() for h in halves)  # contiguous views stay views
        gate_b, up_b = (None, None) if gate_up_bias is None else (gate_up_bias[e, h].contiguous() for h in halves)
        down_b = None if down_bias is None else down_bias[e]
        experts.append(ExpertMLP(_linear(gate_w, gate_b, grad), _linear(up_w, up_b, grad),
                                 _linear(weight(down[e]).contiguous(), down_b, grad)))
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        module._parameters.pop(name, None)
    return LinearExperts(experts, module._apply_gate, interleaved=interleaved, transposed=module.is_transposed)


def linearize_experts(model: nn.Module) -> dict[str, str]:
    """Replace, in place, every transformers fused experts module of ``model`` by a
    :class:`LinearExperts`; return ``{module name: reason}`` for those left fused."""
    skipped = {}
    for name, module in list(model.named_modules()):
        if not is_fused_experts(module):
            continue
        reason = unsupported_reason(module)
        if reason:
            skipped[name] = reason
            continue
        model.set_submodule(name, to_linear_experts(module))
    return skipped


def expert_modules(model: nn.Module) -> Iterator[LinearExperts]:
    """The :class:`LinearExperts` modules of ``model``."""
    return (m for m in model.modules() if isinstance(m, LinearExperts))


def router_names(model: nn.Module) -> list[str]:
    """Names of the routers of ``model``'s :class:`LinearExperts`: sibling modules holding a 2-D
    ``weight [E, H]`` (transformers 5 routers are such modules, not ``nn.Linear``)."""
    names = []
    for parent_name, parent in model.named_modules():
        experts = [m for m in parent.children() if isinstance(m, LinearExperts)]
        for name, child in parent.named_children():
            weight = getattr(child, "weight", None)
            if (experts and not isinstance(child, (LinearExperts, nn.Linear)) and isinstance(weight, torch.Tensor)
                    and weight.dim() == 2 and weight.shape[0] == len(experts[0])):
                names.append(f"{parent_name}.{name}" if parent_name else name)
    return names


def shared_input_groups(model: nn.Module) -> list[list[str]]:
    """Per :class:`LinearExperts` of ``model``, the names of all its experts' ``gate_proj`` and
    ``up_proj``: under :func:`calibrating_all_experts` they all receive the same input tensor, so
    one set of input statistics serves them all."""
    return [[f"{name}.{e}.{p}" for e in range(len(m)) for p in ("gate_proj", "up_proj")]
            for name, m in model.named_modules() if isinstance(m, LinearExperts)]


@contextmanager
def calibrating_all_experts(model: nn.Module) -> Iterator[None]:
    """Within the block, every :class:`LinearExperts` of ``model`` runs all experts on all tokens."""
    modules = list(expert_modules(model))
    for m in modules:
        m.calibrate_all = True
    try:
        yield
    finally:
        for m in modules:
            m.calibrate_all = False
