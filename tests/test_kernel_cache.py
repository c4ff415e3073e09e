"""quantkit.kernels.cache: arch strings, pinning, and compile-once behaviour (CPU, compile-only)."""

import os
import sys

import pytest

from quantkit.kernels import cache


@pytest.mark.parametrize(
    ("capability", "arch"),
    [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((8, 9), "sm_89"), ((8, 0), "sm_80"), ((12, 0), "sm_120a")],
)
def test_arch_for_capability(capability, arch):
    assert cache.arch_for_capability(*capability) == arch


def test_pin_arch_sets_env_and_refuses_a_second_arch(monkeypatch):
    monkeypatch.delenv(cache.ARCH_ENV, raising=False)
    monkeypatch.delitem(sys.modules, "cutlass", raising=False)
    assert cache.pin_arch("sm_90a") == "sm_90a"
    assert os.environ[cache.ARCH_ENV] == "sm_90a"
    assert cache.pin_arch() == "sm_90a"  # env wins when no arch is passed
    monkeypatch.setitem(sys.modules, "cutlass", object())
    with pytest.raises(RuntimeError, match="cannot re-pin"):
        cache.pin_arch("sm_100a")


def test_compile_kernel_traces_once_per_key_and_targets_the_given_arch(tmp_path):
    cutlass = pytest.importorskip("cutlass")
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    traced = []

    @cute.kernel
    def double(a: cute.Tensor, b: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        b[tid] = a[tid] * 2.0

    @cute.jit
    def launch(a: cute.Tensor, b: cute.Tensor):
        traced.append(1)
        double(a, b).launch(grid=(1, 1, 1), block=(32, 1, 1))

    x = make_fake_compact_tensor(cutlass.Float32, (32,))
    opts = f"--keep-ptx --dump-dir {tmp_path}"
    first = cache.compile_kernel(("double", "test-cache"), launch, x, x, arch="sm_90a", options=opts)
    again = cache.compile_kernel(("double", "test-cache"), launch, x, x, arch="sm_90a", options=opts)
    other = cache.compile_kernel(("double", "test-cache"), launch, x, x, arch="sm_100a", options=opts)
    assert first is again and other is not first
    assert len(traced) == 2
    assert (("double", "test-cache"), "sm_90a") in cache.cached_keys()
    targets = sorted(line.split()[1] for p in tmp_path.glob("*.ptx") for line in p.read_text().splitlines() if line.startswith(".target"))
    assert targets == ["sm_100a", "sm_90a"]
