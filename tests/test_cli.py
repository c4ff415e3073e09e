"""`quantkit quantize` / `inspect` end to end on a tiny local model, offline."""
import pytest
import torch
from typer.testing import CliRunner

import quantkit
from quantkit.cli import app
from quantkit.nn.kv_cache import kv_scales
from test_eval_fixtures import tiny_llama, tiny_tokenizer

runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), max_positions=128).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("fmt,export", [("nvfp4", "compressed-tensors"), ("nvfp4-4over6", "modelopt"), ("fp8", "modelopt"),
                                        ("mxfp8", "compressed-tensors")])
def test_quantize_writes_a_checkpoint_that_loads(model_dir, tmp_path, fmt, export):
    out = tmp_path / "q"
    res = run("quantize", model_dir, "--out", out, "--format", fmt, "--export", export, "--samples", 4, "--seq-len", 32)
    assert res.exit_code == 0, res.output
    assert "layers quantized" in res.output and f"wrote {out}" in res.output
    assert "│ model.layers.0.self_attn.q_proj │" in res.output  # not folded to 80 columns in a log
    model = quantkit.load(out)
    layers = [m for m in model.modules() if isinstance(m, quantkit.QuantLinear)]
    assert len(layers) == 14 and all(m.format == fmt for m in layers)
    assert (fmt == "mxfp8") == all(m.input_scale is None for m in layers)  # static formats were calibrated
    logits = model(torch.randint(0, 100, (1, 8))).logits
    assert torch.isfinite(logits).all()
    res = run("inspect", out)
    assert res.exit_code == 0 and fmt in res.output


def test_quantize_with_a_format_per_layer(model_dir, tmp_path):
    out = tmp_path / "q"
    res = run("quantize", model_dir, "--out", out, "--format", "nvfp4", "--layer-format", "*self_attn*=fp8-dynamic",
              "--layer-format", "re:.*layers\\.1\\.mlp.*=fp8", "--samples", 4, "--seq-len", 32)
    assert res.exit_code == 0, res.output
    assert "fp8-dynamic (8) + nvfp4 (3) + fp8 (3): 14 layers quantized" in " ".join(res.output.split())
    formats = {n: m.format for n, m in quantkit.load(out).named_modules() if isinstance(m, quantkit.QuantLinear)}
    assert formats == {f"model.layers.{i}.{p}": "fp8-dynamic" if "attn" in p else "fp8" if i == 1 else "nvfp4"
                       for i in range(2) for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                   "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    res = run("inspect", out)
    assert res.exit_code == 0 and "fp8-dynamic + fp8 + nvfp4" in " ".join(res.output.split())


def test_quantize_with_automatic_mixed_precision(model_dir, tmp_path):
    from quantkit.calibrate.auto_formats import effective_bits

    out = tmp_path / "q"
    res = run("quantize", model_dir, "--out", out, "--format", "nvfp4-w4a16", "--effective-bits", 5.5,
              "--fallback", "fp8-dynamic", "--samples", 4, "--seq-len", 32)
    assert res.exit_code == 0, res.output
    model = quantkit.load(out)
    formats = {n: m.format for n, m in model.named_modules() if isinstance(m, quantkit.QuantLinear)}
    assert set(formats.values()) == {"nvfp4-w4a16", "fp8-dynamic"}
    fallback = {n: f for n, f in formats.items() if f == "fp8-dynamic"}
    assert effective_bits(tiny_llama(100, max_positions=128), "nvfp4-w4a16", fallback) <= 5.5
    assert f"{len(fallback)} layers in fp8-dynamic" in res.output


def test_quantize_with_an_fp8_kv_cache(model_dir, tmp_path):
    out = tmp_path / "q"
    res = run("quantize", model_dir, "--out", out, "--format", "fp8-dynamic", "--kv-cache", "fp8",
              "--samples", 4, "--seq-len", 32)
    assert res.exit_code == 0, res.output
    assert len(kv_scales(quantkit.load(out))) == 2  # both decoder layers
    res = run("inspect", out)
    assert res.exit_code == 0 and "kv_cache" in res.output and "fp8" in res.output


@pytest.mark.parametrize("args,message", [
    (["--format", "int3"], "unknown format 'int3'"),
    (["--format", "nvfp4[x]"], "unknown format 'nvfp4[x]'"),  # brackets as typed, not Rich markup
    (["--calib", "/nonexistent/calib.jsonl"], "does not exist"),
    (["--seq-len", "4096"], "exceeds the model's context length 128"),
    (["--export", "gguf"], "unknown export flavour 'gguf'"),
    (["--kv-cache", "int8"], "unknown KV-cache format 'int8'"),
    (["--options", '{"gptk": {"damp": 0.1}}'], "options for unknown algorithm 'gptk'"),
    (["--options", '{"autoround": {"iterations": 3}}'], "unknown autoround option(s) iterations; valid: iters, lr, target, batches_per_step"),
    (["--options", '{"awq": 20}'], "options for awq must map parameter names to values"),
    (["--options", "{grid: 20}"], "--options is not valid JSON"),
    (["--options", '{"gptq": {"block_size": 0}}', "--algo", "gptq"], "gptq option block_size must be an int >= 1, got 0"),
    (["--options", '{"smoothquant": {"alpha": -5}}', "--algo", "smoothquant"], "smoothquant option alpha must be a number in [0, 1], got -5"),
    (["--options", '{"awq": {"grid": 1}}'], "awq option grid must be an int >= 2, got 1"),
    (["--algo", "awq++mse"], "--algo 'awq++mse' has an empty name"),
    (["--ignore", "re:("], "ignore pattern 're:(' is not a valid regular expression"),
    (["--format", "mxfp4", "--export", "modelopt"], "ModelOpt has no mxfp4 format"),
    (["--layer-format", "*mlp*=mxfp4", "--export", "modelopt"], "ModelOpt has no mxfp4 format"),
    (["--layer-format", "*mlp*"], "layer format '*mlp*' is not PATTERN=FORMAT"),
    (["--layer-format", "*mlp*=int3"], "unknown format 'int3'"),
    (["--layer-format", "*gate_proj=fp8"], "engines run these as one GEMM or one MoE layer, so they must share a format"),
    (["--effective-bits", "5", "--layer-format", "*mlp*=fp8"], "--effective-bits chooses the layer formats itself"),
    (["--effective-bits", "5", "--fallback", "int3"], "unknown format 'int3'"),
    (["--effective-bits", "4", "--format", "nvfp4-w4a16"], "nvfp4-w4a16 alone takes 4.51 bits per weight, more than effective_bits=4.0"),
    (["--ignore", "*"], "no layer was quantized: all 15 Linear layers were skipped (ignored by pattern)"),
    (["--samples", "0"], "Invalid value for '--samples'"),
    (["--batch-size", "0"], "Invalid value for '--batch-size'"),
])
def test_bad_input_is_one_clear_error_and_writes_nothing(model_dir, tmp_path, args, message):
    out = tmp_path / "q"
    res = run("quantize", model_dir, "--out", out, "--samples", 2, "--seq-len", 16, *args)
    assert res.exit_code == 2
    assert message in " ".join(res.output.split()) and res.output.count("error:") <= 1
    assert not out.exists()


@pytest.mark.parametrize("args,message", [
    (["eval", "demo", "--tasks", "wikitext2_ppl", "--limit", "abc"], "Invalid value for --limit: expected N or TASK=N,..., got 'abc'"),
    (["eval", "demo", "--limit", "lambada_openai=0"], "Invalid value for --limit: expected N or TASK=N,..., got '0'"),
    (["bench", "nvfp4", "--random-init", "tiny-llama", "--prefill", "1x"], "Invalid value for --prefill: expected BATCHxSEQ, got ''"),
    (["bench", "nvfp4", "--random-init", "tiny-llama", "--gemm-m", "16,x"], "Invalid value for --gemm-m: expected a positive integer, got 'x'"),
    (["bench", "nvfp4", "--random-init", "tiny-llama", "--iters", "0"], "Invalid value for '--iters'"),
    (["bench", "nvfp4", "--random-init", "tiny-llama", "--flex-attention"],
     "Invalid value for --flex-attention: FlexAttention runs only compiled: add --compile"),
    (["bench", "nvfp4", "--random-init", "tiny-llama", "--compile", "--flex-attention"],
     "Invalid value for --flex-attention: needs a CUDA device"),
])
def test_eval_and_bench_reject_malformed_numbers_before_any_work(tmp_path, args, message):
    res = run(*args, "--device", "cpu", "--out", tmp_path / "out")
    assert res.exit_code == 2 and message in " ".join(res.output.replace("│", " ").split())
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["quantize", "tiny"], ["eval", "tiny", "--tasks", "wikitext2_ppl"],
                                     ["bench", "nvfp4", "--random-init", "tiny-llama"]])
def test_device_cuda_without_a_gpu_is_a_clear_error(tmp_path, monkeypatch, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = run(*command, "--device", "cuda", "--out", tmp_path / "out")
    assert res.exit_code == 2 and "--device cuda: torch" in res.output and "sees no CUDA GPU" in res.output
    assert not (tmp_path / "out").exists()
    res = run(*command, "--device", "tpu", "--out", tmp_path / "out")
    assert res.exit_code == 2 and "--device tpu: Expected one of cpu, cuda" in " ".join(res.output.split())
    res = run(*command, "--device", "meta", "--out", tmp_path / "out")
    assert res.exit_code == 2 and "--device meta: quantkit runs on cpu or cuda" in " ".join(res.output.split())


def test_options_reach_the_algorithms(model_dir, tmp_path):
    # AutoRound with no steps keeps the MSE stage's round to nearest; its default 50 steps would not
    qweights = {}
    for name, args in (("mse", ["--algo", "mse"]),
                       ("autoround0", ["--algo", "mse+autoround", "--options", '{"autoround": {"iters": 0}}']),
                       ("autoround", ["--algo", "mse+autoround"])):
        res = run("quantize", model_dir, "--out", tmp_path / name, "--format", "nvfp4-w4a16", "--samples", 4, "--seq-len", 32, *args)
        assert res.exit_code == 0, res.output
        qweights[name] = [m.qweight.data for m in quantkit.load(tmp_path / name).modules() if isinstance(m, quantkit.QuantLinear)]
    assert all(torch.equal(a, b) for a, b in zip(qweights["mse"], qweights["autoround0"]))
    assert not all(torch.equal(a, b) for a, b in zip(qweights["mse"], qweights["autoround"]))


def test_unknown_model_offline_is_a_clear_error(tmp_path):
    res = run("quantize", "no-such-org/no-such-model", "--out", tmp_path / "q")
    assert res.exit_code == 2 and "cannot load model 'no-such-org/no-such-model'" in " ".join(res.output.split())
    assert not (tmp_path / "q").exists()


def test_interrupted_run_leaves_no_output(model_dir, tmp_path, monkeypatch):
    import quantkit.calibrate.pipeline as pipeline

    def boom(*a, **k):
        raise RuntimeError("interrupted during calibration")

    monkeypatch.setattr(pipeline, "quantize_model", boom)
    out = tmp_path / "q"
    res = run("quantize", model_dir, "--out", out, "--samples", 2, "--seq-len", 16)
    assert res.exit_code == 2 and "interrupted during calibration" in res.output
    assert not out.exists() and not any(tmp_path.iterdir())


def test_torchrun_data_parallel_writes_the_same_checkpoint(model_dir, tmp_path):
    import filecmp
    import subprocess
    import sys

    args = ["quantize", str(model_dir), "--format", "nvfp4", "--samples", "4", "--seq-len", "32", "--batch-size", "2"]
    assert run(*args, "--out", tmp_path / "one").exit_code == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533",
           "-m", "quantkit.cli", *args, "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    one, two = sorted(p.name for p in (tmp_path / "one").iterdir()), sorted(p.name for p in (tmp_path / "two").iterdir())
    assert one == two
    weights = [f for f in one if f.endswith((".safetensors", ".json")) and not f.startswith("tokenizer")]
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "one", tmp_path / "two", weights, shallow=False)
    assert "model.safetensors" in match and not mismatch and not errors  # tokenizer metadata may differ


def _copy_model(model_dir, tmp_path, edit=None):
    """A copy of the tiny bf16 model whose weights ``edit(tensors)`` changes (or whose file it breaks)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "src"
    shutil.copytree(model_dir, path)
    if edit is not None:
        tensors = load_file(path / "model.safetensors")
        edit(tensors)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture()
def no_model_load(monkeypatch):
    """Fail the test if the command loads a model (it should have stopped before)."""
    import quantkit.models

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(quantkit.models, "load_model", no_load)


def test_an_output_save_would_refuse_fails_before_the_model_loads(model_dir, tmp_path, no_model_load):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    (tmp_path / "afile").write_text("x")
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text('{"quantization_config": {}}')
    (ck / "README.md").write_text("mine")
    for out, message in ((tmp_path / "notes", "is not a quantized checkpoint directory"),
                         (model_dir, "is not a quantized checkpoint directory"),
                         (tmp_path / "afile", "is a file, not a checkpoint directory"),
                         (tmp_path / "afile" / "q", "afile is a file, not a directory"),
                         (ck, "holds files besides a checkpoint (README.md)")):
        res = run("quantize", model_dir, "--out", out)
        assert res.exit_code == 2 and message in " ".join(res.output.split()), (out, res.output)
    assert (tmp_path / "notes" / "a.txt").read_text() == "mine" and (ck / "README.md").read_text() == "mine"


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("model.layers.1.mlp.down_proj.weight"),
     "its checkpoint lacks 1 weight(s) (model.layers.1.mlp.down_proj.weight), which would be random"),
    (lambda t: t["model.layers.0.input_layernorm.weight"].__setitem__(3, float("nan")),
     "the model's weights contain NaN or Inf: model.layers.0.input_layernorm.weight (1 values)"),
    (lambda t: t["model.embed_tokens.weight"].__setitem__((5, 2), float("inf")),
     "the model's weights contain NaN or Inf: model.embed_tokens.weight (1 values)"),
    ("truncate", "a weight file is not valid safetensors"),
])
def test_a_broken_source_model_is_refused(model_dir, tmp_path, edit, message):
    src = _copy_model(model_dir, tmp_path, None if edit == "truncate" else edit)
    if edit == "truncate":
        data = (src / "model.safetensors").read_bytes()
        (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    out = tmp_path / "q"
    for fmt in ("fp8-dynamic", "nvfp4"):  # round to nearest, and calibrated
        res = run("quantize", src, "--out", out, "--format", fmt, "--samples", 2, "--seq-len", 16)
        assert res.exit_code == 2 and message in " ".join(res.output.split()), res.output
        assert not out.exists()


def test_eval_and_bench_of_a_corrupt_checkpoint_are_clear_errors(model_dir, tmp_path):
    ck = tmp_path / "ck"
    assert run("quantize", model_dir, "--out", ck, "--format", "fp8-dynamic").exit_code == 0
    res = run("quantize", ck, "--out", tmp_path / "again", "--format", "fp8-dynamic")
    assert res.exit_code == 2 and "is already a quantized checkpoint" in " ".join(res.output.split())
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[:-100])
    for args in (["eval", ck, "--tasks", "wikitext2_ppl"],
                 ["bench", ck, "--prefill", "1x8", "--decode-batches", "1", "--gemm-m", "1"]):
        res = run(*args, "--device", "cpu", "--out", tmp_path / "out")
        assert res.exit_code == 2 and "model.safetensors: not a valid safetensors file" in " ".join(res.output.split())


def test_eval_names_an_unknown_task_before_loading_anything(model_dir, tmp_path, no_model_load):
    pytest.importorskip("lm_eval")
    res = run("eval", model_dir, "--tasks", "lambada_openai,nosuchtask", "--device", "cpu", "--out", tmp_path / "out")
    assert res.exit_code == 2 and "unknown task(s) nosuchtask" in " ".join(res.output.split())


def test_interrupt_or_sigterm_removes_the_partial_checkpoint(model_dir, tmp_path, monkeypatch):
    import os
    import signal

    import quantkit.calibrate.pipeline as pipeline
    from quantkit import cli

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "quantize_model", interrupted)
    out = tmp_path / "q"
    res = run("quantize", model_dir, "--out", out, "--samples", 2, "--seq-len", 16)
    assert res.exit_code == 130 and f"interrupted: {out} was not written" in " ".join(res.output.split())
    assert not out.exists() and not any(tmp_path.iterdir())
    previous = signal.signal(signal.SIGTERM, cli._terminated)  # what main() installs: SIGTERM unwinds as Ctrl-C
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_inspect_check_loads_every_tensor(model_dir, tmp_path):
    """``inspect`` reads the config and headers only; ``--check`` loads the checkpoint, so a tensor
    missing from it is an error there."""
    from safetensors.torch import load_file, save_file

    ck = tmp_path / "ck"
    assert run("quantize", model_dir, "--out", ck, "--format", "fp8-dynamic").exit_code == 0
    res = run("inspect", ck, "--check")
    assert res.exit_code == 0 and "loads: 14 QuantLinear layers" in res.output
    tensors = load_file(ck / "model.safetensors")
    tensors.pop("model.layers.0.self_attn.q_proj.weight_scale")
    save_file(tensors, ck / "model.safetensors", metadata={"format": "pt"})
    assert run("inspect", ck).exit_code == 0
    res = run("inspect", ck, "--check")
    assert res.exit_code == 2 and "'model.layers.0.self_attn.q_proj.weight_scale' is missing" in " ".join(res.output.split())
