"""GEMM dispatch: one entry point, ``gemm``, that picks a backend by device and format.

Backends, in order of preference: CuTeDSL kernels for Blackwell (``sm100``) and Hopper (``sm90``)
when the input lives on such a GPU and the kernel supports the format and epilogue, else the
PyTorch reference (:mod:`quantkit.kernels.reference`), which computes the same function anywhere.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from quantkit.formats import QuantizedWeight
from quantkit.kernels import reference
from quantkit.kernels.epilogue import IDENTITY, Epilogue

log = logging.getLogger(__name__)
_state = threading.local()


@dataclass(frozen=True)
class Backend:
    """A GPU kernel family: ``supports(x, qweight, epilogue)`` then ``run(x, qweight, epilogue, **kw)``;
    ``prepare(qweight)``, where the family re-lays weights, caches that layout in ``qweight.layouts``
    for the weights it runs (``run`` fills it too, where it is missing)."""

    name: str
    capability: tuple[int, ...]          # device major versions it runs on
    supports: Callable[[torch.Tensor, QuantizedWeight, Epilogue], bool]
    run: Callable[..., object]
    prepare: Callable[[QuantizedWeight], None] | None = None


_BACKENDS: list[Backend] = []


def register_backend(backend: Backend) -> None:
    """Add a kernel backend (the ``sm90`` / ``sm100`` packages call this when imported)."""
    _BACKENDS.append(backend)


@contextlib.contextmanager
def use_reference() -> Iterator[None]:
    """Within this block every :func:`gemm` takes the PyTorch reference path."""
    previous = getattr(_state, "reference", False)
    _state.reference = True
    try:
        yield
    finally:
        _state.reference = previous


_MAJOR: dict[torch.device, int] = {}


def _major(device: torch.device) -> int:
    """Compute-capability major version of the CUDA ``device`` (cached: the query costs µs per call;
    a dict rather than ``lru_cache``, which torch.compile warns about when it traces through)."""
    if device not in _MAJOR:
        _MAJOR[device] = torch.cuda.get_device_capability(device)[0]
    return _MAJOR[device]


def prepare_layouts(qweight: QuantizedWeight) -> None:
    """Cache now the kernel layouts of ``qweight`` for the backends of the CUDA device it lives on
    (nothing elsewhere). A first GEMM traced by torch.compile then finds them: filled inside the
    trace, the cache is guarded as empty and the next call recompiles."""
    if not qweight.data.is_cuda:
        return
    major = _major(qweight.data.device)
    for backend in _BACKENDS:
        if backend.prepare is not None and major in backend.capability:
            backend.prepare(qweight)


def select_backend(x: torch.Tensor, qweight: QuantizedWeight, epilogue: Epilogue = IDENTITY) -> Backend | None:
    """The GPU backend ``gemm`` would use for these operands, or ``None`` for the reference path."""
    if getattr(_state, "reference", False) or not x.is_cuda:
        return None
    major = _major(x.device)
    for backend in _BACKENDS:
        if major in backend.capability and backend.supports(x, qweight, epilogue):
            return backend
    return None


def gemm(x: torch.Tensor, qweight: QuantizedWeight, epilogue: Epilogue = IDENTITY, *,
         bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
         input_scale: torch.Tensor | None = None, weight: Callable[[], torch.Tensor] | None = None):
    """Quantized linear ``x [..., K] × qweight [N', K] -> [..., N]`` with a fused ``epilogue``.

    ``input_scale``: calibrated activation scale for static formats; ``weight``: returns a cached
    dequantized weight, called only when the reference path runs. Same result as
    :func:`reference.gemm` within the backend's documented tolerance."""
    backend = select_backend(x, qweight, epilogue)
    if backend is not None:
        return backend.run(x, qweight, epilogue, bias=bias, residual=residual, input_scale=input_scale)
    return reference.gemm(x, qweight, epilogue, bias=bias, residual=residual, input_scale=input_scale,
                          weight=weight() if weight is not None else None)


# The backends register at import, never on first use: a first call traced by torch.compile would
# otherwise import them inside the trace, where the lazy import's bookkeeping breaks the graph, and
# the break stays in the compiled code (one in every decoder layer of Llama-3.1-8B: H100, session
# 36). Importing the two packages is cheap (their kernel modules, and CuTeDSL, load when a kernel
# first runs); without CuTeDSL (no ``kernels`` extra) nothing registers and GEMMs take the reference.
if importlib.util.find_spec("cutlass") is not None:
    from quantkit.kernels import sm90, sm100  # noqa: F401
else:
    log.info("CuTeDSL (nvidia-cutlass-dsl) not installed: GEMMs take the PyTorch reference path")

__all__ = ["Backend", "Epilogue", "gemm", "prepare_layouts", "register_backend", "select_backend", "use_reference"]
