"""Calibration algorithms by name; each is a peer behind :class:`Algorithm`."""
from __future__ import annotations

import inspect

from quantkit.calibrate.algorithms.base import STAGES, Algorithm, LayerContext
from quantkit.calibrate.algorithms.autoround import AutoRound
from quantkit.calibrate.algorithms.awq import AWQ
from quantkit.calibrate.algorithms.gptq import GPTQ
from quantkit.calibrate.algorithms.mse import MSE
from quantkit.calibrate.algorithms.rtn import RTN
from quantkit.calibrate.algorithms.smoothquant import SmoothQuant

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (RTN, MSE, GPTQ, AutoRound, AWQ, SmoothQuant)}
ALIASES = {"max": "rtn"}


def check_options(options: dict[str, dict]) -> dict[str, dict]:
    """``options`` keyed by canonical algorithm name (``{"autoround": {"iters": 200}}``). Raises
    ``ValueError`` naming the problem when a key is no algorithm, a value is no mapping, or a
    parameter is not one the algorithm takes. Options of algorithms a recipe does not use are
    allowed (and ignored)."""
    if not isinstance(options, dict):
        raise ValueError(f"algorithm options must map algorithm names to parameters, got {options!r}")
    checked = {}
    for raw, kwargs in options.items():
        name = ALIASES.get(raw, raw)
        if name not in ALGORITHMS:
            raise ValueError(f"options for unknown algorithm {raw!r}; valid: {', '.join(sorted(ALGORITHMS))}")
        if not isinstance(kwargs, dict):
            raise ValueError(f"options for {raw} must map parameter names to values, got {kwargs!r}")
        params = list(inspect.signature(ALGORITHMS[name]).parameters)
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise ValueError(f"unknown {name} option(s) {', '.join(unknown)}; valid: {', '.join(params) or 'none'}")
        checked[name] = kwargs
    return checked


def build(names: list[str], options: dict[str, dict] | None = None) -> list[Algorithm]:
    """Instantiate the named algorithms in stage order; RTN is added when no ``round`` stage is named.

    ``options``: per-algorithm keyword arguments (:func:`check_options`). Raises ``ValueError`` on
    unknown names, bad options or two algorithms of the same stage."""
    options = check_options(options or {})
    algos = []
    for raw in names:
        name = ALIASES.get(raw, raw)
        if name not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {raw!r}; valid: {', '.join(sorted(ALGORITHMS) + sorted(ALIASES))}")
        algos.append(ALGORITHMS[name](**options.get(name, {})))
    for stage in STAGES:
        named = [a.name for a in algos if a.stage == stage]
        if len(named) > 1:
            raise ValueError(f"algorithms {' and '.join(named)} both choose the {stage} stage; pick one")
    if not any(a.stage == "round" for a in algos):
        algos.append(RTN())
    return sorted(algos, key=lambda a: STAGES.index(a.stage))


__all__ = ["ALGORITHMS", "Algorithm", "LayerContext", "build", "check_options"]
