"""``torch.library`` custom ops for the kernels, with an eager path that skips the dispatcher.

Each kernel entry point is a custom op so that ``torch.compile`` traces one opaque node for every
``M`` (its fake implementation gives the output shapes, no graph break, no recompile). Called in
eager mode, a Python custom op goes through the dispatcher first, which costs tens of µs of host
time per call (~50 µs on the 2-core CI machine for a 5-argument op, against ~7 µs for the same
function called directly): more than a decode GEMV takes on the GPU. :func:`call` therefore runs
the op's Python function directly unless ``torch.compile`` is tracing; a CUDA graph captures the
same kernel launches either way.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_FUNCTIONS: dict[Any, Callable[..., Any]] = {}


def kernel_op(name: str) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: register the function as the custom op ``name`` (``"namespace::op"``, no mutated
    inputs; the schema comes from its annotations) and return the op (``register_fake`` etc. as
    usual); :func:`call` runs the function itself in eager mode."""
    def register(fn: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(name, fn, mutates_args=())
        _FUNCTIONS[op] = fn
        return op
    return register


def call(op: Any, *args: Any, **kwargs: Any) -> Any:
    """``op(*args, **kwargs)`` for an op made by :func:`kernel_op`: through the dispatcher while
    ``torch.compile`` traces, else its Python function directly (same result, less host time)."""
    if torch.compiler.is_compiling():
        return op(*args, **kwargs)
    return _FUNCTIONS[op](*args, **kwargs)
