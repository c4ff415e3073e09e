"""Recipe: what the user asked for — format, algorithms, ignore patterns, calibration options."""
from __future__ import annotations

from dataclasses import dataclass, field

from quantkit.formats import get_format
from quantkit.nn.kv_cache import KV_CACHE_FORMATS
from quantkit.nn.swap import DEFAULT_IGNORE, check_patterns

# The algorithms a bare format name gets (chosen by measurement: docs/accuracy.md); the other
# formats round to nearest (mxfp8 since session 23: GPTQ gained nothing on Gemma-3-270M and lost
# about 1 % perplexity on the same model moved off its GGUF grid).
DEFAULT_ALGORITHMS: dict[str, tuple[str, ...]] = {
    "nvfp4": ("awq", "mse"),
    "nvfp4-4over6": ("awq", "mse"),
    "nvfp4-w4a16": ("awq", "mse"),
    "fp8-block": ("mse",),
}


@dataclass(frozen=True)
class Recipe:
    """``format`` (a :func:`quantkit.formats.get_format` name); ``algorithms`` in any order (each
    stage at most once, see :mod:`quantkit.calibrate.algorithms`); ``ignore`` glob/``re:``
    patterns of Linear names to leave alone; ``options``: keyword arguments per algorithm name
    (``{"autoround": {"iters": 200}}``, checked by
    :func:`quantkit.calibrate.algorithms.check_options`); ``propagate``: feed each decoder layer the
    outputs of the already *quantized* previous layers (``"quantized"``) or of the float ones
    (``"float"``); ``kv_cache``: ``"fp8"`` calibrates a static FP8 KV-cache scale per
    attention layer (:mod:`quantkit.nn.kv_cache`), ``None`` leaves the cache in the model dtype."""

    format: str = "nvfp4"
    algorithms: tuple[str, ...] = ()
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    options: dict[str, dict] = field(default_factory=dict)
    propagate: str = "quantized"
    kv_cache: str | None = None

    def __post_init__(self) -> None:
        from quantkit.calibrate.algorithms import build, check_options

        get_format(self.format)
        check_patterns(self.ignore)
        check_options(self.options)
        if self.kv_cache not in (None, *KV_CACHE_FORMATS):
            raise ValueError(f"unknown KV-cache format {self.kv_cache!r}; valid: {', '.join(KV_CACHE_FORMATS)}")
        if self.propagate not in ("quantized", "float"):
            raise ValueError(f"propagate must be 'quantized' or 'float', got {self.propagate!r}")
        if not self.algorithms:
            object.__setattr__(self, "algorithms", DEFAULT_ALGORITHMS.get(self.format, ("rtn",)))
        build(list(self.algorithms), self.options)  # unknown names and two algorithms for one stage fail here

    @property
    def needs_data(self) -> bool:
        """True when calibration data is needed: static activation or KV-cache scales, or a data-driven algorithm."""
        from quantkit.calibrate.algorithms import ALIASES

        act = get_format(self.format).activation
        return (act is not None and act.static) or self.kv_cache is not None or any(ALIASES.get(a, a) != "rtn" for a in self.algorithms)

    @classmethod
    def parse(cls, format: str, algo: str | None = None, ignore: list[str] | None = None, **kwargs) -> Recipe:
        """From CLI-style strings: ``algo`` like ``"awq+gptq+mse"``; ``ignore`` adds to the defaults."""
        algorithms = tuple(a.strip() for a in algo.split("+") if a.strip()) if algo else ()
        return cls(format, algorithms, DEFAULT_IGNORE + tuple(ignore or ()), **kwargs)
