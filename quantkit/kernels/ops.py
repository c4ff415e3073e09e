"""``torch.library`` ops for the kernels, with an eager path that skips the dispatcher.

Each kernel entry point is an op so that ``torch.compile`` traces one opaque node for every ``M``
(its fake implementation gives the output shapes, no graph break, no recompile). Called in eager
mode, an op with a Python kernel goes through the dispatcher first, which costs µs of host time per
call, up to a decode GEMV's GPU time: :func:`call` therefore runs the op's Python function directly
unless ``torch.compile`` is tracing; a CUDA graph captures the same kernel launches either way.
Host µs per call of both registrations: ``benchmarks/op_dispatch.py``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_LIBRARIES: dict[str, torch.library.Library] = {}


class KernelOp:
    """The custom op ``namespace::name`` around ``function``: calling it goes through the dispatcher
    (what ``torch.compile`` traces, one opaque node), :func:`call` runs ``function`` directly in
    eager mode. Defined through ``torch.library.Library`` (one ``CompositeExplicitAutograd`` kernel,
    inference only) rather than ``torch.library.custom_op``, whose per-call Python wrapper (autograd
    and aliasing checks) costs more host time than a kernel launch."""

    def __init__(self, name: str, function: Callable[..., Any]):
        namespace, op_name = name.split("::")
        if namespace not in _LIBRARIES:
            _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
        self.library = _LIBRARIES[namespace]
        self.library.define(op_name + torch.library.infer_schema(function, mutates_args=()))
        self.library.impl(op_name, function, "CompositeExplicitAutograd")
        self.name, self.function = name, function
        self.overload = getattr(getattr(torch.ops, namespace), op_name).default

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.overload(*args, **kwargs)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: ``fake`` gives the output shapes and dtypes (for ``torch.compile``)."""
        torch.library.register_fake(self.name, fake, lib=self.library)
        return fake


def kernel_op(name: str) -> Callable[[Callable[..., Any]], KernelOp]:
    """Decorator: register the function as the custom op ``name`` (``"namespace::op"``, no mutated
    inputs; the schema comes from its annotations) and return its :class:`KernelOp`."""
    return lambda function: KernelOp(name, function)


def call(op: KernelOp, *args: Any, **kwargs: Any) -> Any:
    """``op(*args, **kwargs)``: through the dispatcher while ``torch.compile`` traces, else its
    Python function directly (same result, less host time)."""
    if torch.compiler.is_compiling():
        return op(*args, **kwargs)
    return op.function(*args, **kwargs)
