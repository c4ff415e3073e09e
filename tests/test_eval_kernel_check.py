"""Kernel-vs-reference check: the reported error and agreement are those of the two logit sets."""
from __future__ import annotations

import contextlib
import types

import pytest
import torch

from quantkit.eval import kernel_check


class TwoPathModel(torch.nn.Module):
    """Logits ``ref`` under ``use_reference()``, ``ref + shift`` otherwise (the "kernel" path)."""

    def __init__(self, ref: torch.Tensor, shift: torch.Tensor):
        super().__init__()
        self.ref, self.shift, self.reference = ref, shift, False
        self.p = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        logits = self.ref[input_ids[:, 0]] + (0 if self.reference else self.shift[input_ids[:, 0]])
        return types.SimpleNamespace(logits=logits)


def test_check_kernels_reports_the_logit_difference(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 5, 7, generator=gen)  # per first token id: [T=5, V=7] logits
    shift = 0.3 * torch.randn(3, 5, 7, generator=gen)
    model = TwoPathModel(ref, shift)

    @contextlib.contextmanager
    def use_reference():
        model.reference = True
        try:
            yield
        finally:
            model.reference = False

    monkeypatch.setattr("quantkit.kernels.use_reference", use_reference)
    batches = [torch.tensor([[0] * 5, [1] * 5]), torch.tensor([[2] * 5])]
    got = kernel_check.check_kernels(model, batches, name="m")

    errors, agree = [], 0
    for ids in ([0, 1], [2]):
        r, k = ref[ids].double(), (ref + shift)[ids].double()
        errors.append(((k - r).norm() / r.norm()).item())
        agree += (k.argmax(-1) == r.argmax(-1)).sum().item()
    assert (got.batches, got.tokens) == (2, 15)
    assert got.max_rel_err == pytest.approx(max(errors), rel=1e-5)
    assert got.mean_rel_err == pytest.approx(sum(errors) / 2, rel=1e-5)
    assert got.top1_agreement == agree / 15
    assert 0 < got.top1_agreement < 1  # the shift flips some argmaxes


def test_check_batches_without_data_are_seeded_random_tokens():
    vocab = type("Tok", (), {"__len__": lambda self: 50})()
    a = kernel_check.check_batches(vocab, None, n_batches=3, batch_size=2, seq_len=8)
    b = kernel_check.check_batches(vocab, None, n_batches=3, batch_size=2, seq_len=8)
    assert [x.shape for x in a] == [torch.Size([2, 8])] * 3
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and max(x.max() for x in a) < 50
