"""vLLM's Python sources for ``test_vllm_serving.py``, unpacked once from PyPI.

vLLM pins its own torch and ships CUDA kernels, so it cannot be installed beside the CPU torch of
the tests. Its model loader and quantization configs are plain Python, though: ``ensure()``
downloads the vLLM wheel (no dependencies), unpacks its ``.py`` / ``.json`` files, and installs
the few small packages its loader imports (``--target``, pinned), all under
``~/.cache/quantkit/vllm-<version>`` (or ``$QUANTKIT_VLLM_SRC``). The tests then put that folder
on ``PYTHONPATH`` of a subprocess. ``python tests/vllm_env.py`` does the same by hand.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

VERSION = "0.34.0"
# What vLLM 0.34's model loader imports beyond this project's test dependencies (versions inside
# vLLM's own requirements where it pins them).
DEPS = ("pyzmq==27.3.0", "pybase64==1.5.1", "cachetools==8.0.2", "cbor2==6.3.0", "msgspec==0.23.0",
        "uvloop==0.23.0", "prometheus_client==0.26.0", "llguidance==1.7.3", "xgrammar==0.2.8", "einops==0.8.2",
        "py-cpuinfo==9.0.0")


def default_root() -> Path:
    return Path(os.environ.get("QUANTKIT_VLLM_SRC", Path.home() / ".cache" / "quantkit" / f"vllm-{VERSION}"))


def ensure(root: Path | None = None) -> Path:
    """The folder holding vLLM's sources and loader dependencies; built on first use, and again
    when the pins change (pip, ~250 MB download, ~100 MB kept). Raises ``RuntimeError`` when pip
    cannot fetch them."""
    root = root or default_root()
    ready = "\n".join((f"vllm=={VERSION}", *DEPS))
    if (root / "READY").exists() and (root / "READY").read_text() == ready:
        return root
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    wheels = partial / "wheel"

    def pip(*args: str) -> None:
        command = [sys.executable, "-m", "pip", *args, "-q", "--no-deps", "--retries", "1", "--timeout", "30"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"pip {args[0]} failed: {done.stderr.strip()[-500:]}")

    pip("download", f"vllm=={VERSION}", "--only-binary", ":all:", "-d", str(wheels))
    with zipfile.ZipFile(next(wheels.glob("vllm-*.whl"))) as wheel:
        wheel.extractall(partial, [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith((".py", ".json"))])
    shutil.rmtree(wheels)
    pip("install", "--target", str(partial), *DEPS)
    (partial / "READY").write_text(ready)
    shutil.rmtree(root, ignore_errors=True)
    partial.rename(root)
    return root


if __name__ == "__main__":
    print(ensure())
