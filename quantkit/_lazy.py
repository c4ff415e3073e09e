"""Lazy package attributes: import a submodule only when one of its names is first used."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_getattr(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that returns ``table[name]``'s attribute ``name``
    (``table`` maps a public name to the module defining it)."""

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
