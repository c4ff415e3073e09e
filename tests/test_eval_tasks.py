"""Offline task definitions: upstream configs with local documents, read like the hub datasets."""
from __future__ import annotations

import pytest
from test_eval_fixtures import LAMBADA_TEXTS, SHARED_DATA, write_data_dir

pytest.importorskip("lm_eval")
from quantkit.eval.tasks import OFFLINE_TASKS, find_data_file, offline_task_config, task_specs, upstream_config  # noqa: E402
from quantkit.eval.tasks.documents import read_lambada, read_wikitext_lines, read_wikitext_pages  # noqa: E402

DATA_FIELDS = {"dataset_path", "dataset_name", "dataset_kwargs", "custom_dataset", "training_split", "validation_split"}


@pytest.mark.parametrize("name", sorted(OFFLINE_TASKS))
def test_offline_config_is_upstream_but_for_the_data_source(name, tmp_path):
    data = write_data_dir(tmp_path)
    upstream = upstream_config(name)
    offline = offline_task_config(name, data)
    assert upstream["task"] == name
    assert {k: v for k, v in offline.items() if k not in DATA_FIELDS} == {
        k: v for k, v in upstream.items() if k not in DATA_FIELDS
    }
    docs = offline["custom_dataset"](version=1.0)[upstream["test_split"]]
    assert list(docs) == OFFLINE_TASKS[name].read(find_data_file(data, OFFLINE_TASKS[name].filename))


def test_task_specs_keep_other_tasks_and_online_names(tmp_path):
    data = write_data_dir(tmp_path)
    specs = task_specs(["lambada_openai", "hellaswag"], data)
    assert isinstance(specs[0], dict) and specs[0]["task"] == "lambada_openai"
    assert specs[1] == "hellaswag"
    assert task_specs(["lambada_openai", "wikitext"], None) == ["lambada_openai", "wikitext"]


def test_find_data_file_searches_below_and_names_what_is_missing(tmp_path):
    data = write_data_dir(tmp_path)
    assert find_data_file(data, "wiki.test.raw") == data / "wikitext-2-raw" / "wiki.test.raw"
    with pytest.raises(FileNotFoundError, match="lambada_test.jsonl"):
        find_data_file(tmp_path / "wikitext-2-raw", "lambada_test.jsonl")


def test_wikitext_pages_split_at_level_one_headings(tmp_path):
    raw = " \n = A = \n \n a @-@ b . \n = = Sub = = \n x \n = B = \n y \n"
    (tmp_path / "wiki.test.raw").write_text(raw)
    pages = [p["page"] for p in read_wikitext_pages(tmp_path / "wiki.test.raw")]
    # the leading blank line is dropped; sub-headings stay inside; the final "" line joins the last page
    assert pages == [" = A = \n \n a @-@ b . \n = = Sub = = \n x ", " = B = \n y \n"]


def test_wikitext_lines_are_the_line_level_dataset_rows(tmp_path):
    (tmp_path / "wiki.test.raw").write_text(" \n = A = \n \n text . \n")
    assert read_wikitext_lines(tmp_path / "wiki.test.raw") == ["", " = A = \n", "", " text . \n"]


def test_lambada_reads_every_record(tmp_path):
    data = write_data_dir(tmp_path)
    assert read_lambada(find_data_file(data, "lambada_test.jsonl")) == [{"text": t} for t in LAMBADA_TEXTS]


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared/data is not beside the checkout")
def test_official_files_give_the_hub_datasets_record_counts():
    lambada = read_lambada(find_data_file(SHARED_DATA, "lambada_test.jsonl"))
    raw = find_data_file(SHARED_DATA, "wiki.test.raw")
    pages = read_wikitext_pages(raw)
    # EleutherAI/lambada_openai test: 5153; EleutherAI/wikitext_document_level 2-raw test: 62 pages;
    # wikitext-2-raw-v1 test: 4358 rows
    assert len(lambada) == 5153
    assert len(pages) == 62 and pages[0]["page"].startswith(" = Robert Boulter = \n")
    assert "\n".join(p["page"] for p in pages) == raw.read_text(encoding="utf-8").split("\n", 1)[1]
    assert len(read_wikitext_lines(raw)) == 4358
