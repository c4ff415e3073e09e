"""A stand-in for torchvision on the vLLM driver's ``PYTHONPATH`` (``test_multimodal.py``).

vLLM's Gemma 3 multimodal model imports transformers' Gemma 3 image processor, which imports
torchvision at module level; no torchvision build matches the tests' CPU torch, and loading and
running the checkpoint's layers never processes an image. Here every ``torchvision.*`` module
exists and every name in it is an inert class (``InterpolationMode`` an enum, as transformers
reads its members)."""
import importlib.abc
import importlib.machinery
import sys
import types
from enum import Enum

__version__ = "0.0"


class InterpolationMode(Enum):
    NEAREST, NEAREST_EXACT, BILINEAR, BICUBIC, BOX, HAMMING, LANCZOS = (
        "nearest", "nearest-exact", "bilinear", "bicubic", "box", "hamming", "lanczos")


class _Inert:
    def __init__(self, *args, **kwargs):
        pass


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return InterpolationMode if name == "InterpolationMode" else type(name, (_Inert,), {})


class _Modules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True) if fullname.startswith(__name__ + ".") else None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__, module.__getattr__ = [], __getattr__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Modules())
