"""AutoRound: rounding learned by signed gradient descent on the decoder layer's output error
(Cheng et al., 2023, "Optimize Weight Rounding via Signed Gradient Descent").

Each weight element ``w`` gets an offset ``v ∈ [−½, ½]`` of its local grid step ``δ(w)`` (the
spacing of the format's values around ``w`` under its block scale), and is quantized as
``q(w + v·δ(w))``: ``v`` can move any element to the grid point on its other side. All the ``v`` of
a decoder layer are learned together, minimising ``Σ ‖layer_q(x) − layer(x)‖²`` over the
calibration batches, where ``layer_q`` runs every Linear with its weights *and its inputs*
quantized as the deployed layer will (static activation scales from the calibration amax), with
straight-through gradients. Unlike GPTQ, the objective sees the activation quantization of W4A4
formats and the nonlinearities between the layer's Linears.

Round stage: the block scales come from the scales stage (MSE, else the amax rule) and stay fixed.
Each iteration takes one step ``v ← clamp(v − lr·sign(∂loss/∂v), ±½)`` on the gradient summed
over all batches (``lr`` decays linearly to 0 from ``5·10⁻³``: AutoRound's ``1/iters`` is 0.05 at
20 iterations, which flipped ~17 % of the roundings in one step on Gemma-3-270M and raised the
layer loss 100×); the offsets of the iteration with the lowest loss are kept (``v = 0``, round
to nearest, if none is lower). The last pass only measures the loss of the last step.

With ``batches_per_step = b > 0`` (AutoRound's own scheme: 8 samples per step over 128) the first
step still takes every batch, and each later step the next ``b`` of the calibration batches,
cycling through them in a fixed shuffled order; losses over different batches do not compare, so
the last offsets are kept unless their loss over all batches is above round to nearest's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.calibrate.algorithms.base import Algorithm, LayerContext, check_option
from quantkit.calibrate.algorithms.mse import qdq
from quantkit.formats import Format
from quantkit.formats.codecs import e8m0_decode


def grid_step(fmt: Format, w: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
    """FP32 ``[N, K]``: the spacing of ``fmt``'s representable weights at each element of ``w``
    under the given scales, i.e. ``S·2^(max(⌊log2 |w/S|⌋, emin) − mantissa bits)`` with ``S`` the
    element's dequantized block scale (E2M1: emin 0, 1 bit; E4M3: emin −6, 3 bits)."""
    n, k = w.shape
    s = e8m0_decode(scale) if scale.dtype == torch.uint8 else scale.float()
    if tensor_scale is not None:
        s = s * tensor_scale.float()
    br, bc = fmt.weight.block
    s = s.repeat_interleave(br or n, 0)[:n].repeat_interleave(bc or k, 1)[:, :k].to(w.device)
    fp8_values = fmt.weight.storage(n, k)[0][1] == torch.float8_e4m3fn
    emin, mbits = (-6, 3) if fp8_values else (0, 1)
    exponent = torch.floor(torch.log2((w / s).abs().clamp(min=2.0 ** emin)))
    return torch.exp2(exponent - mbits) * s


class AutoRound(Algorithm):
    """Round stage: learned rounding offsets (see the module doc). ``iters``: signed-gradient
    steps per decoder layer, each a forward and backward pass over all calibration batches;
    ``lr``: the first step's size, in grid steps. ``target``: what the quantized layer should
    reproduce — ``"layer"``, the float layer's output on the same inputs (those of the already
    quantized layers before it), or ``"model"``, the float model's output at this layer
    (AutoRound's choice: the layer also corrects the error of the layers before it; costs one
    more float pass per layer and a third copy of the hidden states). ``batches_per_step``: 0, every
    calibration batch in each step; else that many per step (see the module doc)."""

    name = "autoround"
    stage = "round"

    def __init__(self, iters: int = 50, lr: float = 5e-3, target: str = "layer", batches_per_step: int = 0):
        if target not in ("layer", "model"):
            raise ValueError(f"autoround target must be 'layer' or 'model', got {target!r}")
        if batches_per_step < 0:
            raise ValueError(f"autoround batches_per_step must be >= 0, got {batches_per_step}")
        check_option("autoround", "iters", iters, int, 0)
        check_option("autoround", "lr", lr, float, 0)
        self.iters, self.lr, self.batches_per_step = iters, lr, batches_per_step
        self.needs_float_targets = target == "model"

    def apply(self, ctx: LayerContext) -> None:
        fmt = {n: ctx.format_of(n) for n in ctx.linears}
        weights = {n: m.weight.detach().float() for n, m in ctx.linears.items()}
        scales = {n: ctx.rtn_scales(n) for n in weights}
        steps = {n: grid_step(fmt[n], w, *scales[n]) for n, w in weights.items()}
        offsets = {n: torch.zeros_like(w) for n, w in weights.items()}
        input_scales = ctx.input_scales()
        target = [t.float() for t in (ctx.targets if ctx.targets is not None else ctx.run_block())]
        quantized: dict[str, torch.Tensor] = {}  # this iteration's dequantized weights, gradient leaves

        def quantized_forward(name: str, linear: torch.nn.Linear):
            act = fmt[name].activation

            def forward(x: torch.Tensor) -> torch.Tensor:
                if act is not None:  # straight-through: the gradient passes the rounding unchanged
                    x = x + (act.qdq(x, input_scales.get(name)).to(x.dtype) - x).detach()
                return F.linear(x, quantized[name].to(x.dtype), linear.bias)
            return forward

        frozen = [p for p in ctx.block.parameters() if p.requires_grad]
        for p in frozen:  # only the quantized weights take gradients
            p.requires_grad_(False)
        for name, linear in ctx.linears.items():
            linear.forward = quantized_forward(name, linear)
        every = list(range(len(target)))
        cycle = torch.randperm(len(target), generator=torch.Generator().manual_seed(0)).tolist()
        best, best_loss = dict(offsets), None
        try:
            for it in range(self.iters + 1):
                step = it < self.iters  # else: the last pass, loss only
                full = not self.batches_per_step or it == 0 or not step  # this pass takes every batch
                batches = every if full else [cycle[(j + (it - 1) * self.batches_per_step) % len(cycle)]
                                              for j in range(self.batches_per_step)]
                with torch.set_grad_enabled(step):
                    for name, w in weights.items():
                        quantized[name] = qdq(fmt[name], w + offsets[name] * steps[name], *scales[name]).requires_grad_(step)
                    loss = 0.0
                    for b in batches:
                        err = (ctx.run_block([b])[0].float() - target[b]).pow(2).sum()
                        if step:
                            err.backward()
                        loss += err.item()
                if full and (best_loss is None or loss < best_loss):
                    best, best_loss = dict(offsets), loss
                if step:  # ∂loss/∂v = ∂loss/∂ŵ · δ (straight-through), δ > 0: same sign
                    lr = self.lr * (1 - it / self.iters)
                    offsets = {n: (v - lr * quantized[n].grad.sign()).clamp(-0.5, 0.5) for n, v in offsets.items()}
        finally:
            for linear in ctx.linears.values():
                del linear.forward
            for p in frozen:
                p.requires_grad_(True)
        for name, w in weights.items():
            ctx.qweights[name] = fmt[name].quantize_weight(w + best[name] * steps[name], *scales[name])
