"""Activation statistics recorded at the input of each Linear layer during calibration."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


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
    """Forward pre-hook that accumulates :class:`InputStats` for one ``nn.Linear``."""

    def __init__(self, module: nn.Linear, *, hessian: bool = False):
        k = module.in_features
        dev = module.weight.device
        self.amax = torch.zeros((), device=dev)
        self.channel_amax = torch.zeros(k, device=dev)
        self.abs_sum = torch.zeros(k, dtype=torch.float64, device=dev)
        self.hessian = torch.zeros(k, k, device=dev) if hessian else None
        self.tokens = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    @torch.no_grad()
    def _hook(self, module: nn.Module, args: tuple) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        a = x.abs()
        self.channel_amax = torch.maximum(self.channel_amax, a.amax(0))
        self.amax = self.channel_amax.max()
        self.abs_sum += a.sum(0, dtype=torch.float64)
        n = x.shape[0]
        if self.hessian is not None:  # running mean of x xᵀ
            self.hessian.mul_(self.tokens / (self.tokens + n)).addmm_(x.T, x, alpha=1.0 / (self.tokens + n))
        self.tokens += n

    def finish(self) -> InputStats:
        """Remove the hook and return the statistics."""
        self.handle.remove()
        mean_abs = (self.abs_sum / max(self.tokens, 1)).float()
        return InputStats(self.amax, self.channel_amax, mean_abs, self.hessian, self.tokens)
