"""Inference-time fusion of sibling projections that read one input (q/k/v, gate/up): one GEMM over
their row-concatenated weight instead of one per projection, as serving engines run them.

transformers calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` one after another. After
:func:`fuse_projections` each of them is a :class:`ProjectionSlice` of one
:class:`FusedProjections`: the first call on an input runs the fused GEMM and the calls on the
same tensor object take their column slices of its output (views, no copy); a call on another
tensor runs the GEMM again, so any call order stays correct (an input modified in place between
the members' calls would not be seen; transformers does not do that). The output is released once
every member has taken its slice. Works eagerly, under CUDA-graph capture and inside one
``torch.compile`` graph.

The fused GEMM computes what the members compute, bit for bit, in every format but
``nvfp4-w4a8``: that format picks W4A16 or W4A8 by the token count *and* the weight's rows
(:func:`quantkit.formats.w4a8.use_w4a8`), and the fused weight has more rows, so between the two
thresholds the fused GEMM takes W4A8 where the members would take W4A16 (both are the format's
function; they differ by W4A8's FP8 rounding of the activations and weights).

Fusion is for running a model, not for saving it: :func:`quantkit.save` refuses a fused model.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from quantkit.formats import QuantizedWeight, get_format
from quantkit.nn.linear import QuantLinear
from quantkit.nn.swap import fused_groups


class FusedProjections(nn.Module):
    """``fused`` (an ``nn.Linear`` or :class:`QuantLinear` of ``sum(sizes)`` outputs) computing
    the members' outputs as column slices of ``sizes``."""

    def __init__(self, fused: nn.Module, sizes: tuple[int, ...]):
        super().__init__()
        self.fused, self.sizes = fused, sizes
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] | None = None
        self._pending: set[int] = set()

    def take(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Member ``index``'s output ``[..., sizes[index]]`` for input ``x [..., K]``."""
        if self._input is not x or index not in self._pending:
            self._input, self._outputs = x, self.fused(x).split(self.sizes, dim=-1)
            self._pending = set(range(len(self.sizes)))
        out = self._outputs[index]
        self._pending.discard(index)
        if not self._pending:
            self._input = self._outputs = None
        return out

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}"


class ProjectionSlice(nn.Module):
    """Stands in for member ``index`` of a :class:`FusedProjections` (held outside the module
    tree, so its weights are counted once)."""

    def __init__(self, group: FusedProjections, index: int):
        super().__init__()
        self.__dict__["group"] = group
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.take(x, self.index)

    def extra_repr(self) -> str:
        return f"index={self.index}, out_features={self.group.sizes[self.index]}"


def straddling_members(sizes: Sequence[int], rows: int) -> list[int]:
    """Indexes of the members (output sizes ``sizes``, stacked in order) whose last ``rows``-row
    scale block would reach into the next member: all but the last must fill whole blocks
    (vLLM stacks q/k/v and gate/up by the same rule). None for ``rows`` <= 1."""
    return [i for i, n in enumerate(sizes[:-1]) if rows > 1 and n % rows]


def concat_rows(qweights: list[QuantizedWeight]) -> QuantizedWeight:
    """The :class:`QuantizedWeight` of the members' rows stacked (``[sum N_i, K]``): values and
    block scales concatenated along the rows. Raises ``ValueError`` where that is not the same
    weights: different formats or K, a scale block that would straddle two members, or
    per-tensor / tensor scales that differ."""
    fmt = get_format(qweights[0].format)
    k = qweights[0].shape[1]
    if any(q.format != fmt.name or q.shape[1] != k for q in qweights):
        raise ValueError("members differ in format or in_features")
    rows = fmt.weight.block[0]
    ref = qweights[0]
    if ref.tensor_scale is not None and any(not torch.equal(q.tensor_scale, ref.tensor_scale) for q in qweights):
        raise ValueError("members have different tensor scales")
    if rows == 0:  # one scale for all rows of a member
        if any(not torch.equal(q.scale, ref.scale) for q in qweights):
            raise ValueError("members have different per-tensor scales")
        scale = ref.scale
    else:
        if straddling_members([q.shape[0] for q in qweights], rows):
            raise ValueError(f"a member's rows are not a multiple of the {rows}-row scale block")
        scale = torch.cat([q.scale for q in qweights])
    n = sum(q.shape[0] for q in qweights)
    return QuantizedWeight(fmt.name, torch.cat([q.data for q in qweights]), scale, ref.tensor_scale, (n, k))


def _fuse(members: list[nn.Module]) -> nn.Module:
    """One module computing the concatenated outputs of ``members`` (all ``nn.Linear`` or all
    :class:`QuantLinear`, one input size, bias all or none)."""
    first = members[0]
    has_bias = first.bias is not None
    if any(type(m) is not type(first) or m.in_features != first.in_features or (m.bias is not None) != has_bias
           for m in members):
        raise ValueError("members differ in type, in_features or bias")
    n = sum(m.out_features for m in members)
    bias = torch.cat([m.bias.detach() for m in members]) if has_bias else None
    if isinstance(first, QuantLinear):
        scales = [m.input_scale for m in members]
        if any((s is None) != (scales[0] is None) or (s is not None and not torch.equal(s, scales[0])) for s in scales):
            raise ValueError("members have different input scales")
        fused = QuantLinear(first.in_features, n, has_bias, format=first.format, static_input=scales[0] is not None,
                            dtype=bias.dtype if has_bias else torch.bfloat16, device=first.weight.device)
        fused.load_quantized(concat_rows([m.qweight for m in members]), scales[0])
    else:
        fused = nn.Linear(first.in_features, n, has_bias, dtype=first.weight.dtype, device=first.weight.device)
        fused.weight.data.copy_(torch.cat([m.weight.detach() for m in members]))
    if has_bias:
        fused.bias.data.copy_(bias)
    fused.requires_grad_(False)
    return fused


def fuse_projections(model: nn.Module) -> list[str]:
    """Fuse each group of sibling projections engines fuse (``q/k/v_proj``, ``gate/up_proj``,
    ``w1/w3``; :data:`quantkit.nn.swap.FUSED_GROUPS`), ``nn.Linear`` or :class:`QuantLinear`, in
    place. Groups whose weights cannot be stacked exactly (see :func:`concat_rows`) stay as they
    are. Returns the fused groups' module names, e.g. ``model.layers.0.self_attn.q_proj+k_proj+v_proj``."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, QuantLinear))}
    done = []
    for group in fused_groups(linears):
        members = [linears[name] for name in group]
        try:
            fused = FusedProjections(_fuse(members), tuple(m.out_features for m in members))
        except ValueError:
            continue
        parent_name, _, _ = group[0].rpartition(".")
        parent = model.get_submodule(parent_name)
        leaves = [name.rpartition(".")[2] for name in group]
        parent.add_module("fused_" + "_".join(leaf.removesuffix("_proj") for leaf in leaves), fused)
        for index, leaf in enumerate(leaves):
            setattr(parent, leaf, ProjectionSlice(fused, index))
        done.append(f"{group[0]}+{'+'.join(leaves[1:])}")
    return done
