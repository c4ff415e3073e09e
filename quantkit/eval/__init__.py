"""Evaluation: task accuracy through lm-eval, perplexity, kernel checks, throughput, reports.

Each model is evaluated in memory, through the same ``QuantLinear`` forward users run::

    from quantkit.eval import evaluate_tasks, write_eval_report
    scores = evaluate_tasks(model, tokenizer, ["lambada_openai", "wikitext"], name="nvfp4", data_dir=data)

Modules: ``accuracy`` (lm-eval, and the lm-eval model class ``quantkit``), ``tasks`` (offline task
definitions), ``scores`` (the result types), ``perplexity`` (``wikitext2_ppl``, which needs no
lm-eval), ``kernel_check``, ``bench``, ``report``, ``commands`` (the ``quantkit eval`` /
``quantkit bench`` commands). Names below load on first use: importing lm-eval
takes seconds.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from quantkit._lazy import lazy_getattr

_LAZY = {
    "evaluate_tasks": "quantkit.eval.accuracy",
    "TaskScores": "quantkit.eval.scores",
    "Metric": "quantkit.eval.scores",
    "chunked_perplexity": "quantkit.eval.perplexity",
    "perplexity_scores": "quantkit.eval.perplexity",
    "wikitext2_perplexity": "quantkit.eval.perplexity",
    "check_kernels": "quantkit.eval.kernel_check",
    "BenchSettings": "quantkit.eval.bench",
    "bench_model": "quantkit.eval.bench",
    "load_config": "quantkit.eval.bench",
    "random_init_model": "quantkit.eval.bench",
    "write_eval_report": "quantkit.eval.report",
    "write_bench_report": "quantkit.eval.report",
}

if TYPE_CHECKING:
    from quantkit.eval.accuracy import evaluate_tasks
    from quantkit.eval.bench import BenchSettings, bench_model, load_config, random_init_model
    from quantkit.eval.kernel_check import check_kernels
    from quantkit.eval.perplexity import chunked_perplexity, perplexity_scores, wikitext2_perplexity
    from quantkit.eval.report import write_bench_report, write_eval_report
    from quantkit.eval.scores import Metric, TaskScores


__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = list(_LAZY)
