"""Checkpoints vLLM loads: compressed-tensors (llm-compressor's layout) and NVIDIA ModelOpt.

::

    quantkit.save(model, "out/", export="compressed-tensors")   # or export="modelopt"
    model = quantkit.load("out/")                                # QuantLinear layers, eval mode
    quantkit.export.describe("out/")                             # what `quantkit inspect` prints

Modules: :mod:`.io` (atomic directory writes, safetensors, checked reads), :mod:`.layout`
(per-tensor conversions), :mod:`.compressed_tensors` and :mod:`.modelopt` (the two flavours),
:mod:`.checkpoint` (save / load / describe).
"""
from quantkit.export.checkpoint import FLAVOURS, describe, load, save
from quantkit.export.io import CheckpointError

__all__ = ["FLAVOURS", "CheckpointError", "describe", "load", "save"]
