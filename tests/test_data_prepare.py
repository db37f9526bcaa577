"""prepare_shard over the shipped demo data: counts by reason, the report, ids, sharding, weights, truncation."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest

from dflash_stream.config import ConfigError, config_from_dict
from dflash_stream.data import prepare_shard, token_budget_batches
from dflash_stream.data.sources import count_row_copies, plan_rows, stable_hash

DEMO = Path(str(files("dflash_stream") / "demo_data"))
DEMO_FILES = ["sharegpt_chats.jsonl", "openai_messages.jsonl", "alpaca_tasks.json", "prompts_only.jsonl",
              "mixed_formats.jsonl"]
MALFORMED = {"bad_tool_call": 1, "empty_conversation": 1, "empty_turn": 1, "missing_role": 1, "no_user_turn": 1,
             "non_string_content": 1, "too_long": 1, "unknown_format": 1, "unknown_role": 1}


@pytest.fixture(scope="module")
def tokenizer(demo_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_tokenizer_dir)


def make_cfg(tmp_path, sources=None, **data):
    sources = sources if sources is not None else [{"path": str(DEMO / name)} for name in DEMO_FILES]
    return config_from_dict({
        "output_dir": str(tmp_path / "out"),
        "data": {"sources": sources, **data},
        "store": {"path": str(tmp_path / "store"), "budget": "1GB"},
    })


def test_demo_data_counts_every_skipped_row_by_reason(tmp_path, tokenizer):
    cfg = make_cfg(tmp_path)
    samples, report = prepare_shard(cfg, tokenizer, 0, 1)
    assert report.rows == 35 + 33 + 30 + 60 + 24
    assert dict(report.skipped) == {**MALFORMED, "no_assistant_turn": 60 + 2}
    assert report.kept == len(samples) == report.rows - sum(report.skipped.values())
    assert report.examples["empty_turn"] == ["mixed_formats.jsonl#17"]
    written = json.loads((tmp_path / "out" / "data" / "report-0.json").read_text())
    assert written["sample_ids"] == [s.sample_id for s in samples]
    assert written["skipped"]["no_assistant_turn"] == 62
    for sample in samples:
        assert sample.input_ids.dtype == np.int32 and sample.loss_mask.dtype == np.bool_
        assert int(sample.loss_mask.sum()) >= cfg.min_supervised_tokens
        assert len(sample.input_ids) <= cfg.data.max_length


def test_regeneration_keeps_prompt_only_rows_as_prompts(tmp_path, tokenizer):
    samples, report = prepare_shard(make_cfg(tmp_path, regenerate=True), tokenizer, 0, 1)
    assert dict(report.skipped) == MALFORMED
    assert all(s.needs_response and not s.loss_mask.any() for s in samples)
    assert tokenizer.decode(samples[0].input_ids).endswith("<|im_start|>assistant\n")
    done = samples[0].with_response([5, 6, 7], max_length=samples[0].num_tokens + 2)
    assert done.input_ids[-2:].tolist() == [5, 6] and done.loss_mask.sum() == 2 and not done.needs_response


def test_truncation_and_filter_counts(tmp_path, tokenizer):
    rows = tmp_path / "rows.jsonl"
    long_answer = " ".join(["word"] * 200)
    rows.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "short question", "response": long_answer},          # kept, truncated
        {"prompt": " ".join(["ctx"] * 200), "response": long_answer},    # answer starts past max_length
        {"prompt": "q", "response": "ok"},                               # too few supervised tokens
    ]))
    cfg = make_cfg(tmp_path, [{"path": str(rows)}], max_length=96, min_supervised_tokens=8)
    samples, report = prepare_shard(cfg, tokenizer, 0, 1)
    assert report.truncated == 1 and len(samples) == 1 and samples[0].num_tokens == 96
    assert dict(report.skipped) == {"too_long": 1, "too_few_supervised_tokens": 1}


def test_a_dataset_without_usable_rows_is_one_clear_error(tmp_path, tokenizer):
    rows = tmp_path / "bad.jsonl"
    rows.write_text('{"prompt": "no answer"}\n{"text": "nothing"}\n')
    with pytest.raises(ConfigError, match=r"data.sources: no usable row .*no_assistant_turn.*unknown_format"):
        prepare_shard(make_cfg(tmp_path, [{"path": str(rows)}]), tokenizer, 0, 1)


def test_unreadable_sources_name_the_key(tmp_path, tokenizer, monkeypatch):
    import datasets
    import huggingface_hub.constants

    # These machines have no hub access: fail at once instead of after the client's retries.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"data.sources\[0\].path: cannot load 'no/such-dataset'"):
        prepare_shard(make_cfg(tmp_path, [{"path": "no/such-dataset"}]), tokenizer, 0, 1)
    odd = tmp_path / "rows.csv"
    odd.write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"data.sources\[0\].path: .* must be .json/.jsonl/.parquet"):
        prepare_shard(make_cfg(tmp_path, [{"path": str(odd)}]), tokenizer, 0, 1)


def test_parquet_and_limit(tmp_path, tokenizer):
    import datasets

    rows = [{"prompt": f"Question {i}?", "response": f"Answer number {i}, " + "explained at length. " * 8}
            for i in range(10)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    cfg = make_cfg(tmp_path, [{"path": str(tmp_path / "rows.parquet"), "limit": 4}])
    samples, report = prepare_shard(cfg, tokenizer, 0, 1)
    assert report.rows == 4 and len(samples) == 4


def test_shards_partition_the_rows_and_ids_are_stable(tmp_path, tokenizer):
    cfg = make_cfg(tmp_path)
    whole = [s.sample_id for s in prepare_shard(cfg, tokenizer, 0, 1)[0]]
    shards = [[s.sample_id for s in prepare_shard(cfg, tokenizer, i, 3)[0]] for i in range(3)]
    merged = [i for shard in shards for i in shard]
    assert len(merged) == len(set(merged)) and set(merged) == set(whole)
    assert [s.sample_id for s in prepare_shard(cfg, tokenizer, 0, 1)[0]] == whole
    # Ids hash the file name and row: moving the data elsewhere keeps them.
    assert stable_hash("sharegpt_chats.jsonl", 0) in whole


def test_weights_copy_rows_with_distinct_ids(tmp_path):
    cfg = make_cfg(tmp_path, [{"path": "a", "weight": 2.0}, {"path": "b", "weight": 0.5},
                              {"path": "c", "weight": 1.5}])
    refs = plan_rows(cfg.data, [100, 400, 400])
    per_source = [sum(r.source == s for r in refs) for s in range(3)]
    assert per_source[0] == 200 and 150 < per_source[1] < 250 and 550 < per_source[2] < 650
    assert len({r.sample_id for r in refs}) == len(refs)
    assert plan_rows(cfg.data, [100, 400, 400]) == refs
    # plan's count takes a shortcut for whole weights; it must count what the plan makes.
    assert count_row_copies(cfg.data, [100, 400, 400]) == len(refs)


def test_duplicate_source_names_are_refused(tmp_path):
    cfg = make_cfg(tmp_path, [{"path": "x/data.jsonl"}, {"path": "x/data.jsonl"}])
    with pytest.raises(ConfigError, match=r"data.sources\[1\].name"):
        plan_rows(cfg.data, [1, 1])
    with pytest.raises(ConfigError, match=r"data.sources\[1\].name"):
        count_row_copies(cfg.data, [1, 1])


def test_token_budget_batches_count_padding():
    lengths = [5, 40, 12, 40, 7, 100, 33, 8, 8, 8]
    batches = token_budget_batches(lengths, budget=80)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 80
    assert batches[0] == [5]  # longer than the budget: a batch of its own, never dropped
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat, reverse=True)


def _strip_none(value):
    """A row as the datasets loader would hold it, minus the None columns it adds for absent keys."""
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value


@pytest.mark.parametrize("name", DEMO_FILES)
def test_local_json_rows_are_the_datasets_loaders_rows_in_the_same_order(name):
    """Sample ids hash row positions: reading local JSON ourselves must keep every row where it was."""
    import datasets

    from dflash_stream.config import SourceConfig
    from dflash_stream.data.sources import load_source

    rows, malformed = load_source(SourceConfig(path=str(DEMO / name)), 0)
    reference = datasets.load_dataset("json", data_files=[str(DEMO / name)], split="train")
    assert malformed == [] and len(rows) == len(reference)
    assert [_strip_none(rows[i]) for i in range(len(rows))] == [_strip_none(r) for r in reference]


def test_malformed_lines_are_counted_with_file_and_line_never_fatal(tmp_path, tokenizer):
    good = [{"prompt": f"Say the number {i} in words, please.", "response": f"The number is {i}. " * 12}
            for i in range(6)]
    lines = [json.dumps(good[0]), "{not json", json.dumps(good[1]), "", json.dumps([1, 2]), "42",
             json.dumps(good[2]), '"a string"', json.dumps(good[3]), "\xff\xfe garbage", json.dumps(good[4])]
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n", encoding="latin-1")
    (tmp_path / "tasks.json").write_text(json.dumps([good[5], "not an object", good[5]]))
    sources = [{"path": str(tmp_path / "rows.jsonl")}, {"path": str(tmp_path / "tasks.json")}]
    samples, report = prepare_shard(make_cfg(tmp_path, sources), tokenizer, 0, 1)
    assert report.skipped["malformed_line"] == 6
    assert report.examples["malformed_line"] == ["rows.jsonl#2", "rows.jsonl#5", "rows.jsonl#6", "rows.jsonl#8",
                                                 "rows.jsonl#10"]  # 1-based line numbers, blank lines skipped
    written = json.loads((tmp_path / "out" / "data" / "report-0.json").read_text())
    assert written["skipped"]["malformed_line"] == 6
    assert len(samples) == report.kept == 7 == report.rows - sum(report.skipped.values())
    # Two shards: the rows split between them, the malformed lines are counted once (by shard 0).
    reports = [prepare_shard(make_cfg(tmp_path, sources), tokenizer, i, 2)[1] for i in range(2)]
    assert [r.skipped["malformed_line"] for r in reports] == [6, 0]
    assert sum(r.kept for r in reports) == 7
    limited = prepare_shard(make_cfg(tmp_path, [{**sources[0], "limit": 2}]), tokenizer, 0, 1)[1]
    assert limited.kept == 2


@pytest.mark.parametrize("content", ["", "\n\n", "[]"])
def test_an_empty_source_says_no_rows_in_file(tmp_path, tokenizer, content):
    path = tmp_path / ("empty.json" if content == "[]" else "empty.jsonl")
    path.write_text(content)
    with pytest.raises(ConfigError, match=rf"data.sources\[0\].path: no rows in {path}$"):
        prepare_shard(make_cfg(tmp_path, [{"path": str(path)}]), tokenizer, 0, 1)


def test_keeping_very_few_samples_warns(tmp_path, tokenizer, caplog):
    rows = [{"prompt": f"Question {i}?", "response": "A long enough answer to keep this row. " * 4} for i in range(3)]
    rows += [{"text": "no known shape"}] * 40
    (tmp_path / "few.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import logging

    logger = logging.getLogger("dflash_stream")
    logger.addHandler(caplog.handler)  # setup_logging (run by other tests) stops propagation to the root
    try:
        _, report = prepare_shard(make_cfg(tmp_path, [{"path": str(tmp_path / "few.jsonl")}]), tokenizer, 0, 1)
    finally:
        logger.removeHandler(caplog.handler)
    assert report.kept == 3
    warning = {r.getMessage() for r in caplog.records if r.levelname == "WARNING"}
    assert warning == {"data shard 0 keeps only 3 of 43 rows (skipped: unknown_format 40); check data.format "
                       "and data.max_length, and see data/report-0.json for which rows were skipped and why"}
