"""Norm tweaking: once a decoder layer's weights are rounded, adjust the gains of its normalization
layers (RMSNorm / LayerNorm weights, kept in float in every export) so that the quantized layer
reproduces the float layer's output (Li et al., 2023, "Norm Tweaking: High-performance Low-bit
Quantization of Large Language Models").

Tune stage, after rounding: the quantized weights stay as the round stage made them. The loss is
``Σ ‖layer_q(x) − layer(x)‖²`` over the calibration batches, with ``layer_q`` running the rounded
weights and the format's activation quantization (straight-through), the same objective as
AutoRound's ``target="layer"``. Unlike AutoRound's per-weight offsets, only a few thousand gains
per layer learn (Gemma-3-270M: 4 norms of 640 and 2 of 256), so 4096 calibration tokens do not
overfit them the same way. Adam, ``iters`` steps of ``lr``; the gains of the step with the lowest
loss are kept (the unchanged ones if none is lower).
"""
from __future__ import annotations

import torch
from torch import nn

from quantkit.calibrate.algorithms.base import Algorithm, LayerContext
from quantkit.calibrate.algorithms.layer_loss import output_error, quantized_layer


def norm_gains(block: nn.Module) -> list[nn.Parameter]:
    """The weight parameters of ``block``'s normalization modules (``*RMSNorm``, ``*LayerNorm``)."""
    return [m.weight for m in block.modules()
            if type(m).__name__.endswith(("RMSNorm", "LayerNorm")) and isinstance(getattr(m, "weight", None), nn.Parameter)]


class NormTweak(Algorithm):
    """Tune stage: learn the layer's normalization gains against its output error (module doc)."""

    name = "normtweak"
    stage = "tune"

    def __init__(self, iters: int = 20, lr: float = 1e-3):
        self.iters, self.lr = iters, lr

    def apply(self, ctx: LayerContext) -> None:
        gains = norm_gains(ctx.block)
        if not gains or not self.iters:
            return
        target = [t.float() for t in ctx.run_block()]  # the float layer: its Linears are not swapped yet
        dequantized = {n: q.dequantize().float() for n, q in ctx.qweights.items()}
        best, best_loss = [g.detach().clone() for g in gains], None
        opt = torch.optim.Adam(gains, lr=self.lr)
        with quantized_layer(ctx, dequantized.__getitem__, trainable=gains):
            for it in range(self.iters + 1):
                step = it < self.iters  # else: the last pass, loss only
                loss = output_error(ctx, target, backward=step)
                if best_loss is None or loss < best_loss:
                    best, best_loss = [g.detach().clone() for g in gains], loss
                if step:
                    opt.step()
                    opt.zero_grad()
        with torch.no_grad():
            for g, b in zip(gains, best):
                g.copy_(b)
