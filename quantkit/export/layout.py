"""How a quantized Linear ``[N, K]`` is laid out on disk: one :class:`TensorSpec` per tensor.

Each export flavour (:mod:`~quantkit.export.compressed_tensors`, :mod:`~quantkit.export.modelopt`)
maps a quantkit format to a tuple of specs; :func:`export_layer` and :func:`import_layer` convert
between a :class:`~quantkit.nn.QuantLinear`'s buffers and those tensors with the same tables.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from quantkit.export.io import CheckpointError, CheckpointTensors

if TYPE_CHECKING:
    from quantkit.nn import QuantLinear

Shape = Callable[[int, int], tuple[int, ...]]


@dataclass(frozen=True)
class Scheme:
    """What a checkpoint's quantization config says: the quantkit ``formats`` it holds (one, or
    several in a mixed-precision checkpoint), the Linear layers it leaves in high precision
    (``ignore``: names or patterns), and ``format_of(name, module)``: the format of a module that
    holds quantized weights, ``None`` for the others; ``kv_cache``: ``"fp8"`` for an FP8 KV cache
    with per-layer static scales (:mod:`quantkit.nn.kv_cache`), else ``None``."""

    formats: tuple[str, ...]
    ignore: tuple[str, ...]
    format_of: Callable[[str, nn.Module], str | None]
    kv_cache: str | None = None

    @property
    def format(self) -> str:
        """The format, or a mixed checkpoint's formats joined by ``" + "``."""
        return " + ".join(self.formats)


def main_format(formats: Mapping[str, str]) -> str:
    """The format most layers of ``formats`` (layer name -> format) have (ties: the first seen)."""
    return Counter(formats.values()).most_common(1)[0][0]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a quantized Linear ``[N, K]`` on disk.

    ``name``: local name (``"weight_packed"``); ``field``: the QuantLinear buffer it holds
    (``weight``, ``weight_scale``, ``weight_tensor_scale`` or ``input_scale``); ``dtype``: the dtype
    written, ``accept``: further dtypes read (converted exactly to ``dtype``); ``shape(N, K)``;
    ``reciprocal``: stored as ``1/value`` (compressed-tensors' global scales).
    """

    name: str
    field: str
    dtype: torch.dtype
    shape: Shape
    reciprocal: bool = False
    accept: tuple[torch.dtype, ...] = ()


FLOAT_SCALES = (torch.bfloat16, torch.float16)  # FP8 scales other writers store in the model dtype

# quantkit formats written as another format's checkpoint: the same tensors and quantization config
# (what vLLM reads, and serves), plus a "quantkit_format" key so that quantkit.load gives the format back.
STORED_AS = {"nvfp4-w4a8": "nvfp4-w4a16", "nvfp4-4over6": "nvfp4"}


def tag_format(qcfg: dict, fmt: str) -> dict:
    """``qcfg`` with ``"quantkit_format": fmt`` when ``fmt`` is stored as another format."""
    return {**qcfg, "quantkit_format": fmt} if fmt in STORED_AS else qcfg


def tagged_format(qcfg: dict, fmt: str) -> str:
    """The quantkit format of a checkpoint whose config reads as ``fmt``: its ``quantkit_format``
    when that format is stored as ``fmt``, else ``fmt``."""
    tag = qcfg.get("quantkit_format")
    return tag if STORED_AS.get(tag) == fmt else fmt


def reciprocal(x: torch.Tensor) -> torch.Tensor:
    """FP32 ``r ≈ 1/x`` with ``1/r == x`` exactly whenever such an FP32 ``r`` exists.

    A reader of a reciprocal-convention checkpoint computes ``1/r``; choosing ``r`` among the
    neighbours of the rounded ``1/x`` makes that give back ``x`` bit for bit. 12-16% of FP32
    values (all with a significand above √2) are not the rounded reciprocal of any FP32 number;
    for those ``r`` is the rounded ``1/x`` and ``1/r`` is one ulp off."""
    x = x.float()
    r = 1.0 / x
    down, up = torch.nextafter(r, torch.zeros_like(r)), torch.nextafter(r, torch.full_like(r, float("inf")))
    for candidate in (down, up):
        r = torch.where((1.0 / r != x) & (1.0 / candidate == x), candidate, r)
    return r


def export_layer(layer: QuantLinear, specs: tuple[TensorSpec, ...], name: str) -> dict[str, torch.Tensor]:
    """The on-disk tensors (local names) of QuantLinear ``layer`` called ``name``, per ``specs``.

    Raises ``ValueError`` if a spec needs a buffer the layer lacks (an uncalibrated ``input_scale``)."""
    n, k = layer.out_features, layer.in_features
    out = {}
    for spec in specs:
        value = getattr(layer, spec.field, None)
        if value is None:
            raise ValueError(f"{name}: the checkpoint needs {spec.name!r} from the layer's {spec.field}, which "
                             f"this {layer.format} layer does not have; vLLM needs a calibrated activation scale "
                             f"for this format: calibrate (quantkit.quantize) before saving")
        if value.dtype != spec.dtype:
            raise ValueError(f"{name}.{spec.field} is {value.dtype}, expected {spec.dtype} for {layer.format}: "
                             f"the quantized buffers were cast (model.to(dtype) casts every floating buffer)")
        value = value.detach().cpu()
        if spec.reciprocal:
            value = reciprocal(value)
        out[spec.name] = value.reshape(spec.shape(n, k)).contiguous()
    return out


def _non_finite_scale(t: torch.Tensor) -> bool:
    """Whether scale tensor ``t`` holds a NaN or Inf (an E8M0 byte 255 is NaN)."""
    return bool((t == 255).any()) if t.dtype == torch.uint8 else not torch.isfinite(t.float()).all()


def import_layer(tensors: CheckpointTensors, prefix: str, specs: tuple[TensorSpec, ...],
                 n: int, k: int) -> dict[str, torch.Tensor]:
    """QuantLinear buffers (by ``field``) of the ``[n, k]`` layer whose tensors are ``prefix + spec.name``.

    Dtypes and shapes are checked against ``specs``; a mismatch, a missing tensor or a NaN/Inf scale
    (E8M0 255 included) raises :class:`CheckpointError` naming the file and tensor."""
    out = {}
    for spec in specs:
        t = tensors.take(prefix + spec.name, (spec.dtype, *spec.accept), spec.shape(n, k)).to(spec.dtype)
        if spec.field != "weight" and not spec.reciprocal and _non_finite_scale(t):
            raise CheckpointError(f"{tensors.directory}: tensor {prefix + spec.name!r} holds NaN or Inf scales")
        if spec.reciprocal:
            if not torch.isfinite(t).all() or (t == 0).any():
                raise CheckpointError(f"{tensors.directory}: tensor {prefix + spec.name!r} must be finite "
                                      f"and non-zero, got {t.tolist()}")
            t = 1.0 / t
        out[spec.field] = t
    return out
