"""Kernel path vs reference path on the same model: how far apart are the logits?

``QuantLinear`` runs the GPU kernels on CUDA and the PyTorch reference elsewhere;
``quantkit.kernels.use_reference()`` forces the reference. :func:`check_kernels` runs the same
batches both ways and reports the logits' relative error and how often the top-1 tokens agree.
On CPU both runs are the reference, so the error is zero by construction.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from quantkit.eval.perplexity import model_device, wikitext2_token_ids


@dataclass(frozen=True)
class KernelCheck:
    """Kernel-vs-reference agreement of one model over ``batches`` batches (``tokens`` positions).

    ``max_rel_err`` / ``mean_rel_err``: per batch ``||kernel - ref||_F / ||ref||_F`` of the logits
    (FP32), worst and mean over batches; ``top1_agreement``: fraction of positions whose argmax
    token is the same.
    """

    model: str
    batches: int
    tokens: int
    max_rel_err: float
    mean_rel_err: float
    top1_agreement: float


def check_batches(
    tokenizer: PreTrainedTokenizerBase,
    data_dir: Path | None,
    *,
    n_batches: int,
    batch_size: int,
    seq_len: int,
) -> list[torch.Tensor]:
    """``n_batches`` token batches [batch_size, seq_len] (int64): consecutive WikiText-2 test
    windows when ``data_dir`` holds ``wiki.test.raw``, else uniform random tokens (seed 0)."""
    needed = n_batches * batch_size * seq_len
    if data_dir is not None and any(Path(data_dir).rglob("wiki.test.raw")):
        ids = wikitext2_token_ids(tokenizer, data_dir)[:needed]
    else:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, len(tokenizer), (needed,), generator=generator)
    return list(ids.view(n_batches, batch_size, seq_len))


@torch.inference_mode()
def check_kernels(model: PreTrainedModel, batches: Iterable[torch.Tensor], *, name: str) -> KernelCheck:
    """Run each batch [B, T] (int64) through ``model`` with its kernels and under
    ``quantkit.kernels.use_reference()``, and compare the logits."""
    from quantkit.kernels import use_reference

    device = model_device(model)
    errors: list[float] = []
    agree = positions = 0
    for ids in batches:
        ids = ids.to(device)
        kernel = model(input_ids=ids).logits.float()
        with use_reference():
            ref = model(input_ids=ids).logits.float()
        errors.append(((kernel - ref).norm() / ref.norm()).item())
        agree += (kernel.argmax(-1) == ref.argmax(-1)).sum().item()
        positions += ids.numel()
    return KernelCheck(
        model=name,
        batches=len(errors),
        tokens=positions,
        max_rel_err=max(errors),
        mean_rel_err=sum(errors) / len(errors),
        top1_agreement=agree / positions,
    )
