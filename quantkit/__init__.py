"""quantkit: turn a bf16 PyTorch / Hugging Face model into a fast, accurate low-precision one.

Public API::

    quantkit.quantize(model, recipe, calib_data)   # calibrate + swap Linear layers (quantkit.calibrate)
    quantkit.quantize_model(model, "nvfp4")        # round-to-nearest swap, no data
    quantkit.QuantLinear.from_linear(linear, "nvfp4")
    quantkit.save(model, out_dir) / quantkit.load(out_dir)
    quantkit.fuse_projections(model)               # q/k/v and gate/up as one GEMM each, for inference
    quantkit.get_format("nvfp4")
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from quantkit._lazy import lazy_getattr

__version__ = "0.1.0"

_LAZY = {
    "QuantLinear": "quantkit.nn",
    "quantize_model": "quantkit.nn",
    "fuse_projections": "quantkit.nn",
    "get_format": "quantkit.formats",
    "quantize": "quantkit.calibrate",
    "Recipe": "quantkit.calibrate",
    "save": "quantkit.export",
    "load": "quantkit.export",
}

if TYPE_CHECKING:
    from quantkit.calibrate import Recipe, quantize
    from quantkit.export import load, save
    from quantkit.formats import get_format
    from quantkit.nn import QuantLinear, fuse_projections, quantize_model


__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = list(_LAZY)
