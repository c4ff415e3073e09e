"""Activation statistics recorded at the input of each Linear layer during calibration.

Sums are kept in float64 and turned into means only in :meth:`InputObserver.finish`, after they
are reduced over the data-parallel ranks (:mod:`quantkit.calibrate.distributed`): a rank's
statistics of its shard combine into those of the whole calibration set.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantkit.calibrate.distributed import all_reduce_


@dataclass
class InputStats:
    """What calibration saw at one Linear's input ``x [..., K]``.

    ``amax``: FP32 scalar max |x|. ``channel_amax``: FP32 ``[K]`` per-channel max |x| (AWQ,
    SmoothQuant). ``channel_mean_abs``: FP32 ``[K]`` mean |x| (AWQ). ``hessian``: FP32 ``[K, K]``
    mean of ``x xᵀ`` over tokens (GPTQ), only when asked for. ``tokens``: tokens seen.
    """

    amax: torch.Tensor
    channel_amax: torch.Tensor
    channel_mean_abs: torch.Tensor
    hessian: torch.Tensor | None
    tokens: int


class InputObserver:
    """Forward pre-hook that accumulates :class:`InputStats` for one ``nn.Linear``: the FP32
    per-channel max |x|, and float64 sums of |x|, of ``x xᵀ`` (``hessian=True``) and of tokens."""

    def __init__(self, module: nn.Linear, *, hessian: bool = False):
        k = module.in_features
        dev = module.weight.device
        self.channel_amax = torch.zeros(k, device=dev)
        self.abs_sum = torch.zeros(k, dtype=torch.float64, device=dev)
        self.outer_sum = torch.zeros(k, k, dtype=torch.float64, device=dev) if hessian else None
        self.tokens = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    @torch.no_grad()
    def _hook(self, module: nn.Module, args: tuple) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        a = x.abs()
        self.channel_amax = torch.maximum(self.channel_amax, a.amax(0))
        self.abs_sum += a.sum(0, dtype=torch.float64)
        if self.outer_sum is not None:
            xd = x.double()
            self.outer_sum.addmm_(xd.T, xd)
        self.tokens += x.shape[0]

    def finish(self) -> InputStats:
        """Remove the hook, reduce the statistics over the data-parallel ranks (max of the
        maxima, sums of the sums and token counts) and return them."""
        self.handle.remove()
        all_reduce_(self.channel_amax, "max")
        sums = all_reduce_(torch.cat([self.abs_sum, self.abs_sum.new_tensor([self.tokens])]))
        tokens = int(sums[-1].item())
        n = max(tokens, 1)
        hessian = None
        if self.outer_sum is not None:
            hessian = all_reduce_(self.outer_sum).div_(n).float()
            self.outer_sum = None  # the float64 sum is not needed beside the FP32 mean
        mean_abs = (sums[:-1] / n).float()
        return InputStats(self.channel_amax.max(), self.channel_amax, mean_abs, hessian, tokens)
