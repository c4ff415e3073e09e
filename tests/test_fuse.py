"""fuse_projections: q/k/v and gate/up as one GEMM each, the same function as the unfused model."""
from __future__ import annotations

import pytest
import torch

import quantkit
from quantkit.eval import bench
from quantkit.nn.fuse import FusedProjections, ProjectionSlice, concat_rows


def _tiny(fmt: str, seed: int = 0):
    torch.manual_seed(seed)
    model = bench.random_init_model(bench.load_config("tiny-llama"), device="cpu", dtype=torch.float32)
    if fmt != "bf16":
        quantkit.quantize_model(model, format=fmt)
    return model


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "nvfp4-w4a16", "nvfp4-w4a8", "fp8-block", "fp8-dynamic", "fp8", "mxfp8"])  # w4a8: below its thresholds
@torch.inference_mode()
def test_fused_model_computes_the_unfused_function(fmt):
    model = _tiny(fmt)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    members = [attn.q_proj, attn.k_proj, attn.v_proj]
    weights = torch.cat([m.weight.float() if fmt == "bf16" else m.dequantized_weight() for m in members])
    prompt = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(1))
    before = model(prompt).logits

    fused = quantkit.fuse_projections(model)

    layers = len(model.model.layers)
    assert sorted(fused) == [f"model.layers.{i}.{g}" for i in range(layers)
                             for g in ("mlp.gate_proj+up_proj", "self_attn.q_proj+k_proj+v_proj")]
    assert isinstance(attn.k_proj, ProjectionSlice) and isinstance(mlp.up_proj, ProjectionSlice)
    fused_linear = attn.fused_q_k_v.fused
    # the stacked weight is exactly the members' (the quantized values and scales, dequantized)
    assert torch.equal(fused_linear.weight.float() if fmt == "bf16" else fused_linear.dequantized_weight(), weights)
    torch.testing.assert_close(model(prompt).logits, before, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_slices_take_their_columns_in_any_order_and_release_the_output():
    model = _tiny("nvfp4")
    attn = model.model.layers[0].self_attn
    members = {name: getattr(attn, name) for name in ("q_proj", "k_proj", "v_proj")}
    x, y = torch.randn(3, 256), torch.randn(3, 256)
    want = {name: m(x) for name, m in members.items()} | {f"{name}@y": m(y) for name, m in members.items()}
    quantkit.fuse_projections(model)
    group = attn.fused_q_k_v
    calls = []
    group.fused.register_forward_hook(lambda *_: calls.append(1))
    assert torch.equal(attn.k_proj(x), want["k_proj"])  # alone: the GEMM runs for it
    assert torch.equal(attn.q_proj(y), want["q_proj@y"])  # another input: runs again
    assert torch.equal(attn.v_proj(y), want["v_proj@y"]) and torch.equal(attn.k_proj(y), want["k_proj@y"])
    assert len(calls) == 2 and group._outputs is None and group._input is None  # released after the last member
    assert torch.equal(attn.q_proj(x), want["q_proj"]) and len(calls) == 3


@torch.inference_mode()
def test_groups_that_do_not_stack_exactly_stay_unfused():
    model = _tiny("nvfp4")
    attn = model.model.layers[0].self_attn
    attn.k_proj.weight_tensor_scale.mul_(2)  # no longer the group's shared tensor scale
    fused = quantkit.fuse_projections(model)
    assert "model.layers.0.self_attn.q_proj+k_proj+v_proj" not in fused
    assert "model.layers.0.mlp.gate_proj+up_proj" in fused
    assert not any(isinstance(m, FusedProjections) for m in attn.children())

    fmt = quantkit.get_format("fp8-block")
    w = [fmt.quantize_weight(torch.randn(n, 256)) for n in (64, 128)]
    with pytest.raises(ValueError, match="multiple of the 128-row scale block"):
        concat_rows(w)  # the first member's last 128-row scale block would cover the second's rows
    assert concat_rows(w[::-1]).shape == (192, 256)  # a ragged last member is fine


def test_save_refuses_a_fused_model(tmp_path):
    model = _tiny("fp8-block")
    quantkit.fuse_projections(model)
    with pytest.raises(ValueError, match="fused for inference"):
        quantkit.save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bench_fuse_times_the_fused_gemms():
    model = bench.random_init_model(bench.load_config("tiny-llama"), device="cpu")  # bf16, as bench runs it
    quantkit.quantize_model(model, format="nvfp4")
    settings = bench.BenchSettings(prefill_shapes=((1, 8),), decode_batches=(), gemm_m=(2,), warmup=0, iters=1,
                                   fuse=True)
    gemms = {(r.layer, r.n, r.k) for r in bench.bench_model(model, "nvfp4", settings).gemms}
    assert ("self_attn.fused_q_k_v.fused", 512, 256) in gemms and ("mlp.fused_gate_up.fused", 1024, 256) in gemms
    assert not any(layer.endswith(("q_proj", "up_proj")) for layer, _, _ in gemms)
