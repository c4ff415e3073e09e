"""GPTQ: round weights column by column, compensating each column's error in the columns not yet
rounded through the inverse Hessian of the layer inputs (Frantar et al., 2023).

The Hessian is ``H = mean x xᵀ`` over the calibration tokens, damped by ``damp·mean(diag H)``.
As in the reference implementation, the sweep uses the upper Cholesky factor ``U`` of ``H⁻¹``
(computed in float64): rounding column ``j`` to ``q`` adds ``(w_j − q)/U_jj · U_j,j:`` to the
remaining columns; updates are applied lazily per block of ``block_size`` columns.

Every format is a grid of element values (E2M1 or E4M3) times a per-element step derived from its
scales, so one sweep serves them all. Scales chosen by a ``scales`` stage algorithm (MSE) stay
fixed; otherwise, with ``dynamic_scales`` (default), each scale block gets its round-to-nearest
scale from the already-updated weights when the sweep reaches it (the reference implementation's
groups; NVFP4 keeps its fused-group tensor scale) — with ``mse_scales``, the block scale of least
Hessian-diagonal-weighted error among the MSE search's candidates (:mod:`.mse`; llm-compressor's
GPTQ with an MSE observer) — else the round-to-nearest scales of the original weights are fixed
before the sweep. ``act_order`` sweeps the columns in order of
decreasing ``diag H``, with fixed scales.
"""
from __future__ import annotations

import torch

from quantkit.calibrate.algorithms.base import Algorithm, LayerContext, check_option
from quantkit.calibrate.algorithms.mse import amax_scales, search_block_scales
from quantkit.formats import Format, QuantizedWeight
from quantkit.formats.codecs import e2m1_decode, e2m1_encode, e4m3_encode, pack_nibbles


def is_fp4(fmt: Format) -> bool:
    """True when ``fmt``'s weight elements are E2M1 (packed two per byte), False for E4M3."""
    return fmt.weight.storage(1, fmt.k_multiple)[0][1] == torch.uint8


def element_steps(fmt: Format, scale: torch.Tensor, tensor_scale: torch.Tensor | None,
                  shape: tuple[int, int]) -> torch.Tensor:
    """FP32 ``[N, K]``: the factor each element's grid value is multiplied by under these scales
    (the dequantization of all-ones codes)."""
    ones = torch.ones(shape, device=scale.device)
    data = pack_nibbles(e2m1_encode(ones)) if is_fp4(fmt) else e4m3_encode(ones)
    return fmt.weight.dequantize(QuantizedWeight(fmt.name, data, scale, tensor_scale, shape))


def round_to_grid(x: torch.Tensor, fp4: bool) -> torch.Tensor:
    """FP32 ``x`` rounded to the nearest E2M1 (``fp4``) or E4M3 value, ties to even, saturating."""
    return e2m1_decode(e2m1_encode(x)) if fp4 else e4m3_encode(x).float()


class ColumnQuantizer:
    """Rounds single weight columns of an ``[N, K]`` weight under the format's scales.

    ``scale``/``tensor_scale``: the starting scales (updated in place by :meth:`refresh`);
    ``amax``: the tensor-scale amax :meth:`refresh` keeps (NVFP4 fused groups); ``importance``:
    FP32 ``[K]`` column weights under which :meth:`refresh` searches the block scale (None: the
    round-to-nearest scale)."""

    def __init__(self, fmt: Format, shape: tuple[int, int], scale: torch.Tensor,
                 tensor_scale: torch.Tensor | None, amax: torch.Tensor | None = None,
                 importance: torch.Tensor | None = None):
        self.fmt, self.fp4 = fmt, is_fp4(fmt)
        self.scale, self.tensor_scale, self.amax = scale.clone(), tensor_scale, amax
        self.importance = importance
        self.width = fmt.weight.block[1] or shape[1]
        self.steps = element_steps(fmt, self.scale, tensor_scale, shape)

    def refresh(self, j: int, block: torch.Tensor) -> None:
        """Round-to-nearest (or, with ``importance``, searched) scale for the scale block starting
        at column ``j`` (a multiple of ``width``) from its current FP32 values ``block [N, width]``."""
        if self.importance is None:
            s, _ = self.fmt.weight.compute_scales(block, self.amax)
        else:
            s, _ = amax_scales(self.fmt, block, self.amax)
            s, _ = search_block_scales(self.fmt, block, s, self.tensor_scale, self.importance[j:j + self.width])
        c = j // self.width
        self.scale[:, c:c + 1] = s
        self.steps[:, j:j + self.width] = element_steps(self.fmt, s, self.tensor_scale, tuple(block.shape))

    def __call__(self, j: int, column: torch.Tensor) -> torch.Tensor:
        """FP32 ``[N]``: column ``j`` (values ``column``) rounded onto the format's grid."""
        step = self.steps[:, j]
        return round_to_grid(column / step, self.fp4) * step


def inverse_hessian_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """FP32 upper Cholesky factor of ``(H + λI)⁻¹`` with ``λ = damp·mean(diag H)``, computed in
    float64; ``λ`` grows ×10 (up to 4 times) while ``H + λI`` is not positive definite."""
    h = hessian.double()
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    lam = damp * h.diagonal().mean()
    for _ in range(5):
        lower, info = torch.linalg.cholesky_ex(h + lam * eye)
        if info.item() == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True).float()
        lam = lam * 10
    raise ValueError("GPTQ: the damped Hessian is not positive definite; raise damp")


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, quantizer: ColumnQuantizer, *, damp: float = 0.01,
                  block_size: int = 128, act_order: bool = False, dynamic_scales: bool = False) -> torch.Tensor:
    """FP32 ``[N, K]``: the GPTQ-rounded ``w [N, K]`` (values on the quantizer's grid) for inputs
    with second moment ``hessian [K, K]``. Input channels never active (``H_kk = 0``) get zero
    weight. ``dynamic_scales`` needs ``block_size`` to be a multiple of the scale block width."""
    w = w.float().clone()
    h = hessian.to(w.device, torch.float64).clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    k = w.shape[1]
    perm = torch.argsort(h.diagonal(), descending=True) if act_order else torch.arange(k, device=w.device)
    w, h = w[:, perm], h[perm][:, perm]
    u = inverse_hessian_factor(h, damp)
    order = perm.tolist()
    q = torch.zeros_like(w)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1, u1 = w[:, i1:i2], u[i1:i2, i1:i2]
        err = torch.zeros_like(w1)
        for i in range(i2 - i1):
            j = i1 + i
            if dynamic_scales and j % quantizer.width == 0:
                quantizer.refresh(j, w1[:, i:i + quantizer.width])
            q[:, j] = quantizer(order[j], w1[:, i])
            err[:, i] = (w1[:, i] - q[:, j]) / u1[i, i]
            w1[:, i:] -= err[:, i:i + 1] * u1[i:i + 1, i:]
        w[:, i2:] -= err @ u[i1:i2, i2:]
    return q[:, torch.argsort(perm)]


class GPTQ(Algorithm):
    """Round stage: GPTQ per Linear (see the module doc). ``damp`` (0.01), ``block_size`` (128),
    ``act_order`` (False), ``dynamic_scales`` (True), ``mse_scales`` (False)."""

    name = "gptq"
    stage = "round"
    needs_hessian = True

    def __init__(self, damp: float = 0.01, block_size: int = 128, act_order: bool = False,
                 dynamic_scales: bool = True, mse_scales: bool = False):
        check_option("gptq", "damp", damp, float, 0)
        check_option("gptq", "block_size", block_size, int, 1)
        for flag, value in (("act_order", act_order), ("dynamic_scales", dynamic_scales), ("mse_scales", mse_scales)):
            check_option("gptq", flag, value, bool)
        self.damp, self.block_size, self.act_order, self.dynamic_scales = damp, block_size, act_order, dynamic_scales
        self.mse_scales = mse_scales

    @torch.no_grad()
    def apply(self, ctx: LayerContext) -> None:
        for name, linear in ctx.linears.items():
            w = linear.weight.detach().float()
            chosen = name in ctx.scales  # by a scales-stage algorithm
            scale, tensor_scale = ctx.rtn_scales(name)
            importance = ctx.stats[name].hessian.diagonal().float() if self.mse_scales else None  # used by refresh
            fmt = ctx.format_of(name)
            quantizer = ColumnQuantizer(fmt, tuple(w.shape), scale, tensor_scale, ctx.weight_amax[name], importance)
            dynamic = (self.dynamic_scales and not chosen and not self.act_order
                       and self.block_size % quantizer.width == 0)
            q = gptq_quantize(w, ctx.stats[name].hessian, quantizer, damp=self.damp, block_size=self.block_size,
                              act_order=self.act_order, dynamic_scales=dynamic)
            ctx.qweights[name] = fmt.quantize_weight(q, quantizer.scale, tensor_scale)
