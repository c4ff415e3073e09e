"""Packed grouped-query decode attention (``quantkit.nn.attention``): the function against float64
math written out here, and whole models against transformers' eager attention (``repeat_kv``,
matmul, softmax) in float64, through a static KV cache as ``quantkit bench`` decodes."""
import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    StaticCache,
)

from quantkit.eval import bench
from quantkit.nn.attention import (
    PACKED_GQA_FLEX,
    PACKED_GQA_SDPA,
    packed_gqa_sdpa,
    use_packed_gqa_attention,
)
from quantkit.nn.kv_cache import FP8_KV_PREFIX, enable_kv_cache


def tiny(arch: str) -> torch.nn.Module:
    """A float64 grouped-query decoder: the shipped tiny-llama (2 query heads per key/value head) or
    a Gemma-3 with 4 query heads on one key/value head and sliding-window layers."""
    if arch == "llama":
        return bench.random_init_model(bench.load_config("tiny-llama"), device="cpu", dtype=torch.float64)
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=4,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           max_position_embeddings=64)
    return Gemma3ForCausalLM(cfg).double().eval()


@torch.no_grad()
def decode_logits(model, steps: int = 4, compile_backend: str | None = None) -> torch.Tensor:
    """``[steps + 1, 3, vocab]``: last-position logits of a 7-token prefill of 3 sequences into a
    static cache, then of ``steps`` greedy single-token steps (through ``torch.compile`` with
    ``compile_backend``; the prefill stays eager)."""
    step = model
    if compile_backend is not None:
        torch._dynamo.reset()
        step = torch.compile(model, backend=compile_backend)
    prompt = torch.randint(0, 128, (3, 7), generator=torch.Generator().manual_seed(1))
    cache = {bench._cache_kwarg(model): StaticCache(config=model.config, max_cache_len=16)}
    out = [model(input_ids=prompt, use_cache=True, **cache).logits[:, -1]]
    for _ in range(steps):
        out.append(step(input_ids=out[-1].argmax(-1, keepdim=True), use_cache=True, **cache).logits[:, -1])
    return torch.stack(out)


def attention_f64(q, k, v, mask, scale):
    """softmax(q·kᵀ·scale + mask)·v with each key/value head repeated for its query heads, written
    out in float64: ``q [B, H, T, D]``, ``k``/``v`` ``[B, H_kv, S, D]``; returns ``[B, T, H, D]``."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("mask", ["none", "shared-bool", "shared-additive", "per-head-bool"])
def test_packed_attention_function_equals_float64_math(mask):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 1, 16, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(3, 2, 11, 16, dtype=torch.float64, generator=gen) for _ in range(2))
    allowed = torch.rand(3, 8 if mask == "per-head-bool" else 1, 1, 11, generator=gen) > 0.3
    allowed[..., 0] = True
    m = {"none": None, "shared-bool": allowed, "per-head-bool": allowed,
         "shared-additive": torch.where(allowed, 0.0, -1e4).double()}[mask]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    out, _ = packed_gqa_sdpa(module, q, k, v, m, scaling=0.3)
    torch.testing.assert_close(out, attention_f64(q, k, v, m, 0.3), rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_packed_decode_equals_eager_attention_and_reads_unrepeated_keys(arch, monkeypatch):
    model = tiny(arch)
    model.set_attn_implementation("eager")
    reference = decode_logits(model)
    model.set_attn_implementation("sdpa")
    assert use_packed_gqa_attention(model) and model.config._attn_implementation == PACKED_GQA_SDPA
    shapes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        shapes.append((q.shape, k.shape))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    got = decode_logits(model)
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-6)  # eager: softmax in FP32
    cfg = model.config
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    decode = shapes[cfg.num_hidden_layers:]  # after the prefill's calls
    assert len(decode) == 4 * cfg.num_hidden_layers
    assert all(q[1:3] == (cfg.num_key_value_heads, groups) and k[1] == cfg.num_key_value_heads for q, k in decode)


@pytest.mark.parametrize("flex", [False, True])
@torch.inference_mode()
def test_compiled_packed_decode_graphs_give_the_eager_tokens(flex):
    """``bench --compile`` decodes through the packed attention in one dynamo graph; with ``flex``
    the graph breaks only where the ``BlockMask`` is built (eagerly, ``_block_mask``). Either way
    the greedy tokens equal eager SDPA's, and steps after the first compile nothing new."""
    from torch._dynamo.utils import counters

    model = bench.random_init_model(bench.load_config("tiny-llama"), device="cpu", dtype=torch.float32)
    prompt = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(0))
    graphs = []

    def tokens(compile_backend=None):
        step, out = bench.greedy_decoder(model, prompt, 20, compile_backend=compile_backend)
        steps = [out.clone()]
        for _ in range(6):
            step()
            steps.append(out.clone())
            graphs.append(counters["stats"]["unique_graphs"])
        return torch.cat(steps, 1)

    stock = tokens()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert use_packed_gqa_attention(model, flex=flex)
    torch._dynamo.reset()
    counters.clear()
    graphs.clear()
    assert torch.equal(tokens("aot_eager"), stock)
    assert len(set(graphs[1:])) == 1
    if flex:
        assert counters["graph_break"] and all("_block_mask" in reason for reason in counters["graph_break"])
    else:
        assert not counters["graph_break"] and graphs[-1] == 1


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_compiled_flex_decode_equals_eager_attention_through_block_masks(arch, backend, monkeypatch):
    """``flex=True``: compiled single-token steps attend through FlexAttention over a ``BlockMask`` of
    the model's own mask (Gemma-3: sliding-window layers too), eager prefill through SDPA; logits
    of the prefill and 4 steps against transformers' eager attention: within 1e-6 in float64
    (``aot_eager``), and through Inductor's own (CPU) FlexAttention lowering within 1e-4 in float32
    (it takes no float64)."""
    from torch.nn.attention import flex_attention as torch_flex

    model = tiny(arch) if backend == "aot_eager" else tiny(arch).float()
    model.set_attn_implementation("eager")
    reference = decode_logits(model)
    model.set_attn_implementation("sdpa")
    assert use_packed_gqa_attention(model, flex=True) and model.config._attn_implementation == PACKED_GQA_FLEX
    masks = []
    flex = torch_flex.flex_attention

    def spy(query, key, value, block_mask, **kwargs):
        masks.append(type(block_mask).__name__)
        return flex(query, key, value, block_mask=block_mask, **kwargs)

    monkeypatch.setattr(torch_flex, "flex_attention", spy)
    got = decode_logits(model, compile_backend=backend)
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-6 if backend == "aot_eager" else 1e-4)
    assert masks and set(masks) == {"BlockMask"} and len(masks) % model.config.num_hidden_layers == 0


@pytest.mark.parametrize("flex", [False, True])
def test_fp8_kv_cache_models_keep_their_cache_quantization(flex):
    model = tiny("llama")
    model.set_attn_implementation("sdpa")
    layers = {f"model.layers.{i}.self_attn": (torch.tensor(0.004), torch.tensor(0.003)) for i in range(2)}
    enable_kv_cache(model, layers)
    reference = decode_logits(model)
    assert use_packed_gqa_attention(model, flex=flex)
    assert model.config._attn_implementation == FP8_KV_PREFIX + (PACKED_GQA_FLEX if flex else PACKED_GQA_SDPA)
    torch.testing.assert_close(decode_logits(model), reference, rtol=0, atol=1e-10)
    if flex:  # compiled steps: the BlockMask path, on the FP8-rounded cache
        torch.testing.assert_close(decode_logits(model, compile_backend="aot_eager"), reference, rtol=0, atol=1e-6)


def test_other_attention_implementations_are_left_alone():
    model = tiny("llama")
    model.set_attn_implementation("eager")
    assert not use_packed_gqa_attention(model) and model.config._attn_implementation == "eager"


@pytest.mark.gpu
@torch.inference_mode()
def test_gpu_packed_decode_matches_eager_attention_in_bf16():
    """The CUDA SDPA kernels on the packed queries (``[B, H_kv, G, D]`` with a static-cache mask),
    as ``quantkit bench`` runs them: bf16 logits of 6 single-token steps at batch 8 (the same given
    tokens) within 2 % (norm) of transformers' eager attention in the same model."""
    model = bench.random_init_model(bench.load_config("tiny-llama"), device="cuda")
    ids = torch.randint(0, 1024, (8, 46), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def logits():
        cache = {bench._cache_kwarg(model): StaticCache(config=model.config, max_cache_len=64)}
        out = [model(input_ids=ids[:, :40], use_cache=True, **cache).logits[:, -1]]
        out += [model(input_ids=ids[:, t:t + 1], use_cache=True, **cache).logits[:, -1] for t in range(40, 46)]
        return torch.stack(out).float()

    model.set_attn_implementation("eager")
    reference = logits()
    model.set_attn_implementation("sdpa")
    assert use_packed_gqa_attention(model)
    got = logits()
    assert (got - reference).norm() <= 0.02 * reference.norm()


@pytest.mark.gpu
@torch.inference_mode()
def test_gpu_compiled_flex_decode_matches_eager_attention_in_bf16():
    """FlexAttention's CUDA decoding kernel (Inductor, split-KV, GQA packed) over the BlockMask of a
    static cache of 200 positions (two 128-position blocks; steps at positions 124-135 cross into the
    second), as ``quantkit bench --compile --flex-attention`` runs it: bf16 logits of the prefill and
    12 compiled single-token steps at batch 8 within 2 % (norm) of transformers' eager attention;
    the same when the steps from position 126 on replay one CUDA graph (the eager ``BlockMask``
    construction captured with them)."""
    model = bench.random_init_model(bench.load_config("tiny-llama"), device="cuda")
    ids = torch.randint(0, 1024, (8, 136), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def logits(forward, graph=False):
        cache = {bench._cache_kwarg(model): StaticCache(config=model.config, max_cache_len=200)}
        out = [model(input_ids=ids[:, :124], use_cache=True, **cache).logits[:, -1]]
        token, result = ids[:, 124:125].clone(), {}

        def step():
            result["logits"] = forward(input_ids=token, use_cache=True, **cache).logits[:, -1]

        run = step
        for t in range(124, 136):
            token.copy_(ids[:, t:t + 1])
            if graph and t == 126:  # captured, not run: each replay is one step
                run = bench.capture_graph(step, 0).replay
            run()
            out.append(result["logits"].clone())
        return torch.stack(out).float()

    model.set_attn_implementation("eager")
    reference = logits(model)
    model.set_attn_implementation("sdpa")
    assert use_packed_gqa_attention(model, flex=True)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    for graph in (False, True):
        got = logits(compiled, graph)
        assert (got - reference).norm() <= 0.02 * reference.norm(), graph
