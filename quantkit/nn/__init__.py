"""Quantized modules and the model-level swap."""
from quantkit.nn.fuse import fuse_projections
from quantkit.nn.linear import QuantLinear
from quantkit.nn.swap import QuantizationReport, quantize_model

__all__ = ["QuantLinear", "QuantizationReport", "fuse_projections", "quantize_model"]
