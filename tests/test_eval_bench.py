"""quantkit bench: shipped configs are the real architectures, timing arithmetic, and an end-to-end
run on a tiny random-init model (CPU)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.eval import bench, commands
from quantkit.eval.commands import bench_command
from quantkit.nn.attention import PACKED_GQA_FLEX, PACKED_GQA_SDPA


@pytest.mark.parametrize(
    ("name", "architecture", "parameters"),
    [
        ("llama-3.1-8b", "LlamaForCausalLM", 8_030_261_248),  # published parameter counts
        ("qwen3-8b", "Qwen3ForCausalLM", 8_190_735_360),
    ],
)
def test_shipped_configs_are_the_published_architectures(name, architecture, parameters):
    assert name in bench.shipped_configs()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(bench.load_config(name))
    assert type(model).__name__ == architecture
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_load_config_reports_the_shipped_names(tmp_path):
    with pytest.raises(FileNotFoundError, match="llama-3.1-8b"):
        bench.load_config("no-such-model")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 96}))
    assert bench.load_config(str(tmp_path)).hidden_size == 96


@pytest.mark.parametrize("target,random_init,message", [
    ("nvfp4", "no-such-model", "--random-init no-such-model: no config 'no-such-model': give a config.json path or one of"),
    ("nvfp4", "{cfg}", "has no model_type: not a Hugging Face config.json"),
    ("nvfp4,int3", "tiny-llama", "unknown format 'int3'; valid formats: nvfp4,"),
])
def test_bench_bad_input_is_one_clear_error(tmp_path, capsys, target, random_init, message):
    import typer

    (tmp_path / "cfg.json").write_text('{"hidden_size": 64}')
    with pytest.raises(typer.Exit) as exit_info:
        bench_command(target, random_init=random_init.format(cfg=tmp_path / "cfg.json"), device="cpu", out=tmp_path / "out")
    assert exit_info.value.exit_code == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "out").exists()


def test_random_init_model_is_on_device_in_bf16_and_seeded():
    config = bench.load_config("tiny-llama")
    a = bench.random_init_model(config, device="cpu", seed=1)
    b = bench.random_init_model(config, device="cpu", seed=1)
    assert {p.dtype for p in a.parameters()} == {torch.bfloat16}
    assert torch.equal(a.model.layers[0].mlp.up_proj.weight, b.model.layers[0].mlp.up_proj.weight)
    assert a.model.layers[0].mlp.up_proj.weight.std() > 0


def test_time_call_is_the_median_of_the_timed_calls(monkeypatch):
    clock = iter([0.0, 1.0, 1.0, 4.0, 4.0, 6.0])  # timed calls of 1 s, 3 s, 2 s
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    calls = []
    assert bench.time_call(lambda: calls.append(1), warmup=2, iters=3, device=torch.device("cpu")) == 2.0
    assert len(calls) == 5


def test_layer0_linears_are_the_models_gemm_shapes():
    model = bench.random_init_model(bench.load_config("tiny-llama"), device="cpu")
    shapes = {name: (m.out_features, m.in_features) for name, m in bench.layer0_linears(model).items()}
    assert shapes == {
        "self_attn.q_proj": (256, 256),
        "self_attn.k_proj": (128, 256),  # 2 KV heads of 64
        "self_attn.v_proj": (128, 256),
        "self_attn.o_proj": (256, 256),
        "mlp.gate_proj": (512, 256),
        "mlp.up_proj": (512, 256),
        "mlp.down_proj": (256, 512),
        "lm_head": (1024, 256),
    }


def test_bench_command_end_to_end_on_tiny_random_init(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    attention = []  # each model's attention implementation as bench_model measures it
    real_bench_prefill = bench.bench_prefill
    monkeypatch.setattr(bench, "bench_prefill", lambda model, *a: attention.append(
        model.config._attn_implementation) or real_bench_prefill(model, *a))
    bench_command(
        target="nvfp4",
        random_init="tiny-llama",
        device="cpu",
        prefill="1x32,2x16",
        decode_batches="1,2",
        context=8,
        decode_steps=3,
        gemm_m="1,8",
        warmup=1,
        iters=2,
        prefill_graph_tokens=64,
        out=tmp_path,
    )
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["baseline"] == "bf16" and report["meta"]["prefill_graph_tokens"] == 64
    assert report["meta"]["flex_attention"] is False  # resolved: not compiled, not on CUDA
    assert [m["model"] for m in report["models"]] == ["bf16", "nvfp4"]
    assert attention == [PACKED_GQA_SDPA] * 2  # both models: tiny-llama has 2 query heads per KV head
    for model in report["models"]:
        assert [(r["batch"], r["seq"]) for r in model["prefill"]] == [(1, 32), (2, 16)]
        for r in model["prefill"]:
            assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq"] / r["seconds"])
            assert r["cuda_graph"] is False and r["note"] is None  # CPU: no CUDA graphs, nothing failed
        assert [(r["batch"], r["context"], r["cuda_graph"]) for r in model["decode"]] == [(1, 8, False), (2, 8, False)]
        for r in model["decode"]:
            assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["seconds_per_step"])
        assert len(model["gemms"]) == 8 * 2
        for r in model["gemms"]:
            assert r["tflops"] == pytest.approx(2 * r["m"] * r["n"] * r["k"] / r["seconds"] / 1e12)
            assert r["cuda_graph"] is False  # CPU: eager calls, and the report says so
    markdown = (tmp_path / "bench.md").read_text()
    assert "| nvfp4 | 16 of 16 |" in markdown and "GEMMs timed as eager calls" in markdown
    assert "| batch | seq | bf16 tok/s | nvfp4 tok/s | nvfp4 × |" in markdown
    assert "| mlp.down_proj | 256 | 512 | 8 |" in markdown
    assert (tmp_path / "bench_throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("bf16: ", "nvfp4: "))]
    for name, model in zip(("nvfp4", "bf16"), report["models"][::-1]):  # measured in this order, each as it finished
        tokens = [f"{r['tokens_per_s']:,.0f}" for r in model["prefill"]]
        assert [line for line in progress if line.startswith(name)][:3] == [
            f"{name}: prefill 1x32: {tokens[0]} tokens/s", f"{name}: prefill 2x16: {tokens[1]} tokens/s",
            f"{name}: decode batch 1: {model['decode'][0]['tokens_per_s']:,.1f} tokens/s"]
    assert len(progress) == 2 * (2 + 2 + 8)  # prefill shapes, decode batches, linears


@pytest.mark.parametrize("flex,backend,device,expected", [
    (None, "inductor", "cuda", True), (None, "inductor", "cuda:1", True), (None, None, "cuda", False),
    (None, "inductor", "cpu", False), (False, "inductor", "cuda", False), (True, "inductor", "cpu", True)])
def test_bench_model_attends_through_flex_when_compiled_on_cuda_unless_told(monkeypatch, flex, backend, device,
                                                                           expected):
    """FlexAttention is the default for compiled decode steps on CUDA (faster there at batch 1, 8 and
    32); an explicit ``flex_attention`` wins; the model is switched before anything is timed."""
    seen = []
    monkeypatch.setattr(bench, "model_device", lambda model: torch.device(device))
    for stage in ("bench_prefill", "bench_decode", "bench_gemms"):
        monkeypatch.setattr(bench, stage, lambda model, *a: seen.append(model.config._attn_implementation) or [])
    settings = bench.BenchSettings(compile=backend, flex_attention=flex)
    assert settings.uses_flex(device) is expected
    bench.bench_model(bench.random_init_model(bench.load_config("tiny-llama"), device="cpu"), "bf16", settings)
    assert seen == [PACKED_GQA_FLEX if expected else PACKED_GQA_SDPA] * 3


@pytest.mark.parametrize("device,tvm_ffi,warned", [("cuda", False, True), ("cuda:1", False, True), ("cuda", True, False),
                                                   ("cpu", False, False)])
def test_bench_warns_on_cuda_without_tvm_ffi(monkeypatch, device, tvm_ffi, warned):
    """Without apache-tvm-ffi the kernels' launches take ~40-60 µs more host time: a CUDA bench says so."""
    monkeypatch.setattr("quantkit.kernels.cache.tvm_ffi_available", lambda: tvm_ffi)
    warning = commands._launch_warning(device)
    assert (warning is not None) == warned
    assert warning is None or "apache-tvm-ffi" in warning and ".[kernels]" in warning


def test_bench_tables_leave_out_what_the_run_did_not_measure():
    from quantkit.eval.report import bench_tables

    prefill_only = [bench.ModelBench(name, [bench.PrefillResult(1, 64, s, 64 / s)], [], [])
                    for name, s in (("bf16", 0.002), ("nvfp4", 0.001))]
    tables = bench_tables(prefill_only, prefill_only[0])
    assert list(tables) == ["Prefill tokens/s"]
    assert tables["Prefill tokens/s"][1] == [["1", "64", "32,000", "64,000", "2.00"]]


@pytest.mark.parametrize(("tokens", "device", "fails", "expected"), [
    (512, "cuda", False, "graph"),  # at the limit: replayed
    (513, "cuda", False, "forward"),  # past it: host-launched
    (16, "cpu", False, "forward"),  # no CUDA graphs off CUDA
    (16, "cuda", True, "forward"),  # capture failed: host-launched, with the reason
])
def test_prefill_replays_cuda_graphs_up_to_the_token_limit(monkeypatch, tokens, device, fails, expected):
    captured = []

    class Graph:
        def replay(self):
            return "graph"

    def capture(step, warmup):
        captured.append(warmup)
        if fails:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        return Graph()

    monkeypatch.setattr(bench, "capture_graph", capture)
    settings = bench.BenchSettings(prefill_graph_tokens=512, warmup=2)
    call, graph, note = bench.prefill_call(lambda: "forward", tokens, settings, torch.device(device))
    assert call() == expected and graph == (expected == "graph")
    assert captured == ([2] if device == "cuda" and tokens <= 512 else [])
    assert (note == "CUDA graph capture failed, host-launched forwards: operation not permitted when stream is "
            "capturing") == fails


def test_bench_report_names_the_prefill_shapes_timed_as_graphs():
    from quantkit.eval.report import bench_tables

    results = [bench.PrefillResult(1, 512, 0.01, 51_200, cuda_graph=True),
               bench.PrefillResult(1, 2048, 0.04, 51_200),
               bench.PrefillResult(8, 64, 0.01, 51_200, note="CUDA graph capture failed, host-launched forwards: x")]
    benches = [bench.ModelBench("bf16", results, [], [])]
    assert bench_tables(benches, benches[0])["Prefill shapes timed as CUDA graphs"][1] == [
        ["bf16", "1x512", "CUDA graph replays (no host launch time)"],
        ["bf16", "8x64", "CUDA graph capture failed, host-launched forwards: x"],
    ]


def test_layer0_linears_finds_quantlinear_layers():
    """GEMM timings of a quantized model time its QuantLinear layers (lm_head stays bf16)."""
    import quantkit

    model = bench.random_init_model(bench.load_config("tiny-llama"), device="cpu")
    quantkit.quantize_model(model, format="nvfp4")
    kinds = {name: type(m).__name__ for name, m in bench.layer0_linears(model).items()}
    assert kinds.pop("lm_head") == "Linear"
    assert set(kinds.values()) == {"QuantLinear"}


def _full_recompute_greedy(model, prompt, n):
    """Greedy continuation of ``prompt`` by re-running the whole sequence each step (no cache)."""
    seq = prompt
    for _ in range(n):
        seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompt.shape[1]:]


@torch.inference_mode()
def test_greedy_decoder_continues_like_a_full_recompute():
    model = bench.random_init_model(bench.load_config("tiny-llama"), device="cpu", dtype=torch.float32)
    prompt = torch.randint(0, 1024, (3, 12), generator=torch.Generator().manual_seed(0))
    step, tokens = bench.greedy_decoder(model, prompt, max_cache_len=20)
    got = [tokens.clone()]
    for _ in range(5):
        step()
        got.append(tokens.clone())
    assert torch.equal(torch.cat(got, dim=1), _full_recompute_greedy(model, prompt, 6))


def _decode_tokens(model, prompt, steps, compile_backend=None, max_cache_len=None):
    """int64 ``[B, steps]``: the tokens of ``steps`` greedy decoder steps after ``prompt``."""
    step, tokens = bench.greedy_decoder(model, prompt, max_cache_len or prompt.shape[1] + steps + 1,
                                        compile_backend=compile_backend)
    out = []
    for _ in range(steps):
        step()
        out.append(tokens.clone())
    return torch.cat(out, 1)


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@torch.inference_mode()
def test_compiled_decode_steps_are_one_graph_equal_to_eager_steps(fmt, fuse):
    """``bench --compile``: dynamo captures a whole decode step (static cache, QuantLinear custom
    ops; with ``fuse``, the fused projections' slices) as one graph, compiled once for all steps,
    and the steps decode the eager (unfused) tokens."""
    from torch._dynamo.utils import counters

    import quantkit

    model = bench.random_init_model(bench.load_config("tiny-llama"), device="cpu", dtype=torch.float32)
    if fmt != "bf16":
        quantkit.quantize_model(model, format=fmt)
    prompt = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(0))
    eager = _decode_tokens(model, prompt, 6)
    if fuse:
        quantkit.fuse_projections(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = _decode_tokens(model, prompt, 6, compile_backend="aot_eager")
    assert torch.equal(compiled, eager)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_compiled_decode_is_one_static_graph_per_model_and_batch_size():
    """``bench --compile`` decode: every batch size of every model gets its own graph with a static
    batch (a symbolic one sends FlexAttention to its prefill template on the GPU), also past
    dynamo's limit of 8 compiled graphs per function (beyond it, steps would silently run eager)."""
    import quantkit

    batches = []

    def backend(gm, example_inputs):  # records the batch size the graph was specialized to
        tokens = next(n for n in gm.graph.find_nodes(op="placeholder") if "tokens" in n.name)
        batches.append(tokens.meta["example_value"].shape[0])
        return gm.forward

    settings = bench.BenchSettings(decode_batches=(1, 3, 2), context=8, decode_steps=2, warmup=1, compile=backend)
    for fmt in ("bf16", "nvfp4-w4a16", "fp8-block"):
        model = bench.random_init_model(bench.load_config("tiny-llama"), device="cpu", dtype=torch.float32)
        if fmt != "bf16":
            quantkit.quantize_model(model, format=fmt)
        bench.bench_decode(model, settings)
    assert batches == [1, 3, 2] * 3 and all(type(b) is int for b in batches)


def test_compiled_prefill_times_the_compiled_model(monkeypatch):
    """``bench --compile`` prefill: every shape runs through one ``torch.compile`` of the model."""
    import quantkit

    model = bench.random_init_model(bench.load_config("tiny-llama"), device="cpu", dtype=torch.float32)
    quantkit.quantize_model(model, format="nvfp4")
    compiled = []
    real_compile = torch.compile

    def spy(fn, **kwargs):
        compiled.append((fn, kwargs))
        return real_compile(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    settings = bench.BenchSettings(prefill_shapes=((1, 16), (2, 8)), warmup=1, iters=1, compile="aot_eager")
    results = bench.bench_prefill(model, settings)
    assert compiled == [(model, {"backend": "aot_eager"})]
    assert [(r.batch, r.seq) for r in results] == [(1, 16), (2, 8)] and all(r.seconds > 0 for r in results)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4-w4a16", "fp8-block"])
@pytest.mark.parametrize("shape", [(8, 1), (4, 16)])
@torch.inference_mode()
def test_inductor_forward_with_sm90_kernels_matches_eager(fmt, shape):
    """What ``bench --compile`` relies on, on the GPU: Inductor compiles the model around the sm90
    kernels' custom ops, its logits match the eager ones, and a CUDA-graph replay of the compiled
    call repeats it bit for bit. Inductor keeps the fused norms and SiLU in FP32 where eager rounds
    each op to bf16, which flips some FP8 activation roundings: fp8-block logits moved by up to 3 %
    of their max (H200), hence a norm bound of 5 % (a wrong op would be off by ~100 %)."""
    import quantkit

    model = bench.random_init_model(bench.load_config("tiny-llama"), device="cuda")
    quantkit.quantize_model(model, format=fmt)
    ids = torch.randint(0, 1024, shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    eager = model(input_ids=ids).logits.float()
    compiled = torch.compile(model, backend="inductor")
    out = compiled(input_ids=ids).logits
    assert (out.float() - eager).norm() <= 0.05 * eager.norm()
    graph = bench.capture_graph(lambda: out.copy_(compiled(input_ids=ids).logits), warmup=2)
    first = out.clone()
    out.zero_()
    graph.replay()
    assert torch.equal(out, first)


@pytest.mark.gpu
@torch.inference_mode()
def test_decode_cuda_graph_replays_equal_eager_steps():
    model = bench.random_init_model(bench.load_config("tiny-llama"), device="cuda")
    prompt = torch.randint(0, 1024, (4, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    eager = _decode_tokens(model, prompt, 10, max_cache_len=40)
    step, tokens = bench.greedy_decoder(model, prompt, max_cache_len=40)
    graph = bench.capture_graph(step, warmup=3)
    replayed = []
    for _ in range(7):
        graph.replay()
        replayed.append(tokens.clone())
    assert torch.equal(torch.cat(replayed, 1), eager[:, 3:])
