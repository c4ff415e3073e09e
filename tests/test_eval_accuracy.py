"""lm-eval through quantkit: offline tasks and perplexity equal an independent FP64 computation."""
from __future__ import annotations

import math
import re
import sys
import types

import pytest
import torch
from test_eval_fixtures import (
    LAMBADA_TEXTS,
    lambada_reference,
    tiny_llama,
    tiny_tokenizer,
    token_logprobs,
    write_data_dir,
)

accuracy = pytest.importorskip("quantkit.eval.accuracy")
from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer  # noqa: E402

from quantkit.eval.perplexity import chunked_perplexity, wikitext2_token_ids  # noqa: E402
from quantkit.eval.tasks.documents import read_wikitext_pages  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(len(tok))


@pytest.fixture()
def data_dir(tmp_path):
    return write_data_dir(tmp_path)


def test_lambada_offline_equals_fp64_reference(model, tok, data_dir):
    scores = accuracy.evaluate_tasks(model, tok, ["lambada_openai"], name="tiny", data_dir=data_dir, batch_size=2)
    acc, ppl = lambada_reference(model, tok, LAMBADA_TEXTS)
    got = scores.metrics["lambada_openai"]
    assert scores.samples == {"lambada_openai": len(LAMBADA_TEXTS)}
    assert got["acc"].value == pytest.approx(acc, abs=1e-12)
    assert got["perplexity"].value == pytest.approx(ppl, rel=1e-4)
    assert got["acc"].higher_is_better and not got["perplexity"].higher_is_better
    assert got["acc"].stderr is not None


def test_log_probabilities_of_a_bf16_model_are_summed_in_fp32(tok, data_dir):
    """lm-eval's log-softmax runs in FP32, not the model's bf16 (whose ~0.4 % steps move a document's
    log-likelihood by whole nats): against the FP64 log-softmax of the same bf16 logits."""
    model = tiny_llama(len(tok)).to(torch.bfloat16)

    def own_logits(model, ids):  # the bf16 forward lm-eval runs: the passage without its last token
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=torch.tensor([ids[:-1]])).logits[0].double(), dim=-1)

    scores = accuracy.evaluate_tasks(model, tok, ["lambada_openai"], name="tiny", data_dir=data_dir, batch_size=1)
    _, ppl = lambada_reference(model, tok, LAMBADA_TEXTS, logprobs=own_logits)
    assert scores.metrics["lambada_openai"]["perplexity"].value == pytest.approx(ppl, rel=1e-5)


def rolling_loglikelihood(model, tok, text, max_length):
    """FP64 log-likelihood of ``text`` as lm-eval's rolling windows score it: ``[EOS] + tokens``,
    the tokens predicted in consecutive chunks of ``max_length``, each chunk from the (at most)
    ``max_length`` inputs right before its last token (so the last, short chunk sees more context)."""
    ids = [tok.eos_token_id] + tok.encode(text)
    total = 0.0
    for first in range(1, len(ids), max_length):
        end = min(first + max_length, len(ids))
        start = max(0, end - 1 - max_length)
        lp = token_logprobs(model, ids[start:end])
        total += sum(lp[t - 1 - start, ids[t]].item() for t in range(first, end))
    return total


def test_wikitext_offline_equals_fp64_rolling_reference(model, tok, data_dir):
    max_length = 16  # several windows per document
    scores = accuracy.evaluate_tasks(
        model, tok, ["wikitext"], name="tiny", data_dir=data_dir, max_length=max_length, batch_size=3
    )
    pages = [p["page"] for p in read_wikitext_pages(data_dir / "wikitext-2-raw" / "wiki.test.raw")]
    assert len(pages) == 3 and scores.samples == {"wikitext": 3}
    ll = sum(rolling_loglikelihood(model, tok, wikitext_detokenizer({"page": p}), max_length) for p in pages)
    words = sum(len(re.split(r"\s+", p)) for p in pages)
    n_bytes = sum(len(p.encode("utf-8")) for p in pages)
    got = scores.metrics["wikitext"]
    assert got["word_perplexity"].value == pytest.approx(math.exp(-ll / words), rel=1e-4)
    assert got["byte_perplexity"].value == pytest.approx(math.exp(-ll / n_bytes), rel=1e-4)
    assert got["bits_per_byte"].value == pytest.approx(-ll / n_bytes / math.log(2), rel=1e-4)


def test_limit_takes_the_first_documents_per_task(model, tok, data_dir):
    scores = accuracy.evaluate_tasks(
        model, tok, ["lambada_openai", "wikitext"], name="tiny", data_dir=data_dir, limit={"lambada_openai": 2, "wikitext": 1}
    )
    _, ppl = lambada_reference(model, tok, LAMBADA_TEXTS[:2])
    assert scores.samples == {"lambada_openai": 2, "wikitext": 1}
    assert scores.metrics["lambada_openai"]["perplexity"].value == pytest.approx(ppl, rel=1e-4)


def test_wikitext2_ppl_equals_fp64_windows(model, tok, data_dir):
    seq_len = 24
    scores = accuracy.evaluate_tasks(
        model, tok, ["wikitext2_ppl"], name="tiny", data_dir=data_dir, seq_len=seq_len, batch_size=2
    )
    raw = (data_dir / "wikitext-2-raw" / "wiki.test.raw").read_text()
    rows = [line if line.strip() else "" for line in raw.splitlines(keepends=True)]
    ids = tok.encode("\n\n".join(rows))
    n = len(ids) // seq_len
    nll = 0.0
    for w in range(n):
        window = ids[w * seq_len : (w + 1) * seq_len]
        lp = token_logprobs(model, window)
        nll -= sum(lp[i, window[i + 1]].item() for i in range(seq_len - 1))
    assert wikitext2_token_ids(tok, data_dir).tolist() == ids
    assert scores.samples == {"wikitext2_ppl": n}
    assert scores.metrics["wikitext2_ppl"]["token_perplexity"].value == pytest.approx(
        math.exp(nll / (n * (seq_len - 1))), rel=1e-4
    )


def test_chunked_perplexity_of_a_perfect_predictor_is_one():
    class Repeat(torch.nn.Module):
        """Predicts token t+1 = t with certainty."""

        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids):
            logits = torch.full((*input_ids.shape, 5), -1e4) + self.p
            logits.scatter_(-1, input_ids[..., None], 0.0)
            return types.SimpleNamespace(logits=logits)

    ppl = chunked_perplexity(Repeat(), torch.full((50,), 3), seq_len=8, batch_size=3, max_windows=5)
    assert (ppl.windows, ppl.tokens) == (5, 35)
    assert ppl.value == pytest.approx(1.0)


def test_lm_eval_model_quantkit_loads_through_quantkit(model, tok, data_dir, monkeypatch):
    """``lm_eval.simple_evaluate(model="quantkit", model_args="pretrained=...")`` loads through
    ``quantkit.models.load_model`` and scores what the in-memory path scores."""
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    from quantkit.eval.tasks import task_specs

    loaded = []
    fake_models = types.ModuleType("quantkit.models")

    def load_model(source, *, device="cpu", dtype=torch.bfloat16):
        loaded.append((source, device))
        return model, tok

    fake_models.load_model = load_model
    monkeypatch.setitem(sys.modules, "quantkit.models", fake_models)
    assert get_model("quantkit") is accuracy.QuantkitLM
    out = lm_eval.simple_evaluate(
        model="quantkit",
        model_args="pretrained=some/checkpoint,device=cpu",
        tasks=task_specs(["lambada_openai"], data_dir),
        task_manager=TaskManager(include_defaults=False),
    )
    assert loaded == [("some/checkpoint", "cpu")]
    _, ppl = lambada_reference(model, tok, LAMBADA_TEXTS)
    assert out["results"]["lambada_openai"]["perplexity,none"] == pytest.approx(ppl, rel=1e-4)
