"""Task accuracy through lm-eval, with the in-memory model (quantized layers included).

:func:`evaluate_tasks` wraps the model a caller already holds in lm-eval's ``HFLM``, so a quantized
model is scored through the same ``QuantLinear`` forward users run. Task names are lm-eval's; with
a ``data_dir`` the tasks in :data:`quantkit.eval.tasks.OFFLINE_TASKS` read local files, and
``wikitext2_ppl`` is quantkit's own token-level perplexity (:mod:`quantkit.eval.perplexity`).

Importing this module registers the lm-eval model class ``quantkit`` (:class:`QuantkitLM`)::

    import lm_eval, quantkit.eval.accuracy
    lm_eval.simple_evaluate(model="quantkit", model_args="pretrained=ckpt_dir", tasks=["lambada_openai"])

and ``python -m quantkit.eval.accuracy --model quantkit --model_args pretrained=DIR --tasks ...``
is the ``lm_eval`` command line with that class registered.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

import lm_eval
import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from quantkit.eval.perplexity import PERPLEXITY_TASK, perplexity_scores
from quantkit.eval.scores import Metric, TaskScores
from quantkit.eval.tasks import OFFLINE_TASKS, task_specs


@register_model("quantkit")
class QuantkitLM(HFLM):
    """lm-eval's Hugging Face model, loaded by quantkit: ``pretrained`` is anything
    :func:`quantkit.models.load_model` accepts (``demo``, a hub id, an HF or quantkit checkpoint
    directory); ``format`` (e.g. ``nvfp4``) additionally quantizes it in memory (RTN).
    Other arguments (``batch_size``, ``max_length``, ...) are ``HFLM``'s."""

    def __init__(
        self,
        pretrained: str | PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        format: str | None = None,
        device: str | None = None,
        **kwargs,
    ) -> None:
        if isinstance(pretrained, str):
            from quantkit.models import load_model

            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            pretrained, tokenizer = load_model(pretrained, device=device)
        if format is not None:
            import quantkit

            quantkit.quantize_model(pretrained, format=format)
        kwargs.setdefault("softmax_dtype", torch.float32)  # as evaluate_tasks
        super().__init__(pretrained=pretrained, tokenizer=tokenizer, **kwargs)


@functools.cache
def _indexed_task_manager() -> TaskManager:
    """lm-eval's task manager over its whole task tree (indexing it takes seconds: built once)."""
    return TaskManager()


def _task_manager(specs: Sequence[str | dict]) -> TaskManager:
    """A task manager; the task tree's index only where a spec names a task (not a full config)."""
    return _indexed_task_manager() if any(isinstance(spec, str) for spec in specs) else TaskManager(include_defaults=False)


def unknown_tasks(tasks: Sequence[str]) -> list[str]:
    """The names in ``tasks`` that are neither lm-eval tasks, groups or tags nor YAML files (the
    offline tasks are known without indexing lm-eval's task tree, which takes seconds)."""
    rest = [t for t in tasks if t not in OFFLINE_TASKS and t != PERPLEXITY_TASK and not Path(t).is_file()]
    known = set(_indexed_task_manager().all_tasks) if rest else set()
    return [t for t in rest if t not in known]


def _parse_results(out: dict, task: str) -> dict[str, Metric]:
    """``{metric: Metric}`` from lm-eval's ``results[task]`` (keys ``"acc,none"``, ``"acc_stderr,none"``)."""
    values = out["results"][task]
    metrics: dict[str, Metric] = {}
    for key, value in values.items():
        name, _, filter_name = key.partition(",")
        if not filter_name or name.endswith("_stderr"):
            continue
        stderr = values.get(f"{name}_stderr,{filter_name}")
        metrics[name] = Metric(
            value=float(value),
            stderr=float(stderr) if isinstance(stderr, (int, float)) else None,
            higher_is_better=bool(out["higher_is_better"][task][name]),
        )
    return metrics


def evaluate_tasks(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[str],
    *,
    name: str,
    data_dir: Path | None = None,
    limit: int | Mapping[str, int] | None = None,
    batch_size: int = 1,
    max_length: int | None = None,
    seq_len: int = 2048,
) -> TaskScores:
    """Score ``model`` on ``tasks`` (zero-shot, lm-eval's defaults otherwise).

    ``limit`` caps the documents of every task, or of the tasks a mapping names (the first
    ``limit``; for ``wikitext2_ppl``, windows of ``seq_len`` tokens); ``max_length`` overrides the
    context lm-eval gives the model (default: the model config's); ``data_dir`` switches offline
    tasks to local files.
    """
    limits = dict(limit) if isinstance(limit, Mapping) else {task: limit for task in tasks}
    metrics: dict[str, dict[str, Metric]] = {}
    samples: dict[str, int] = {}
    harness_tasks = [task for task in tasks if task != PERPLEXITY_TASK]
    if harness_tasks:
        # log-probabilities in FP32: in the model's bf16 a document's sum loses whole nats
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length,
                  softmax_dtype=torch.float32)
    for task in harness_tasks:
        specs = task_specs([task], data_dir)
        out = lm_eval.simple_evaluate(
            model=lm, tasks=specs, limit=limits.get(task), task_manager=_task_manager(specs), log_samples=False
        )
        for result in out["results"]:
            metrics[result] = _parse_results(out, result)
            samples[result] = int(out["n-samples"][result]["effective"])
    if PERPLEXITY_TASK in tasks:
        ppl = perplexity_scores(model, tokenizer, name=name, data_dir=data_dir, seq_len=seq_len,
                                batch_size=batch_size, max_windows=limits.get(PERPLEXITY_TASK))
        metrics.update(ppl.metrics)
        samples.update(ppl.samples)
    return TaskScores(model=name, metrics=metrics, samples=samples)


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
