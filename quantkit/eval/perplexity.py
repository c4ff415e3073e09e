"""Token-level perplexity over fixed windows: the WikiText-2 number quantization papers report.

``wikitext2_ppl`` follows the GPTQ / AWQ convention: the WikiText-2 raw test split's rows joined
with ``"\\n\\n"``, tokenized once, cut into non-overlapping windows of ``seq_len`` tokens (the
shorter tail dropped); each window predicts its tokens 1..seq_len-1 from the ones before it, and
perplexity is ``exp(total NLL / predicted tokens)``. It is cheaper than lm-eval's ``wikitext`` (a
rolling, document-level word perplexity) and not comparable with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import track
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from quantkit.eval.scores import Metric, TaskScores
from quantkit.eval.tasks import find_data_file
from quantkit.eval.tasks.documents import read_wikitext_lines

PERPLEXITY_TASK = "wikitext2_ppl"
_LOSS_CHUNK = 256  # positions whose logits are upcast to FP32 at once (vocabularies reach 262k)


@dataclass(frozen=True)
class Perplexity:
    """Summed natural-log NLL over ``tokens`` predicted tokens in ``windows`` windows."""

    nll_sum: float
    tokens: int
    windows: int

    @property
    def value(self) -> float:
        """``exp(nll_sum / tokens)``."""
        return math.exp(self.nll_sum / self.tokens)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (where its inputs must go)."""
    return next(model.parameters()).device


@torch.inference_mode()
def window_nll(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-row NLL of ``input_ids`` [B, T] (int64): each row's tokens 1..T-1 predicted from the
    tokens before them, natural log, summed in FP64 -> [B] float64."""
    logits = model(input_ids=input_ids.to(model_device(model))).logits[:, :-1]  # [B, T-1, V]
    targets = input_ids[:, 1:].to(logits.device)
    nll = torch.zeros(input_ids.shape[0], dtype=torch.float64)
    for row in range(logits.shape[0]):
        for start in range(0, targets.shape[1], _LOSS_CHUNK):
            chunk = logits[row, start : start + _LOSS_CHUNK].float()
            loss = torch.nn.functional.cross_entropy(chunk, targets[row, start : start + _LOSS_CHUNK], reduction="sum")
            nll[row] += loss.double().item()
    return nll


def chunked_perplexity(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    *,
    seq_len: int,
    batch_size: int = 1,
    max_windows: int | None = None,
) -> Perplexity:
    """Perplexity of ``model`` on the stream ``token_ids`` [N] (int64) in non-overlapping windows
    of ``seq_len`` tokens (at most ``max_windows`` of them; the tail shorter than a window is dropped)."""
    n_windows = token_ids.numel() // seq_len
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise ValueError(f"{token_ids.numel()} tokens do not fill one window of {seq_len}")
    windows = token_ids[: n_windows * seq_len].view(n_windows, seq_len)
    nll_sum = 0.0
    for start in track(range(0, n_windows, batch_size), description="perplexity", transient=True):
        nll_sum += window_nll(model, windows[start : start + batch_size]).sum().item()
    return Perplexity(nll_sum=nll_sum, tokens=n_windows * (seq_len - 1), windows=n_windows)


def wikitext2_rows(data_dir: Path | None) -> list[str]:
    """The rows of WikiText-2 raw's test split: from ``wiki.test.raw`` under ``data_dir``, else
    from the Hugging Face hub (``wikitext``, ``wikitext-2-raw-v1``)."""
    if data_dir is not None:
        return read_wikitext_lines(find_data_file(data_dir, "wiki.test.raw"))
    import datasets

    return list(datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"])


def wikitext2_token_ids(tokenizer: PreTrainedTokenizerBase, data_dir: Path | None) -> torch.Tensor:
    """The test split as one token stream [N] (int64): rows joined with ``"\\n\\n"``, tokenized once
    with the tokenizer's default special tokens."""
    text = "\n\n".join(wikitext2_rows(data_dir))
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def wikitext2_perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    data_dir: Path | None = None,
    seq_len: int = 2048,
    batch_size: int = 1,
    max_windows: int | None = None,
) -> Perplexity:
    """The ``wikitext2_ppl`` task: :func:`chunked_perplexity` of the WikiText-2 test stream."""
    ids = wikitext2_token_ids(tokenizer, data_dir)
    return chunked_perplexity(model, ids, seq_len=seq_len, batch_size=batch_size, max_windows=max_windows)


def perplexity_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    name: str,
    data_dir: Path | None = None,
    seq_len: int = 2048,
    batch_size: int = 1,
    max_windows: int | None = None,
) -> TaskScores:
    """The ``wikitext2_ppl`` task alone as ``name``'s :class:`TaskScores` (metric
    ``token_perplexity``, samples = windows scored); needs no lm-eval."""
    ppl = wikitext2_perplexity(model, tokenizer, data_dir=data_dir, seq_len=seq_len, batch_size=batch_size,
                               max_windows=max_windows)
    metric = Metric(ppl.value, None, higher_is_better=False)
    return TaskScores(model=name, metrics={PERPLEXITY_TASK: {"token_perplexity": metric}},
                      samples={PERPLEXITY_TASK: ppl.windows})
