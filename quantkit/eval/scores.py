"""Task results as the eval report reads them (no lm-eval import: ``wikitext2_ppl`` runs without it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    """One aggregated task metric: its value, standard error (``None`` where lm-eval gives none)
    and whether a larger value is better."""

    value: float
    stderr: float | None
    higher_is_better: bool


@dataclass(frozen=True)
class TaskScores:
    """One model's results: ``metrics[task][metric]`` and the number of documents per task."""

    model: str
    metrics: dict[str, dict[str, Metric]]
    samples: dict[str, int]
