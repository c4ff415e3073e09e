"""Recipe: what the user asked for — format, algorithms, ignore patterns, calibration options."""
from __future__ import annotations

from dataclasses import dataclass, field

from quantkit.formats import get_format
from quantkit.nn.kv_cache import KV_CACHE_FORMATS
from quantkit.nn.swap import DEFAULT_IGNORE, assign_formats, check_patterns

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
    attention layer (:mod:`quantkit.nn.kv_cache`), ``None`` leaves the cache in the model dtype;
    ``layer_formats``: glob/``re:`` pattern -> format for the Linear layers it matches (first match
    wins; e.g. ``{"*self_attn*": "fp8-block"}``), the others get ``format``; ``algorithms`` apply to
    every layer."""

    format: str = "nvfp4"
    algorithms: tuple[str, ...] = ()
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    options: dict[str, dict] = field(default_factory=dict)
    propagate: str = "quantized"
    kv_cache: str | None = None
    layer_formats: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from quantkit.calibrate.algorithms import build, check_options

        if isinstance(self.algorithms, str):
            raise TypeError(f"algorithms takes a tuple of names, not the string {self.algorithms!r}: write "
                             f"{tuple(self.algorithms.split('+'))!r} (Recipe.parse takes 'awq+gptq+mse' strings)")
        assign_formats((), self.format, self.layer_formats)  # unknown formats and invalid patterns fail here
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

        acts = [get_format(f).activation for f in (self.format, *self.layer_formats.values())]
        return (any(a is not None and a.static for a in acts) or self.kv_cache is not None
                or any(ALIASES.get(a, a) != "rtn" for a in self.algorithms))

    @classmethod
    def parse(cls, format: str, algo: str | None = None, ignore: list[str] | None = None,
              layer_formats: list[str] | None = None, **kwargs) -> Recipe:
        """From CLI-style strings: ``algo`` like ``"awq+gptq+mse"``; ``ignore`` adds to the defaults;
        ``layer_formats`` entries ``"PATTERN=FORMAT"``."""
        algorithms = tuple(a.strip() for a in algo.split("+")) if algo else ()
        if "" in algorithms:
            raise ValueError(f"--algo {algo!r} has an empty name: join algorithm names with '+', e.g. 'awq+gptq+mse'")
        pairs = {}
        for entry in layer_formats or ():
            pattern, sep, fmt = entry.rpartition("=")
            if not sep or not pattern or not fmt:
                raise ValueError(f"layer format {entry!r} is not PATTERN=FORMAT (e.g. '*self_attn*=fp8-block')")
            pairs[pattern] = fmt
        return cls(format, algorithms, DEFAULT_IGNORE + tuple(ignore or ()), layer_formats=pairs, **kwargs)
