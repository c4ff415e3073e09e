"""Data-parallel calibration: 2 gloo ranks (started like ``torchrun``) on halves of the calibration
batches quantize exactly as one process on all of them."""
import hashlib
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from quantkit.calibrate import CalibrationError, Recipe, quantize
from quantkit.calibrate.distributed import all_reduce_, all_reduce_sum, init_from_env, is_main, shard, world
from quantkit.calibrate.observers import InputObserver
from quantkit.export import save
from quantkit.nn import calibrate_kv_cache, quantize_model
from quantkit.nn.kv_cache import KVCacheScales

WORLD = 2
BATCH = 2
# (format, algorithms, options, KV cache): static activation scales (max over ranks), Hessians
# (GPTQ, MSE weighted by the Hessian diagonal), mean |x| and the summed output error (AWQ), FP8
# KV-cache scales (max over ranks).
CASES = {
    "nvfp4-rtn": ("nvfp4", ("rtn",), {}, None),
    "fp8-rtn": ("fp8", ("rtn",), {}, None),
    "nvfp4-gptq-mse": ("nvfp4", ("gptq", "mse"), {"mse": {"weighted": True}}, None),
    "nvfp4-awq": ("nvfp4", ("awq",), {}, None),
    "fp8-dynamic-kv": ("fp8-dynamic", ("rtn",), {}, "fp8"),
}


def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def calib_ids():
    """8 token sequences → 4 batches of 2 (2 per rank)."""
    return torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))


def digest(model) -> str:
    """SHA-256 over the bytes of every state-dict tensor, in order."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def calibrate_cases(out: Path) -> None:
    """Quantize a fresh tiny Llama per case; the main rank saves each checkpoint under ``out/case``;
    every rank writes its model digest and this rank's token count to ``out/case.rank{r}``."""
    rank, _ = world()
    for case, (fmt, algos, options, kv_cache) in CASES.items():
        model = tiny_llama()
        report = quantize(model, Recipe(fmt, algos, options=options, kv_cache=kv_cache), calib_ids(), batch_size=BATCH,
                          device="cpu")
        (out / f"{case}.rank{rank}").write_text(f"{digest(model)} {report.calibration.state_bytes}")
        if is_main():
            save(model.to(torch.bfloat16), out / case)


def kv_cache_scales(ids: torch.Tensor) -> tuple[list[float], int]:
    """The k and v scales, layer by layer, that :func:`calibrate_kv_cache` gives a W4A16 tiny Llama
    on ``ids``, and the number of sequences this process ran through the model."""
    model = tiny_llama()
    quantize_model(model, "nvfp4-w4a16")
    sequences = []
    model.model.register_forward_pre_hook(lambda _, args, kwargs: sequences.append(len(kwargs["input_ids"])),
                                          with_kwargs=True)
    calibrate_kv_cache(model, ids, batch_size=BATCH)
    scales = [t.item() for m in model.modules() if isinstance(m, KVCacheScales) for t in (m.k_scale, m.v_scale)]
    return scales, sum(sequences)


def check_reduced_stats(rank: int) -> None:
    """Each rank observes its own number of tokens; the reduced statistics are those of all of
    them (float64 reference)."""
    g = torch.Generator().manual_seed(2)
    parts = [torch.randn(3 + 4 * r, 8, generator=g) * (1 + r) for r in range(WORLD)]
    linear = torch.nn.Linear(8, 4)
    observer = InputObserver(linear, hessian=True)
    linear(parts[rank])
    stats = observer.finish()
    x = torch.cat(parts).double()
    assert stats.tokens == x.shape[0]
    assert torch.equal(stats.channel_amax, x.abs().amax(0).float()) and stats.amax == x.abs().max().float()
    torch.testing.assert_close(stats.channel_mean_abs.double(), x.abs().mean(0), rtol=1e-7, atol=0)
    torch.testing.assert_close(stats.hessian.double(), x.T @ x / x.shape[0], rtol=1e-7, atol=1e-7)


def worker(rank: int, port: int, out: Path) -> None:
    """One ``torchrun``-style rank: environment variables, then :func:`init_from_env`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    assert init_from_env() and world() == (rank, WORLD) and dist.get_backend() == "gloo"
    try:
        assert shard(list(range(5))) == list(range(5))[rank::WORLD]
        maxed = all_reduce_(torch.tensor([float(rank), -float(rank)]), "max")
        assert maxed.tolist() == [WORLD - 1.0, 0.0] and all_reduce_sum(rank + 0.5) == sum(r + 0.5 for r in range(WORLD))
        check_reduced_stats(rank)
        calibrate_cases(out)
        scales, sequences = kv_cache_scales(calib_ids())
        (out / f"kv.rank{rank}").write_text(" ".join([str(sequences), *map(float.hex, scales)]))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Checkpoints and digests of the 2-rank run and of one process on all the data."""
    parallel, single = tmp_path_factory.mktemp("parallel"), tmp_path_factory.mktemp("single")
    mp.spawn(worker, args=(free_port(), parallel), nprocs=WORLD, join=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: same GEMM reduction order
    try:
        calibrate_cases(single)
    finally:
        torch.set_num_threads(threads)
    return parallel, single


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_write_the_checkpoint_of_one_process(runs, case):
    parallel, single = runs
    ranks = [(parallel / f"{case}.rank{r}").read_text().split() for r in range(WORLD)]
    (one, one_bytes), = [(single / f"{case}.rank0").read_text().split()]
    assert ranks[0][0] == ranks[1][0] == one  # every rank holds the single-process model, bit for bit
    assert int(ranks[0][1]) * WORLD == int(ranks[1][1]) * WORLD == int(one_bytes)  # each rank saw half the batches
    assert files(parallel / case) == files(single / case)


def test_two_ranks_add_the_kv_cache_scales_of_one_process(runs):
    parallel, _ = runs
    one, sequences = kv_cache_scales(calib_ids())
    ranks = [(parallel / f"kv.rank{r}").read_text().split() for r in range(WORLD)]
    assert [int(r[0]) * WORLD for r in ranks] == [sequences] * WORLD  # each rank ran half the batches
    assert len(one) == 4 and [[float.fromhex(v) for v in r[1:]] for r in ranks] == [one] * WORLD
    shards = [kv_cache_scales(torch.cat(calib_ids().split(BATCH)[r::WORLD]))[0] for r in range(WORLD)]
    assert shards[0] != shards[1] and one == [max(s) for s in zip(*shards)]  # each rank's shard alone gives others


def test_one_shard_alone_gives_other_scales():
    """The reduction matters: the rank-0 shard without it calibrates different input scales."""
    ids = calib_ids()
    full, half = tiny_llama(), tiny_llama()
    quantize(full, "nvfp4", ids, batch_size=BATCH)
    quantize(half, "nvfp4", torch.cat(ids.split(BATCH)[0::WORLD]), batch_size=BATCH)
    scales = [(full.get_submodule(n).input_scale, half.get_submodule(n).input_scale)
              for n, m in full.named_modules() if hasattr(m, "input_scale")]
    assert scales and any(not torch.equal(a, b) for a, b in scales)


def test_single_process_helpers_are_identities():
    assert world() == (0, 1) and is_main() and not init_from_env()
    x = torch.tensor([1.0, 2.0])
    assert all_reduce_(x, "max") is x and x.tolist() == [1.0, 2.0] and all_reduce_sum(1.5) == 1.5


def test_more_ranks_than_batches_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("quantkit.calibrate.distributed.world", lambda: (0, 4))
    with pytest.raises(CalibrationError, match="3 calibration batches cannot feed 4 ranks"):
        quantize(tiny_llama(), "nvfp4", calib_ids()[:6], batch_size=BATCH)
