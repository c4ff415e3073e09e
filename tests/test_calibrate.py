"""Sequential calibration pipeline and calibration data."""
import copy
import json
import re

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from quantkit.calibrate import CalibrationError, Recipe, quantize
from quantkit.calibrate.data import CalibrationDataError, load_texts, token_samples
from quantkit.formats import get_format
from quantkit.nn import QuantLinear, quantize_model


def tiny_llama(seed=0, layers=3):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def whole_model_input_amax(model, ids, batch_size):
    """Independent reference: hooks on every Linear of the float model, one full forward per batch."""
    amax = {}

    def hook(name):
        def f(_, args):
            a = args[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax.get(name, a), a)
        return f

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        for batch in ids.split(batch_size):
            model(input_ids=batch, use_cache=False)
    for h in handles:
        h.remove()
    return amax


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_sequential_scales_equal_whole_model_calibration(fmt):
    model = tiny_llama()
    ids = torch.randint(0, 128, (6, 24))
    ref = whole_model_input_amax(model, ids, 4)
    report = quantize(model, Recipe(fmt, ("rtn",), propagate="float"), ids, batch_size=4)
    act = get_format(fmt).activation
    for r in report.quantized:
        q = model.get_submodule(r.name)
        assert isinstance(q, QuantLinear)
        assert torch.equal(q.input_scale, act.input_scale_from_amax(ref[r.name])), r.name


def test_fused_projections_share_scales_and_every_linear_is_reported():
    model = tiny_llama()
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    report = quantize(model, "nvfp4", torch.randint(0, 128, (4, 16)))
    assert {r.name for r in report.layers} == names
    assert {r.name: r.reason for r in report.skipped} == {"lm_head": "ignored by pattern"}
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        assert a.q_proj.weight_tensor_scale == a.k_proj.weight_tensor_scale == a.v_proj.weight_tensor_scale
        assert a.q_proj.input_scale == a.k_proj.input_scale == a.v_proj.input_scale
        assert m.gate_proj.weight_tensor_scale == m.up_proj.weight_tensor_scale
        assert m.gate_proj.input_scale == m.up_proj.input_scale


def test_small_device_budget_offloads_hidden_states_with_same_result():
    ids = torch.randint(0, 128, (8, 32))
    free, tight = tiny_llama(), tiny_llama()
    ref = quantize(free, "nvfp4", ids, batch_size=2)
    model_bytes = sum(p.numel() * p.element_size() for p in tight.parameters())
    budget = ref.calibration.block_bytes + ref.calibration.state_bytes // 2
    assert budget < model_bytes
    report = quantize(tight, "nvfp4", ids, batch_size=2, max_device_bytes=budget)
    assert report.calibration.offloaded and not ref.calibration.offloaded
    for r in report.quantized:
        assert torch.equal(tight.get_submodule(r.name).input_scale, free.get_submodule(r.name).input_scale)
    with pytest.raises(CalibrationError, match="do not fit max_device_bytes"):
        quantize(tiny_llama(), "nvfp4", ids, batch_size=2, max_device_bytes=ref.calibration.block_bytes)


def test_quantized_propagation_feeds_quantized_outputs_forward():
    ids = torch.randint(0, 128, (4, 16))
    a, b = tiny_llama(), tiny_llama()
    quantize(a, Recipe("nvfp4", propagate="float"), ids)
    quantize(b, Recipe("nvfp4", propagate="quantized"), ids)
    first = "model.layers.0.self_attn.q_proj"
    last = "model.layers.2.mlp.down_proj"
    assert torch.equal(a.get_submodule(first).input_scale, b.get_submodule(first).input_scale)
    assert not torch.equal(a.get_submodule(last).input_scale, b.get_submodule(last).input_scale)


def test_calibration_keeps_no_autograd_graph():
    """Layer outputs carried to the next layer must not hold an autograd graph: with one, every
    earlier layer's activations stay alive and memory grows with depth (Gemma-3-270M: 19 GiB)."""
    model = tiny_llama(layers=4)
    seen = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, args, out: seen.append((args[0].requires_grad, out[0].requires_grad)))
    quantize(model, Recipe("nvfp4", ("awq", "mse")), torch.randint(0, 128, (4, 16)), batch_size=2)
    assert len(seen) >= 4 * 2 and not any(a or b for a, b in seen)


def test_dynamic_formats_need_no_data():
    model = tiny_llama()
    report = quantize(model, Recipe("mxfp8", ("rtn",)), None)
    assert len(report.quantized) == 21 and report.calibration is None
    with pytest.raises(CalibrationError, match="needs calibration data"):
        quantize(tiny_llama(), "nvfp4", None)


@pytest.mark.parametrize("ids,message", [
    (torch.rand(2, 16), "must be token ids, an int64 [num_samples, seq_len] tensor"),
    (torch.randint(0, 128, (16,)), "must be token ids, an int64 [num_samples, seq_len] tensor"),
    (torch.randint(0, 128, (0, 16)), "must be token ids"),
    (torch.randint(300, 400, (2, 16)), "outside the model's vocabulary [0, 128): tokenized with another model's tokenizer?"),
])
def test_malformed_calibration_ids_are_a_clear_error(ids, message):
    model = tiny_llama()
    with pytest.raises(CalibrationError, match=re.escape(message)):
        quantize(model, Recipe("nvfp4", ("mse",)), ids)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())  # nothing swapped


def test_recipe_rejects_unknown_algorithms_when_built():
    with pytest.raises(ValueError, match="unknown algorithm 'nosuch'; valid: autoround, awq, gptq, mse, rtn, smoothquant"):
        Recipe("nvfp4", ("awq", "nosuch"))
    with pytest.raises(ValueError, match="both choose the"):
        Recipe("nvfp4", ("gptq", "autoround"))
    with pytest.raises(TypeError, match=r"not the string 'gptq\+mse': write \('gptq', 'mse'\)"):
        Recipe("nvfp4", "gptq+mse")
    with pytest.raises(TypeError, match=r"ignore takes a list of patterns, not the string 'lm_head'"):
        Recipe("nvfp4", ignore="lm_head")


def test_linears_outside_the_decoder_layers_need_a_calibrated_scale_for_static_formats(tmp_path):
    """The layers the decoder blocks do not hold (here lm_head, not ignored) get no activation
    statistics: a static-activation format skips them (else the checkpoint could not be saved),
    a dynamic one quantizes them round to nearest."""
    import quantkit

    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    for fmt, quantized in (("nvfp4", False), ("fp8-dynamic", True)):
        model = tiny_llama()
        report = quantize(model, Recipe(fmt, ("rtn",), ignore=()), ids)
        assert isinstance(model.lm_head, QuantLinear) == quantized
        if not quantized:
            assert [(r.name, r.reason) for r in report.skipped] == [
                ("lm_head", "outside the decoder layers: no calibrated activation scale, which nvfp4 needs")]
        quantkit.save(model, tmp_path / fmt)


# ------------------------------------------------------------------ data
class CharTokenizer:
    eos_token_id, bos_token_id = 1, None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + (ord(c) % 100) for c in text]}


def test_embedded_corpus_and_local_files(tmp_path):
    embedded = load_texts(None)  # tiny shakespeare, xz-compressed in the package
    assert sum(len(t) for t in embedded) > 200_000 and embedded[0].startswith("First Citizen:\nBefore we proceed")
    (tmp_path / "a.txt").write_text("first passage\n\nsecond passage\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "json text"}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert load_texts(tmp_path / "a.txt") == ["first passage", "second passage"]
    assert load_texts(tmp_path / "b.jsonl") == ["json text", "hi"]
    assert len(load_texts(tmp_path)) == 4
    ids = token_samples(load_texts(tmp_path), CharTokenizer(), num_samples=3, seq_len=10, seed=1)
    assert ids.shape == (3, 10) and ids.dtype == torch.long
    stream = token_samples(load_texts(tmp_path), CharTokenizer(), num_samples=1, seq_len=1000, seed=1)[0].tolist()
    assert CharTokenizer.eos_token_id in stream  # passages are joined with EOS
    (tmp_path / "c.JSONL").write_bytes(b"\xef\xbb\xbf" + (json.dumps("a plain string") + "\n").encode())  # BOM, upper case
    assert load_texts(tmp_path / "c.JSONL") == ["a plain string"]
    (tmp_path / "sub.json").mkdir()  # a directory named like a file is not read
    assert len(load_texts(tmp_path)) == 5


def test_bad_calibration_data_errors(tmp_path):
    with pytest.raises(CalibrationDataError, match="does not exist"):
        load_texts(tmp_path / "missing.jsonl")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(CalibrationDataError, match="is empty"):
        load_texts(tmp_path / "empty.txt")
    with pytest.raises(CalibrationDataError, match="exceeds the model's context length 128"):
        token_samples(["abc"], CharTokenizer(), num_samples=1, seq_len=512, max_length=128)
    (tmp_path / "ids.jsonl").write_text(json.dumps({"id": "doc-1", "body": "text"}) + "\n")  # no text field: not the id
    with pytest.raises(CalibrationDataError, match=r"ids.jsonl: no record has a text \(keys: body, id\)"):
        load_texts(tmp_path / "ids.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "ok"}) + "\n{broken\n")
    with pytest.raises(CalibrationDataError, match="bad.jsonl: line 2 is not JSON"):
        load_texts(tmp_path / "bad.jsonl")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(CalibrationDataError, match="latin1.txt: not UTF-8 text"):
        load_texts(tmp_path / "latin1.txt")


def test_unknown_hub_dataset_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(CalibrationDataError, match="cannot load dataset 'no-such-org/no-such-set'"):
        load_texts("no-such-org/no-such-set")


def test_decoder_layers_called_with_positional_inputs_calibrate():
    """Gemma 3n passes its rotary embeddings and per-layer inputs to each decoder layer
    positionally: the pipeline records and replays them (it once kept keyword arguments only), and
    the calibrated model's logits stay close to the float model's."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma3nTextConfig(
        vocab_size=128, vocab_size_per_layer_input=128, hidden_size=64, hidden_size_per_layer_input=16,
        intermediate_size=[128, 128], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0, laurel_rank=8,
        activation_sparsity_pattern=[0.0, 0.0], altup_num_inputs=2)
    model = transformers.Gemma3nForCausalLM(cfg).float().eval()
    rtn = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    quantize_model(rtn, "fp8-dynamic")
    report = quantize(model, Recipe("fp8-dynamic", ("mse",)), ids)
    projections = {f"model.layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
        "mlp.down_proj")}
    assert projections <= {r.name for r in report.quantized}
    with torch.no_grad():
        out, out_rtn = model(ids).logits, rtn(ids).logits
    assert (out - ref).norm() < 1.2 * (out_rtn - ref).norm()  # the MSE scales: no worse than round to nearest
