"""Calibration: data, the sequential pipeline, observers, algorithms and recipes."""
from quantkit.calibrate.pipeline import CalibrationError, quantize
from quantkit.calibrate.recipe import Recipe

__all__ = ["CalibrationError", "Recipe", "quantize"]
