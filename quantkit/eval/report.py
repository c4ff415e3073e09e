"""Reports of eval and bench runs: one set of tables, written as Markdown, JSON, PNG and a rich
terminal table.

Recovery is the quantized model's score as a percentage of the baseline's, oriented so that 100 %
means "as good as the baseline" for every metric: ``100 * value / baseline`` where higher is
better (accuracy), ``100 * baseline / value`` where lower is better (perplexity).
"""
from __future__ import annotations

import importlib.util
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from quantkit.terminal import wide

if TYPE_CHECKING:  # annotations only: importing lm-eval takes seconds
    from quantkit.eval.bench import ModelBench
    from quantkit.eval.kernel_check import KernelCheck
    from quantkit.eval.scores import TaskScores

TableData = tuple[list[str], list[list[str]]]  # headers, rows of cells


@dataclass(frozen=True)
class ComparisonRow:
    """One task metric of one model next to the baseline's (``None`` fields: no baseline)."""

    task: str
    metric: str
    model: str
    higher_is_better: bool
    value: float
    stderr: float | None
    baseline: float | None
    baseline_stderr: float | None
    delta: float | None
    recovery: float | None


def recovery_percent(baseline: float, value: float, higher_is_better: bool) -> float | None:
    """``value`` as a percentage of ``baseline``, 100 = no loss (see the module docstring);
    ``None`` where the ratio is undefined (a zero denominator)."""
    numerator, denominator = (value, baseline) if higher_is_better else (baseline, value)
    return None if denominator == 0 else 100.0 * numerator / denominator


def compare(models: Sequence[TaskScores], baseline: TaskScores | None) -> list[ComparisonRow]:
    """One row per (model, task, metric) of ``models``, set against ``baseline`` where it has the metric."""
    rows = []
    for scores in models:
        for task, metrics in scores.metrics.items():
            for metric, m in metrics.items():
                base = baseline.metrics.get(task, {}).get(metric) if baseline else None
                rows.append(
                    ComparisonRow(
                        task=task,
                        metric=metric,
                        model=scores.model,
                        higher_is_better=m.higher_is_better,
                        value=m.value,
                        stderr=m.stderr,
                        baseline=base.value if base else None,
                        baseline_stderr=base.stderr if base else None,
                        delta=m.value - base.value if base else None,
                        recovery=recovery_percent(base.value, m.value, m.higher_is_better) if base else None,
                    )
                )
    return rows


def _num(x: float | None, digits: int = 4) -> str:
    """A table cell: ``x`` to ``digits`` significant digits, or an en dash for ``None``."""
    return "–" if x is None else f"{x:.{digits}g}"


def _with_err(value: float | None, stderr: float | None) -> str:
    return _num(value) if stderr is None else f"{_num(value)} ± {_num(stderr, 2)}"


def eval_tables(
    rows: Sequence[ComparisonRow], baseline: TaskScores | None, checks: Sequence[KernelCheck]
) -> dict[str, TableData]:
    """The eval report's tables by title: accuracy (one row per task metric and model, the models
    of a metric together), kernel checks."""
    tables: dict[str, TableData] = {}
    first_seen = {key: i for i, key in reversed(list(enumerate((r.task, r.metric) for r in rows)))}
    rows = sorted(rows, key=lambda r: first_seen[(r.task, r.metric)])
    if rows or baseline:
        headers = ["task", "metric", "model", "value", "baseline", "delta", "recovery %"]
        cells = [
            [
                r.task,
                f"{r.metric} {'↑' if r.higher_is_better else '↓'}",
                r.model,
                _with_err(r.value, r.stderr),
                _with_err(r.baseline, r.baseline_stderr),
                "–" if r.delta is None else f"{r.delta:+.4g}",
                "–" if r.recovery is None else f"{r.recovery:.2f}",
            ]
            for r in rows
        ]
        title = f"Accuracy (baseline: {baseline.model})" if baseline else "Accuracy"
        tables[title] = (headers, cells)
    if checks:
        headers = ["model", "batches", "tokens", "max rel. err", "mean rel. err", "top-1 agreement"]
        cells = [
            [c.model, str(c.batches), str(c.tokens), f"{c.max_rel_err:.3e}", f"{c.mean_rel_err:.3e}", f"{c.top1_agreement:.4f}"]
            for c in checks
        ]
        tables["Kernel vs reference logits"] = (headers, cells)
    return tables


def _side_by_side(
    key_headers: list[str],
    values: dict[str, dict[tuple, float]],
    baseline: str | None,
    unit: str,
    higher_is_better: bool,
    fmt: str,
) -> TableData:
    """One row per measurement key, one column per model (``values[model][key]``), then one
    speed-up column per non-baseline model (``×``; above 1 means faster than the baseline)."""
    keys = list(dict.fromkeys(key for per_model in values.values() for key in per_model))
    others = [model for model in values if baseline is not None and model != baseline]
    headers = key_headers + [f"{model} {unit}" for model in values] + [f"{model} ×" for model in others]
    rows = []
    for key in keys:
        row = [str(part) for part in key]
        row += [format(values[model][key], fmt) if key in values[model] else "–" for model in values]
        for model in others:
            value, base = values[model].get(key), values[baseline].get(key)
            speedup = None if value is None or base is None else (value / base if higher_is_better else base / value)
            row.append("–" if speedup is None else f"{speedup:.2f}")
        rows.append(row)
    return headers, rows


def _grouped(benches: Sequence[ModelBench], results, label, reason) -> list[list[str]]:
    """Rows ``[model, labels, reason]``: each model's ``results(bench)`` grouped by ``reason(r)``
    (results whose reason is ``None`` are left out), ``label(r)`` joined in order."""
    groups: dict[tuple[str, str], list[str]] = {}
    for b in benches:
        for r in results(b):
            if (why := reason(r)) is not None:
                groups.setdefault((b.model, why), []).append(label(r))
    return [[model, ", ".join(labels), why] for (model, why), labels in groups.items()]


def bench_tables(benches: Sequence[ModelBench], baseline: ModelBench | None) -> dict[str, TableData]:
    """The bench report's tables by title (those of prefill, decode and GEMMs that have rows, and
    notes where decode ran without CUDA graphs), models side by side, speed-ups against ``baseline``."""
    base = baseline.model if baseline else None
    tables = {
        "Prefill tokens/s": _side_by_side(
            ["batch", "seq"], {b.model: {(r.batch, r.seq): r.tokens_per_s for r in b.prefill} for b in benches},
            base, "tok/s", True, ",.0f",
        ),
        "Decode tokens/s": _side_by_side(
            ["batch", "context"], {b.model: {(r.batch, r.context): r.tokens_per_s for r in b.decode} for b in benches},
            base, "tok/s", True, ",.1f",
        ),
        "GEMM time, decoder layer 0 and lm_head (µs)": _side_by_side(
            ["layer", "N", "K", "M"], {b.model: {(r.layer, r.n, r.k, r.m): r.seconds * 1e6 for r in b.gemms} for b in benches},
            base, "µs", False, ",.1f",
        ),
    }
    tables = {title: table for title, table in tables.items() if table[1]}  # what the run measured
    eager = _grouped(benches, lambda b: b.decode, lambda r: str(r.batch),
                     lambda r: None if r.cuda_graph else r.note or "CUDA graphs off, or not on CUDA")
    if eager:
        tables["Decode steps run eagerly (no CUDA graph)"] = (["model", "batches", "why"], eager)
    graphs = _grouped(benches, lambda b: b.prefill, lambda r: f"{r.batch}x{r.seq}",
                      lambda r: "CUDA graph replays (no host launch time)" if r.cuda_graph else r.note)
    if graphs:
        tables["Prefill shapes timed as CUDA graphs"] = (["model", "shapes", "how"], graphs)
    eager_gemms = [[b.model, f"{sum(not r.cuda_graph for r in b.gemms)} of {len(b.gemms)}",
                    "host launch time included; the rest: CUDA-graph replays"]
                   for b in benches if any(not r.cuda_graph for r in b.gemms)]
    if eager_gemms:
        tables["GEMMs timed as eager calls"] = (["model", "calls", "note"], eager_gemms)
    return tables


def to_markdown(title: str, tables: dict[str, TableData], meta: dict[str, Any]) -> str:
    """A Markdown document: ``title``, the run's ``meta`` as a list, then each table."""
    lines = [f"# {title}", ""]
    lines += [f"- **{key}**: {value}" for key, value in meta.items()]
    for name, (headers, rows) in tables.items():
        lines += ["", f"## {name}", "", "| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def print_tables(tables: dict[str, TableData], console: Console | None = None) -> None:
    """Print each table with rich to ``console`` (default: stdout, 160 columns wide in a log)."""
    console = console or wide(Console())
    for name, (headers, rows) in tables.items():
        table = Table(title=name)
        for header in headers:
            table.add_column(header, overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)


def _plotted(draw: Callable[[Any, Path], None], data: Any, path: Path) -> bool:
    """``draw(data, path)`` and True; where matplotlib is not installed, a warning and False (the
    report's other files are written all the same)."""
    if importlib.util.find_spec("matplotlib") is None:
        warnings.warn(f"matplotlib is not installed, so no {path.name}: pip install 'quantkit[eval]'", stacklevel=3)
        return False
    draw(data, path)
    return True


def _plot_recovery(rows: Sequence[ComparisonRow], path: Path) -> None:
    """Bar chart of recovery % per task metric, one bar per model, with a line at 100 %."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.recovery is not None]
    keys = list(dict.fromkeys(f"{r.task}\n{r.metric}" for r in rows))
    models = list(dict.fromkeys(r.model for r in rows))
    width = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(keys)), 4))
    for i, model in enumerate(models):
        by_key = {f"{r.task}\n{r.metric}": r.recovery for r in rows if r.model == model}
        xs = [j + i * width for j, key in enumerate(keys) if key in by_key]
        ax.bar(xs, [by_key[key] for key in keys if key in by_key], width, label=model)
    ax.axhline(100, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], keys, fontsize=8)
    ax.set_ylabel("recovery vs baseline (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_throughput(benches: Sequence[ModelBench], path: Path) -> None:
    """Tokens/s against batch size: prefill (one line per model and sequence length) and decode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (pre, dec) = plt.subplots(1, 2, figsize=(11, 4))
    for b in benches:
        for seq in sorted({r.seq for r in b.prefill}):
            points = sorted((r.batch, r.tokens_per_s) for r in b.prefill if r.seq == seq)
            pre.plot(*zip(*points), marker="o", label=f"{b.model}, seq {seq}")
        if b.decode:
            dec.plot([r.batch for r in b.decode], [r.tokens_per_s for r in b.decode], marker="o", label=b.model)
    for ax, title in ((pre, "prefill"), (dec, "decode")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("tokens/s")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_eval_report(
    out_dir: Path,
    models: Sequence[TaskScores],
    baseline: TaskScores | None,
    checks: Sequence[KernelCheck],
    meta: dict[str, Any],
) -> list[Path]:
    """Write ``eval.json``, ``eval.md`` and (with a baseline) ``eval_recovery.png`` into ``out_dir``;
    print the tables; return the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = compare(models, baseline)
    base_rows = compare([baseline], None) if baseline else []
    tables = eval_tables(rows, baseline, checks)
    document = {
        "meta": meta,
        "baseline": baseline.model if baseline else None,
        "samples": {s.model: s.samples for s in ([baseline] if baseline else []) + list(models)},
        "baseline_rows": [asdict(r) for r in base_rows],
        "rows": [asdict(r) for r in rows],
        "kernel_checks": [asdict(c) for c in checks],
    }
    paths = [out_dir / "eval.json", out_dir / "eval.md"]
    paths[0].write_text(json.dumps(document, indent=2) + "\n")
    paths[1].write_text(to_markdown("quantkit eval", tables, meta))
    if any(r.recovery is not None for r in rows) and _plotted(_plot_recovery, rows, out_dir / "eval_recovery.png"):
        paths.append(out_dir / "eval_recovery.png")
    print_tables(tables)
    return paths


def write_bench_report(
    out_dir: Path, benches: Sequence[ModelBench], baseline: ModelBench | None, meta: dict[str, Any]
) -> list[Path]:
    """Write ``bench.json``, ``bench.md`` and ``bench_throughput.png`` into ``out_dir``; print the
    tables; return the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    everything = ([baseline] if baseline else []) + list(benches)
    tables = bench_tables(everything, baseline)
    document = {"meta": meta, "baseline": baseline.model if baseline else None, "models": [asdict(b) for b in everything]}
    paths = [out_dir / "bench.json", out_dir / "bench.md"]
    paths[0].write_text(json.dumps(document, indent=2) + "\n")
    paths[1].write_text(to_markdown("quantkit bench", tables, meta))
    if _plotted(_plot_throughput, everything, out_dir / "bench_throughput.png"):
        paths.append(out_dir / "bench_throughput.png")
    print_tables(tables)
    return paths
