"""lm-eval tasks that run offline: the upstream task configs, fed from local data files.

Hub access is not always there. For the tasks in :data:`OFFLINE_TASKS`, :func:`task_specs` takes
lm-eval's own YAML config (so prompts, targets, metrics and aggregations are exactly upstream's)
and replaces only where the documents come from: a file under ``--data-dir`` read by
:mod:`quantkit.eval.tasks.documents`. Every other task name is passed to lm-eval unchanged.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from quantkit.eval.tasks.documents import read_lambada, read_wikitext_pages


@dataclass(frozen=True)
class OfflineTask:
    """An upstream lm-eval task (its YAML, relative to ``lm_eval/tasks``), the local file that
    holds its documents, and how to read them."""

    name: str
    upstream_yaml: str
    filename: str
    read: Callable[[Path], list[dict[str, str]]]


OFFLINE_TASKS: dict[str, OfflineTask] = {
    task.name: task
    for task in (
        OfflineTask("lambada_openai", "lambada/lambada_openai.yaml", "lambada_test.jsonl", read_lambada),
        OfflineTask("wikitext", "wikitext/wikitext.yaml", "wiki.test.raw", read_wikitext_pages),
    )
}


def find_data_file(data_dir: Path, filename: str) -> Path:
    """The file called ``filename`` in ``data_dir`` or any folder below it (first in sorted order)."""
    data_dir = Path(data_dir)
    found = sorted(data_dir.rglob(filename))
    if not found:
        raise FileNotFoundError(f"no {filename} under {data_dir}")
    return found[0]


def _dataset_dict(*, docs: list[dict[str, str]], split: str, **_task_metadata: Any):
    """lm-eval's ``custom_dataset`` hook: the documents as the one split the task evaluates.
    lm-eval calls it with the task's metadata as keyword arguments, which it does not need."""
    import datasets

    return datasets.DatasetDict({split: datasets.Dataset.from_list(docs)})


def upstream_config(name: str) -> dict[str, Any]:
    """lm-eval's own config of offline-capable task ``name``, as its YAML defines it (functions resolved)."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    path = Path(lm_eval.tasks.__file__).parent / OFFLINE_TASKS[name].upstream_yaml
    return dict(load_yaml(path, resolve_func=True))


def offline_task_config(name: str, data_dir: Path) -> dict[str, Any]:
    """lm-eval's config dict for task ``name`` with its documents read from ``data_dir``.

    Everything but the data source is the upstream YAML (functions resolved); only the evaluated
    split (``test_split``) exists, so few-shot or validation splits are dropped.
    """
    task = OFFLINE_TASKS[name]
    path = find_data_file(data_dir, task.filename)
    config = upstream_config(name)
    split = config["test_split"]
    config.update(
        dataset_path=str(path),
        dataset_name=None,
        dataset_kwargs=None,
        custom_dataset=partial(_dataset_dict, docs=task.read(path), split=split),
        training_split=None,
        validation_split=None,
    )
    return config


def task_specs(names: Sequence[str], data_dir: Path | None) -> list[str | dict[str, Any]]:
    """What to hand ``lm_eval.simple_evaluate(tasks=...)`` for ``names``: with a ``data_dir``, the
    config dict of each offline-capable task; every other name (or all, without one) as is."""
    return [
        offline_task_config(name, data_dir)
        if data_dir is not None and name in OFFLINE_TASKS
        else name
        for name in names
    ]
