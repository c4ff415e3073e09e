"""Reports: recovery and deltas, Markdown / JSON / PNG output, and ``quantkit eval`` end to end."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
import types

import pytest
import torch
import typer
from test_eval_fixtures import (LAMBADA_TEXTS, lambada_reference, tiny_llama, tiny_tokenizer, token_logprobs,
                                write_data_dir)

pytest.importorskip("lm_eval")
pytest.importorskip("matplotlib")
from quantkit.eval.commands import eval_command  # noqa: E402
from quantkit.eval.report import compare, recovery_percent, write_eval_report  # noqa: E402
from quantkit.eval.scores import Metric, TaskScores  # noqa: E402


def test_recovery_is_oriented_so_100_means_no_loss():
    assert recovery_percent(0.60, 0.50, higher_is_better=True) == pytest.approx(100 * 0.5 / 0.6)
    assert recovery_percent(10.0, 12.0, higher_is_better=False) == pytest.approx(100 * 10 / 12)
    assert recovery_percent(10.0, 10.0, higher_is_better=False) == 100.0
    assert recovery_percent(0.0, 0.3, higher_is_better=True) is None


BASE = TaskScores("bf16", {"lambada_openai": {"acc": Metric(0.6, 0.01, True), "perplexity": Metric(10.0, 0.5, False)}}, {"lambada_openai": 100})
QUANT = TaskScores("nvfp4", {"lambada_openai": {"acc": Metric(0.57, 0.01, True), "perplexity": Metric(11.0, 0.6, False)}}, {"lambada_openai": 100})


def test_compare_sets_each_metric_against_the_baseline():
    rows = {r.metric: r for r in compare([QUANT], BASE)}
    assert rows["acc"].delta == pytest.approx(-0.03)
    assert rows["acc"].recovery == pytest.approx(95.0)
    assert rows["perplexity"].delta == pytest.approx(1.0)
    assert rows["perplexity"].recovery == pytest.approx(100 * 10 / 11)
    assert (rows["acc"].baseline, rows["acc"].baseline_stderr, rows["acc"].stderr) == (0.6, 0.01, 0.01)
    alone = compare([QUANT], None)
    assert [r.recovery for r in alone] == [None, None] and [r.value for r in alone] == [0.57, 11.0]


def test_write_eval_report_files(tmp_path):
    paths = write_eval_report(tmp_path, [QUANT], BASE, [], {"target": "x"})
    assert [p.name for p in paths] == ["eval.json", "eval.md", "eval_recovery.png"]
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["baseline"] == "bf16"
    assert report["samples"] == {"bf16": {"lambada_openai": 100}, "nvfp4": {"lambada_openai": 100}}
    assert [(r["metric"], r["value"], r["baseline"]) for r in report["rows"]] == [("acc", 0.57, 0.6), ("perplexity", 11.0, 10.0)]
    markdown = (tmp_path / "eval.md").read_text()
    assert "| lambada_openai | acc ↑ | nvfp4 | 0.57 ± 0.01 | 0.6 ± 0.01 | -0.03 | 95.00 |" in markdown
    assert "| lambada_openai | perplexity ↓ | nvfp4 | 11 ± 0.6 | 10 ± 0.5 | +1 | 90.91 |" in markdown
    assert (tmp_path / "eval_recovery.png").read_bytes()[:4] == b"\x89PNG"


def test_report_without_matplotlib_writes_the_rest_and_says_why(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    with pytest.warns(UserWarning, match=r"matplotlib is not installed, so no eval_recovery.png: pip install 'quantkit\[eval\]'"):
        paths = write_eval_report(tmp_path, [QUANT], BASE, [], {"target": "x"})
    assert [p.name for p in paths] == ["eval.json", "eval.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json", "eval.md"]


def test_eval_without_lm_eval_is_a_clear_error(tmp_path, monkeypatch, capsys):
    find_spec = importlib.util.find_spec  # as if lm-eval were not installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else find_spec(name, *a))
    with pytest.raises(typer.Exit) as exit_info:
        eval_command(target="demo", tasks="lambada_openai", device="cpu", out=tmp_path)
    assert exit_info.value.exit_code == 2
    err = capsys.readouterr().err
    assert "tasks lambada_openai need lm-eval: pip install 'quantkit[eval]' (wikitext2_ppl runs without it)" in err
    assert not list(tmp_path.iterdir())


@pytest.fixture()
def tiny_sources(monkeypatch):
    """``quantkit.models.load_model`` serving a fresh copy of one tiny Llama for any source."""
    tok = tiny_tokenizer()
    reference = tiny_llama(len(tok))
    fake = types.ModuleType("quantkit.models")

    def load_model(source, *, device="cpu", dtype=torch.bfloat16):
        model = tiny_llama(len(tok))
        model.load_state_dict(reference.state_dict())
        return model, tok

    fake.load_model = load_model
    fake.ModelLoadError = ValueError
    monkeypatch.setitem(sys.modules, "quantkit.models", fake)
    return reference, tok


def test_eval_command_quantized_vs_unquantized(tmp_path, tiny_sources):
    reference, tok = tiny_sources
    data = write_data_dir(tmp_path / "data")
    eval_command(target="tiny", formats="nvfp4", tasks="lambada_openai", device="cpu", data_dir=data, out=tmp_path / "out", batch_size=2)
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert report["baseline"] == "bf16" and report["meta"]["baseline"] == "tiny"
    base = {r["metric"]: r for r in report["baseline_rows"]}
    rows = {r["metric"]: r for r in report["rows"]}
    acc, ppl = lambada_reference(reference, tok, LAMBADA_TEXTS)
    assert base["perplexity"]["value"] == pytest.approx(ppl, rel=1e-4)
    assert base["acc"]["value"] == pytest.approx(acc)
    assert rows["perplexity"]["model"] == "nvfp4"
    assert rows["perplexity"]["value"] != pytest.approx(ppl, rel=1e-4)  # really quantized
    assert rows["perplexity"]["baseline"] == base["perplexity"]["value"]
    assert rows["perplexity"]["recovery"] == pytest.approx(100 * base["perplexity"]["value"] / rows["perplexity"]["value"])


def test_eval_command_wikitext2_ppl_runs_without_lm_eval(tmp_path, tiny_sources, monkeypatch):
    find_spec = importlib.util.find_spec  # as if lm-eval were not installed: importing it fails
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    reference, tok = tiny_sources
    data = write_data_dir(tmp_path / "data")
    seq_len, windows = 16, 3
    eval_command(target="tiny", formats="nvfp4", tasks="wikitext2_ppl", limit=str(windows), device="cpu",
                 data_dir=data, out=tmp_path / "out", batch_size=2, seq_len=seq_len)
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    (base,), (row,) = report["baseline_rows"], report["rows"]
    # independent: the first `windows` windows of the joined WikiText rows, NLL of tokens 1.. of each
    raw = (data / "wikitext-2-raw" / "wiki.test.raw").read_text()
    ids = tok.encode("\n\n".join(line if line.strip() else "" for line in raw.splitlines(keepends=True)))
    nll = 0.0
    for w in range(windows):
        window = ids[w * seq_len: (w + 1) * seq_len]
        lp = token_logprobs(reference, window)
        nll -= sum(lp[i, window[i + 1]].item() for i in range(seq_len - 1))
    assert (base["task"], base["metric"]) == ("wikitext2_ppl", "token_perplexity")
    assert base["value"] == pytest.approx(math.exp(nll / (windows * (seq_len - 1))), rel=1e-4)
    assert row["model"] == "nvfp4" and row["value"] != pytest.approx(base["value"], rel=1e-4)  # really quantized


@pytest.mark.parametrize("tasks", ["wikitext2_ppl", "lambada_openai"])
def test_eval_offline_without_data_dir_is_a_clear_error(tmp_path, tiny_sources, monkeypatch, capsys, tasks):
    import datasets.config
    import huggingface_hub.constants

    for module in (datasets.config, huggingface_hub.constants):
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    with pytest.raises(typer.Exit) as exit_info:
        eval_command(target="tiny", tasks=tasks, limit="2", device="cpu", out=tmp_path / "out", seq_len=16)
    assert exit_info.value.exit_code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"cannot read the data of {tasks}:" in err and "Offline, --data-dir DIR holding lambada_test.jsonl" in err
    assert not (tmp_path / "out").exists()


def test_eval_unknown_format_is_a_clear_error_before_loading(tmp_path, monkeypatch, capsys):
    import quantkit.eval.commands as commands

    monkeypatch.setattr(commands, "_load_model", lambda *a: pytest.fail("loaded a model"))
    with pytest.raises(typer.Exit):
        eval_command(target="tiny", formats="nvfp4,int3", tasks="wikitext2_ppl", device="cpu", out=tmp_path / "out")
    assert "unknown format 'int3'; valid formats: nvfp4," in " ".join(capsys.readouterr().err.split())


def test_eval_data_dir_without_the_file_is_a_clear_error(tmp_path, tiny_sources, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(typer.Exit):
        eval_command(target="tiny", tasks="wikitext2_ppl", device="cpu", data_dir=tmp_path / "empty", out=tmp_path / "out")
    assert f"no wiki.test.raw under {tmp_path / 'empty'}" in " ".join(capsys.readouterr().err.split())


def test_eval_command_check_kernels(tmp_path, tiny_sources):
    eval_command(target="tiny", formats="nvfp4", device="cpu", check_kernels=True, out=tmp_path, batch_size=2, seq_len=16)
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["rows"] == []
    (check,) = report["kernel_checks"]
    assert (check["model"], check["batches"], check["tokens"]) == ("nvfp4", 4, 4 * 2 * 16)
    # on CPU QuantLinear always runs the reference, so both paths agree exactly
    assert check["max_rel_err"] == 0.0 and check["top1_agreement"] == 1.0
