"""quantkit.kernels.cache: arch strings, pinning, and compile-once behaviour (CPU, compile-only)."""

import os
import subprocess
import sys
import textwrap
import warnings

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
    assert (("double", "test-cache"), "sm_90a", opts) in cache.cached_keys()
    targets = sorted(line.split()[1] for p in tmp_path.glob("*.ptx") for line in p.read_text().splitlines() if line.startswith(".target"))
    assert targets == ["sm_100a", "sm_90a"]


def test_sm90_kernels_compile_to_tvm_ffi_executors():
    """The launch path every sm90 op takes where apache-tvm-ffi is installed: NVFP4 GEMV, W4A16 and
    W4A8 WGMMA, W4A8 activation quantization, fp8-block GEMM (plain and requant), fp8 act-quant."""
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    script = textwrap.dedent("""
        import os
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"
        from quantkit.kernels.epilogue import Epilogue
        from quantkit.kernels.sm90 import act_quant as aq, fp8_block_gemm as fbg
        from quantkit.kernels.sm90 import nvfp4_gemv as gv
        from quantkit.kernels.sm90 import nvfp4_gemm as ng, nvfp4_w4a8 as nw8
        fn = gv.compile_gemv(gv.pick_gemv_config(1, 4096, 4096, Epilogue()), Epilogue(), tvm_ffi=True, arch="sm_90a")
        print(type(fn).__name__)
        for w4a8 in (False, True):
            cfg = ng.pick_config(2048, 4096, 4096, Epilogue(), w4a8)
            print(type(ng.compile_gemm(cfg, Epilogue(), w4a8, tvm_ffi=True, arch="sm_90a")).__name__)
        print(type(nw8.compile_act_quant(tvm_ffi=True, arch="sm_90a")).__name__)
        for epi in (Epilogue(), Epilogue(bias=True, activation="silu", requant="fp8-block")):
            cfg = fbg.pick_config(4096, 4096, 4096, epi)
            print(type(fbg.compile_gemm(cfg, epi, tvm_ffi=True, arch="sm_90a")).__name__)
        print(type(aq.compile_act_quant(True, tvm_ffi=True, arch="sm_90a")).__name__)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=dict(os.environ, CUTE_DSL_ARCH="sm_90a"),
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("TVMFFI") == 7, proc.stdout


@pytest.mark.parametrize("available", [False, True])
def test_launchers_warn_once_without_tvm_ffi(monkeypatch, available):
    """A launch without apache-tvm-ffi costs ~40-60 µs more host time: the first launcher to ask
    says so (once per process); with it installed nothing is said and tvm-ffi executors are used."""
    monkeypatch.setattr(cache, "tvm_ffi_available", lambda: available)
    cache._warn_no_tvm_ffi.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [cache.use_tvm_ffi() for _ in range(3)] == [available] * 3
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert said == ([] if available else [cache.NO_TVM_FFI])
    cache._warn_no_tvm_ffi.cache_clear()
