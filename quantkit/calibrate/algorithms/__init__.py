"""Calibration algorithms by name; each is a peer behind :class:`Algorithm`."""
from __future__ import annotations

from quantkit.calibrate.algorithms.base import STAGES, Algorithm, LayerContext
from quantkit.calibrate.algorithms.autoround import AutoRound
from quantkit.calibrate.algorithms.awq import AWQ
from quantkit.calibrate.algorithms.gptq import GPTQ
from quantkit.calibrate.algorithms.mse import MSE
from quantkit.calibrate.algorithms.rtn import RTN
from quantkit.calibrate.algorithms.smoothquant import SmoothQuant

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (RTN, MSE, GPTQ, AutoRound, AWQ, SmoothQuant)}
ALIASES = {"max": "rtn"}


def build(names: list[str], options: dict[str, dict] | None = None) -> list[Algorithm]:
    """Instantiate the named algorithms in stage order; RTN is added when no ``round`` stage is named.

    ``options``: per-algorithm keyword arguments. Raises ``ValueError`` on unknown names or two
    algorithms of the same stage."""
    options = options or {}
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


__all__ = ["ALGORITHMS", "Algorithm", "LayerContext", "build"]
