"""QuantLinear: a drop-in ``nn.Linear`` whose weight is stored quantized."""
from __future__ import annotations

import torch
from torch import nn

from quantkit import kernels
from quantkit.formats import Format, QuantizedWeight, get_format
from quantkit.kernels.epilogue import Epilogue


def moved_only(fn, t: torch.Tensor) -> torch.Tensor:
    """``fn(t)`` (``fn``: a ``Module._apply`` function) where ``fn`` keeps ``t``'s dtype (a move,
    ``share_memory_``), else ``t`` on the device ``fn`` moves tensors to: a cast never reaches the
    quantized buffers (probed on an empty tensor of ``t``'s dtype)."""
    probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
    return fn(t) if probe.dtype == t.dtype else t.to(probe.device)


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as a :class:`QuantizedWeight` in buffers.

    Buffers (all in ``state_dict``): ``weight`` (packed values), ``weight_scale`` (block scales),
    ``weight_tensor_scale`` (FP32 scalar, NVFP4 only), ``input_scale`` (FP32 scalar, only for
    static activation schemes after calibration). ``forward`` runs :func:`quantkit.kernels.gemm`:
    a GPU kernel where one fits, the PyTorch reference elsewhere.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, format: str | Format = "nvfp4",
                 static_input: bool = False, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None):
        super().__init__()
        fmt = get_format(format)
        if in_features % fmt.k_multiple:
            raise ValueError(f"{fmt.name}: in_features={in_features} is not divisible by the block size {fmt.k_multiple}")
        self.in_features, self.out_features, self.format = in_features, out_features, fmt.name
        (data_shape, data_dtype), (scale_shape, scale_dtype), has_tensor_scale = fmt.weight.storage(out_features, in_features)
        self.register_buffer("weight", torch.empty(data_shape, dtype=data_dtype, device=device))
        self.register_buffer("weight_scale", torch.empty(scale_shape, dtype=scale_dtype, device=device))
        if has_tensor_scale:
            self.register_buffer("weight_tensor_scale", torch.empty((), dtype=torch.float32, device=device))
        else:
            self.weight_tensor_scale = None
        if static_input:
            if not fmt.static_activation:
                raise ValueError(f"{fmt.name} takes no calibrated input scale")
            self.register_buffer("input_scale", torch.empty((), dtype=torch.float32, device=device))
        else:
            self.input_scale = None
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.epilogue = Epilogue(bias=bias)
        self._forget()

    def _forget(self) -> None:
        """Drop the :class:`QuantizedWeight` view of the buffers, and with it every cache derived
        from them (kernel layouts, the reference path's dequantized weight)."""
        self._qweight: QuantizedWeight | None = None

    def _refresh(self) -> None:
        """After a load into the buffers: build the view again and, on a GPU, the kernels' layouts
        of the weight, now rather than on the first call. A first call traced by torch.compile then finds
        them; filled inside the trace, they are guarded as empty and the second call recompiles."""
        self._forget()
        kernels.prepare_layouts(self.qweight)

    @classmethod
    def from_linear(cls, linear: nn.Linear, format: str | Format = "nvfp4", *, qweight: QuantizedWeight | None = None,
                    input_scale: torch.Tensor | None = None) -> QuantLinear:
        """Quantize ``linear`` (round to nearest unless ``qweight`` is given, e.g. from calibration)."""
        fmt = get_format(format)
        w = linear.weight.detach()
        if linear.bias is not None and not torch.isfinite(linear.bias).all():
            raise ValueError(f"{fmt.name}: the bias contains NaN or Inf")
        qweight = qweight or fmt.quantize_weight(w.float())
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, format=fmt,
                     static_input=input_scale is not None, dtype=w.dtype, device=w.device)
        module.load_quantized(qweight, input_scale)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module

    def load_quantized(self, qweight: QuantizedWeight, input_scale: torch.Tensor | None = None) -> None:
        """Copy ``qweight`` (and a calibrated ``input_scale``) into this module's buffers."""
        if qweight.format != self.format or tuple(qweight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"cannot load a {qweight.format} {tuple(qweight.shape)} weight into "
                             f"{self.format} ({self.out_features}, {self.in_features})")
        self.weight.copy_(qweight.data)
        self.weight_scale.copy_(qweight.scale)
        if self.weight_tensor_scale is not None:
            self.weight_tensor_scale.copy_(qweight.tensor_scale)
        if input_scale is not None:
            self.input_scale.copy_(input_scale)
        self._refresh()

    @property
    def qweight(self) -> QuantizedWeight:
        """The weight as a :class:`QuantizedWeight` over the buffers, kept with its kernel layouts
        while the buffers are the same tensors (built again where one was assigned anew, e.g. by
        ``module.weight = t`` or accelerate's offload hooks)."""
        q = self._qweight
        if (q is None or q.data is not self.weight or q.scale is not self.weight_scale
                or q.tensor_scale is not self.weight_tensor_scale):
            q = self._qweight = QuantizedWeight(self.format, self.weight, self.weight_scale, self.weight_tensor_scale,
                                                (self.out_features, self.in_features))
        return q

    _QUANTIZED = ("weight", "weight_scale", "weight_tensor_scale", "input_scale")

    def _apply(self, fn, recurse=True):
        """Device moves apply to every tensor; dtype casts (``model.to(torch.bfloat16)``) only to
        the bias: the quantized buffers keep their storage dtypes (and, where not moved, their caches:
        :attr:`qweight` is built again only over new tensors)."""
        held = {n: self._buffers.pop(n) for n in self._QUANTIZED if self._buffers.get(n) is not None}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, t in held.items():
                self._buffers[name] = moved_only(fn, t)
        kernels.prepare_layouts(self.qweight)
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._refresh()

    def dequantized_weight(self) -> torch.Tensor:
        """FP32 ``[N, K]`` dequantized weight for the reference path (CPU, or formats without a GPU
        kernel), cached by the first eager call (:meth:`QuantizedWeight.cached`)."""
        return self.qweight.cached("dequantized", self.qweight.dequantize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.gemm(x, self.qweight, self.epilogue, bias=self.bias, input_scale=self.input_scale,
                            weight=self.dequantized_weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, format={self.format}"
