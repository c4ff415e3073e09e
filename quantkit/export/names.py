"""Checkpoint tensor names: those of the model's original hub checkpoint, which vLLM loads.

transformers 5 renames some models' tensors on load and reverts that on ``save_pretrained``
(``transformers.conversion_mapping``): Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``
become ``mlp.experts.gate_up_proj``. A quantized model's experts are per-expert Linears
(:class:`~quantkit.nn.experts.LinearExperts`), so :class:`CheckpointNames` asks transformers' own
reverse conversion where each per-expert and every other tensor goes, by running it on a
placeholder state dict of the fused layout whose elements are unique ids. A tensor the reversal
does not merely rename (merged with others: gpt-oss keeps fused ``gate_up_proj`` on the hub; or
split: experts left fused, fused convolutions) keeps the model's name (for experts
``experts.{e}.gate_proj`` etc., the per-expert naming of llm-compressor and vLLM).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from quantkit.nn.experts import LinearExperts

_PROJECTIONS = ("gate_proj", "up_proj")


def _fused_placeholders(prefix: str, experts: LinearExperts, ids: list[str]) -> dict[str, torch.Tensor]:
    """Placeholders of the fused tensors ``experts`` replaced, each element the index in ``ids`` of
    the per-expert tensor it stands for (``[E, 2, 1]`` gate/up rows, transposed ``[E, 1, 2]``)."""

    def new(name: str) -> float:
        ids.append(name)
        return float(len(ids) - 1)

    first = experts[0]
    out = {}
    for suffix in ("", "_bias") if first.gate_proj.bias is not None else ("",):
        leaf = "bias" if suffix else "weight"
        gate_up = torch.tensor([[new(f"{prefix}.{e}.{p}.{leaf}") for p in _PROJECTIONS] for e in range(len(experts))],
                               dtype=torch.float64)
        down = torch.tensor([new(f"{prefix}.{e}.down_proj.{leaf}") for e in range(len(experts))], dtype=torch.float64)
        if not suffix:
            gate_up, down = gate_up[:, :, None], down[:, None, None]
            if experts.transposed:
                gate_up = gate_up.transpose(1, 2)
        else:
            down = down[:, None]
        out[f"{prefix}.gate_up_proj{suffix}"], out[f"{prefix}.down_proj{suffix}"] = gate_up, down
    return out


def _reverted(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' ``save_pretrained`` renaming of ``state`` for ``model``, as if the model had been
    loaded from its hub checkpoint: the class's whole default mapping, including the prefix changes
    that ``save_pretrained`` drops for a model built from a config (SigLIP towers lose
    ``vision_model.`` on load), and never the mapping recorded by ``from_pretrained``, so that save
    and load (which builds the model from its config) agree. ``state`` if none applies."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    if not isinstance(model, PreTrainedModel):
        return state
    recorded = model.__dict__.pop("_weight_conversions", None)
    try:
        model._weight_conversions = get_model_conversion_mapping(model, add_legacy=False) or None
        return revert_weight_conversion(model, state)
    finally:
        model.__dict__.pop("_weight_conversions", None)
        if recorded is not None:
            model._weight_conversions = recorded


class CheckpointNames:
    """Where each of ``model``'s tensors goes in a checkpoint: :meth:`tensor` for a ``state_dict``
    key, :meth:`module` for a module (a quantized Linear's tensors are ``module(name) + "." + leaf``)."""

    def __init__(self, model: nn.Module):
        ids: list[str] = []
        state: dict[str, torch.Tensor] = {}
        inside = set()
        for name, module in model.named_modules():
            if isinstance(module, LinearExperts):
                state.update(_fused_placeholders(name, module, ids))
                inside.update(f"{name}.{n}" for n, _ in module.named_modules() if n)
        for key, t in model.state_dict(keep_vars=True).items():
            if key.rpartition(".")[0] not in inside:  # size 2 per dimension: a split shows as two outputs
                ids.append(key)
                state[key] = torch.full((2,) * t.dim(), float(len(ids) - 1), dtype=torch.float64)
        outputs: Counter[int] = Counter()
        renamed = {}
        for disk_name, t in _reverted(model, state).items():
            values = [int(v) for v in torch.as_tensor(t).flatten().unique()]
            outputs.update(values)
            if len(values) == 1:
                renamed[values[0]] = disk_name
        # a pure renaming: the tensor goes whole to one checkpoint tensor (not split, not merged)
        self._to_disk = {ids[i]: name for i, name in renamed.items() if outputs[i] == 1}
        self._from_disk = {v: k for k, v in self._to_disk.items()}

    def tensor(self, key: str) -> str:
        """The checkpoint name of ``state_dict`` key ``key`` (``key`` itself when not renamed)."""
        return self._to_disk.get(key, key)

    def module(self, name: str) -> str:
        """The checkpoint prefix of module ``name``: where its ``weight`` goes, less ``.weight``."""
        disk = self._to_disk.get(f"{name}.weight", f"{name}.weight")
        return disk[: -len(".weight")] if disk.endswith(".weight") else name

    def model_key(self, disk_name: str) -> str:
        """The ``state_dict`` key of checkpoint tensor ``disk_name`` (inverse of :meth:`tensor`)."""
        return self._from_disk.get(disk_name, disk_name)
