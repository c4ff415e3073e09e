"""Arch pinning and the compile cache shared by every CuTeDSL kernel in quantkit.

* **Arch.** CuTeDSL silently targets ``sm_100a`` when it sees no GPU, and reads
  ``CUTE_DSL_ARCH`` once, when it is imported. :func:`pin_arch` sets that variable before the
  import, and :func:`compile_kernel` also passes ``--gpu-arch`` to every ``cute.compile``, so the
  target is explicit per compile (compile-only checks for sm_90a and sm_100a can share a process).
* **In-process cache.** ``cute.compile`` traces Python (milliseconds to seconds) and is not
  thread-safe: :func:`compile_kernel` compiles each ``(key, arch, options)`` once, under a lock, and
  keeps the executor it returns (a compile with other options, e.g. a PTX dump, is a compile of its own).
* **Executors.** With ``tvm_ffi`` the executor uses CuTeDSL's apache-tvm-ffi calling convention
  (a C++ argument path: ~16-21 µs per eager launch on the H200 host against 58-79 µs through the
  default Python executor; stream handle as an int). Launchers choose it by :func:`use_tvm_ffi`
  and pass :func:`launch_stream`.
* **Across processes.** CuTeDSL itself keeps compiled modules on disk, keyed by the hash of the
  traced IR (``CUTE_DSL_CACHE_DIR``, default ``$TMPDIR/$USER/cutlass_python_cache``), so a second
  process re-traces (milliseconds) but skips the lowering to PTX/cubin. CuTeDSL's ``export_to_c``
  object-file export would also skip the tracing, but it needs the CUDA runtime at export time, so
  it cannot be built or tested on a CPU-only machine; it is not used.

Nothing here imports CuTeDSL or torch.cuda at module import time.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
import threading
import warnings
from collections.abc import Callable, Hashable
from typing import Any

ARCH_ENV = "CUTE_DSL_ARCH"

# Architectures with arch-specific ("a") instructions (wgmma, setmaxnreg, tcgen05) we compile for.
_ARCH_SPECIFIC = {(9, 0), (10, 0), (10, 3), (12, 0), (12, 1)}

_lock = threading.Lock()
_compiled: dict[tuple[Hashable, str, str], Any] = {}

USE_TVM_FFI = True  # launch through tvm-ffi executors where apache-tvm-ffi is installed

NO_TVM_FFI = ("apache-tvm-ffi is not installed: the kernels launch through CuTeDSL's default executor, "
              "~40-60 µs more host time per launch (prefill, eager or compiled, turns host-bound); "
              "install the kernels extra (pip install -e '.[kernels]')")


@functools.cache
def tvm_ffi_available() -> bool:
    """Whether apache-tvm-ffi is importable (CuTeDSL's ``--enable-tvm-ffi`` executors need it)."""
    return importlib.util.find_spec("tvm_ffi") is not None


def use_tvm_ffi() -> bool:
    """Whether launchers compile and call tvm-ffi executors (:data:`USE_TVM_FFI` and available).
    Launchers ask before every launch; the first time apache-tvm-ffi is missing, this warns
    (``RuntimeWarning``: :data:`NO_TVM_FFI`) once per process."""
    available = tvm_ffi_available()
    if not available:
        _warn_no_tvm_ffi()
    return USE_TVM_FFI and available


@functools.cache
def _warn_no_tvm_ffi() -> None:
    warnings.warn(NO_TVM_FFI, RuntimeWarning, stacklevel=3)


def launch_stream(device, tvm_ffi: bool):
    """The current CUDA stream of ``device`` as an executor takes it: the raw handle (tvm-ffi)
    or a ``cuda.CUstream``."""
    import torch

    stream = torch.cuda.current_stream(device).cuda_stream
    if tvm_ffi:
        return stream
    import cuda.bindings.driver as cuda

    return cuda.CUstream(stream)


def data_ptr(tensor) -> int:
    """A tensor's data pointer as the executors take it: 0 for ``None`` (an unused operand)."""
    return 0 if tensor is None else tensor.data_ptr()


@functools.cache
def num_sms(device) -> int:
    """Streaming multiprocessors of the CUDA ``device`` (cached: launch paths ask on every call)."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def arch_for_capability(major: int, minor: int) -> str:
    """CuTeDSL arch string for a compute capability, e.g. ``(9, 0) -> "sm_90a"``, ``(8, 9) -> "sm_89"``."""
    suffix = "a" if (major, minor) in _ARCH_SPECIFIC else ""
    return f"sm_{major}{minor}{suffix}"


def device_arch(device: int | None = None) -> str:
    """Arch string of CUDA device ``device`` (default: the current one); RuntimeError without a GPU."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible: pass an explicit arch (e.g. 'sm_90a') to compile only")
    return arch_for_capability(*torch.cuda.get_device_capability(device))


def pin_arch(arch: str | None = None) -> str:
    """Fix the CuTeDSL target: ``arch`` if given, else ``$CUTE_DSL_ARCH``, else the visible GPU's.

    Sets ``CUTE_DSL_ARCH`` (which CuTeDSL reads when imported) and returns the arch string. Raises
    RuntimeError if CuTeDSL was already imported with a different ``CUTE_DSL_ARCH``.
    """
    arch = arch or os.environ.get(ARCH_ENV) or device_arch()
    previous = os.environ.get(ARCH_ENV)
    if "cutlass" in sys.modules and previous not in (None, arch):
        raise RuntimeError(f"CuTeDSL was imported with {ARCH_ENV}={previous}; cannot re-pin it to {arch} in this process")
    os.environ[ARCH_ENV] = arch
    return arch


def compile_kernel(key: Hashable, fn: Callable[..., Any], *args: Any, arch: str | None = None, options: str = "",
                   tvm_ffi: bool = False) -> Any:
    """``cute.compile(fn, *args)`` for ``arch`` (default: :func:`pin_arch`), once per ``(key, arch, options)``.

    An explicit ``arch`` is passed to ``cute.compile`` as ``--gpu-arch`` and does not re-pin the
    process, so compile-only checks may target several archs in one process.

    ``key`` must name everything that changes the generated code besides the arch (kernel, tile
    config, dtypes, epilogue); ``args`` are the (fake or real) tensors/scalars ``cute.compile`` traces
    with. ``options`` are extra ``cute.compile`` options (e.g. ``"--keep-ptx --dump-dir D"``).
    With ``tvm_ffi`` the executor uses the apache-tvm-ffi calling convention (cached apart).
    Returns the compiled executor (call it with real tensors).
    """
    arch = arch or pin_arch()
    if tvm_ffi:
        options = f"{options} --enable-tvm-ffi".strip()
    cache_key = (key, arch, options)
    hit = _compiled.get(cache_key)
    if hit is not None:
        return hit
    with _lock:
        hit = _compiled.get(cache_key)
        if hit is None:
            import cutlass.cute as cute

            hit = cute.compile(fn, *args, options=f"--gpu-arch {arch} {options}".strip())
            _compiled[cache_key] = hit
    return hit


def cached_keys() -> list[tuple[Hashable, str, str]]:
    """The ``(key, arch, options)`` triples compiled in this process so far."""
    return list(_compiled)
