"""The epilogue vocabulary every GEMM backend implements.

A GEMM computes ``acc[M, N'] = dequant(x) @ dequant(w).T`` in FP32 (``N'`` = weight rows).
The epilogue then applies, in this order:

1. ``alpha``: a per-tensor FP32 factor (NVFP4 tensor scales, FP8 per-tensor scales) — not part of
   the spec here, the backend folds it in from the operands' scales;
2. ``bias``: ``+ bias[N']`` (the bias tensor is bf16 or FP32, added in FP32);
3. ``activation``: ``identity | relu | silu | gelu_tanh`` elementwise, or ``swiglu``: the weight rows
   are a gate/up pair interleaved in groups of :data:`SWIGLU_GROUP` rows (see
   :func:`interleave_gate_up`), and the output has ``N = N' / 2`` columns ``silu(gate) * up``;
4. ``residual``: ``+ residual[M, N]`` (bf16, added in FP32);
5. ``requant``: ``None`` writes bf16 ``[M, N]``; a format name writes the next layer's quantized
   activation instead (``"fp8-block"``: FP8 E4M3 + FP32 scale per 1×128 group), computed by
   ``quantkit.formats`` from the FP32 result rounded to bf16 first (what a bf16 output would be).

:mod:`quantkit.kernels.reference` defines what this means numerically; kernels must equal it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ACTIVATIONS = ("identity", "relu", "silu", "gelu_tanh", "swiglu")
REQUANT_FORMATS = (None, "fp8-block", "nvfp4", "mxfp8")
SWIGLU_GROUP = 64


@dataclass(frozen=True)
class Epilogue:
    """What happens to the FP32 accumulator before it is stored (compile-time choice)."""

    bias: bool = False
    activation: str = "identity"
    residual: bool = False
    requant: str | None = None

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; valid: {', '.join(ACTIVATIONS)}")
        if self.requant not in REQUANT_FORMATS:
            raise ValueError(f"unknown requant format {self.requant!r}; valid: {REQUANT_FORMATS[1:]}")


IDENTITY = Epilogue()


def epilogue_operands(epilogue: Epilogue, m: int, n: int, n_out: int, bias, residual):
    """Check ``bias [n]`` (weight rows) and ``residual [m, n_out]`` against ``epilogue`` and bring
    them to what the kernels read: contiguous bias in bf16 (FP32 kept), contiguous bf16 residual.
    Returns ``(bias, residual, bias_fp32)``."""
    if epilogue.bias and (bias is None or tuple(bias.shape) != (n,)):
        raise ValueError(f"epilogue has bias: expected bias[{n}]")
    if epilogue.residual and (residual is None or tuple(residual.shape) != (m, n_out)):
        raise ValueError(f"epilogue has residual: expected residual[{m}, {n_out}]")
    bias_fp32 = bias is not None and bias.dtype == torch.float32
    if bias is not None:
        bias = (bias if bias_fp32 else bias.to(torch.bfloat16)).contiguous()
    residual = residual.to(torch.bfloat16).contiguous() if residual is not None else None
    return bias, residual, bias_fp32


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor, group: int = SWIGLU_GROUP) -> torch.Tensor:
    """Interleave gate/up weights ``[N, K]`` each into ``[2N, K]``: rows ``g0 u0 g1 u1 ...`` in
    blocks of ``group`` rows, so any tile of ``2·group·j`` rows holds matching gate and up halves."""
    if gate.shape != up.shape or gate.shape[0] % group:
        raise ValueError(f"gate/up must have equal shapes with rows divisible by {group}: {tuple(gate.shape)}, {tuple(up.shape)}")
    n, k = gate.shape
    return torch.stack([gate.reshape(n // group, group, k), up.reshape(n // group, group, k)], 1).reshape(2 * n, k)


def apply_activation(y: torch.Tensor, activation: str, group: int = SWIGLU_GROUP) -> torch.Tensor:
    """Apply ``activation`` to ``y[..., N']`` in its dtype; ``swiglu`` halves the last dim."""
    if activation == "identity":
        return y
    if activation == "relu":
        return torch.relu(y)
    if activation == "silu":
        return torch.nn.functional.silu(y)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(y, approximate="tanh")
    if activation == "swiglu":
        *lead, n2 = y.shape
        pairs = y.reshape(*lead, n2 // (2 * group), 2, group)
        return (torch.nn.functional.silu(pairs[..., 0, :]) * pairs[..., 1, :]).reshape(*lead, n2 // 2)
    raise ValueError(f"unknown activation {activation!r}")
