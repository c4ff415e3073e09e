"""Readers that turn the official local data files into the documents lm-eval's tasks expect.

Each reader reproduces the Hugging Face dataset that the upstream task loads, record for record:

* ``lambada_openai`` loads ``EleutherAI/lambada_openai`` (``default``): one ``{"text": ...}`` per
  line of OpenAI's ``lambada_test.jsonl`` (5153 records).
* ``wikitext`` loads ``EleutherAI/wikitext_document_level`` (``wikitext-2-raw-v1``): the raw
  ``wiki.test.raw`` cut into Wikipedia articles at each level-1 heading ``" = Title = "``
  (62 test documents), each ``{"page": ...}`` with its lines joined by ``"\\n"``.
"""
from __future__ import annotations

import json
from pathlib import Path


def read_lambada(path: Path) -> list[dict[str, str]]:
    """The LAMBADA (OpenAI) records of a JSON-lines file: ``[{"text": passage}, ...]``, in order."""
    with open(path, encoding="utf-8") as f:
        return [{"text": json.loads(line)["text"]} for line in f if line.strip()]


def _is_article_title(line: str) -> bool:
    """Whether a raw WikiText line is a level-1 heading (``" = Title = "``), which starts an article."""
    collapsed = line.replace("= = =", "===").replace("= =", "==").strip()
    return collapsed.startswith("= ") and collapsed.endswith(" =")


def read_wikitext_pages(path: Path) -> list[dict[str, str]]:
    """The WikiText articles of a raw file (``wiki.test.raw``): ``[{"page": article text}, ...]``.

    Same splitting as the ``EleutherAI/wikitext_document_level`` builder: an article runs from one
    level-1 heading line up to (not including) the next, lines joined with ``"\\n"``; text before
    the first heading that is only whitespace is dropped, and the last article is always kept.
    """
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    pages: list[dict[str, str]] = []
    current: list[str] = []
    for line in lines:
        if _is_article_title(line):
            page = "\n".join(current)
            if page.strip():
                pages.append({"page": page})
            current = []
        current.append(line)
    pages.append({"page": "\n".join(current)})
    return pages


def read_wikitext_lines(path: Path) -> list[str]:
    """The rows of the line-level ``wikitext`` dataset for a raw file: each line with its ``"\\n"``,
    blank lines as ``""`` (what ``load_dataset("wikitext", "wikitext-2-raw-v1")["text"]`` holds)."""
    with open(path, encoding="utf-8", newline="\n") as f:
        return [line if line.strip() else "" for line in f]
