"""A decoder layer run as it will be deployed, for algorithms that learn against its output error
(AutoRound, norm tweaking): every Linear computes ``x̂ · Ŵᵀ``, ``Ŵ`` given per Linear and ``x̂``
its input quantized as the format's activations are (straight-through gradient), and only the
given parameters take gradients."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from quantkit.calibrate.algorithms.base import LayerContext


@contextmanager
def quantized_layer(ctx: LayerContext, weight_of: Callable[[str], torch.Tensor],
                    trainable: Iterable[torch.nn.Parameter] = ()) -> Iterator[None]:
    """Within the block, ``ctx.linears[name]`` computes ``F.linear(x̂, weight_of(name), bias)``
    (``weight_of`` is called on every forward, so it may return a tensor that changes between
    passes); every parameter of ``ctx.block`` but ``trainable`` is frozen. Restored on exit."""
    act = ctx.fmt.activation
    input_scales = ctx.input_scales()

    def forward_of(name: str, linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if act is not None:  # straight-through: the gradient passes the rounding unchanged
                x = x + (act.qdq(x, input_scales.get(name)).to(x.dtype) - x).detach()
            return F.linear(x, weight_of(name).to(x.dtype), linear.bias)
        return forward

    grads = {p: p.requires_grad for p in ctx.block.parameters()}
    for p in grads:
        p.requires_grad_(False)
    for p in trainable:
        p.requires_grad_(True)
    for name, linear in ctx.linears.items():
        linear.forward = forward_of(name, linear)
    try:
        yield
    finally:
        for linear in ctx.linears.values():
            del linear.forward
        for p, flag in grads.items():
            p.requires_grad_(flag)


def output_error(ctx: LayerContext, targets: list[torch.Tensor], backward: bool) -> float:
    """``Σ_b ‖layer(batch b) − targets[b]‖²`` over the calibration batches (FP32); with
    ``backward``, each batch's gradient is accumulated into the tensors that require it."""
    loss = 0.0
    with torch.set_grad_enabled(backward):
        for b, t in enumerate(targets):
            err = (ctx.run_block([b])[0].float() - t).pow(2).sum()
            if backward:
                err.backward()
            loss += err.item()
    return loss
