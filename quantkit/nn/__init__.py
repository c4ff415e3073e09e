"""Quantized modules and the model-level swap."""
from quantkit.nn.attention import use_packed_gqa_attention
from quantkit.nn.fuse import fuse_projections
from quantkit.nn.kv_cache import calibrate_kv_cache
from quantkit.nn.linear import QuantLinear
from quantkit.nn.swap import QuantizationReport, quantize_model

__all__ = ["QuantLinear", "QuantizationReport", "calibrate_kv_cache", "fuse_projections", "quantize_model",
           "use_packed_gqa_attention"]
