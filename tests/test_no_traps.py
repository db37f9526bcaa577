"""No traps for a new user: a failed run does not lock out the corrected rerun, a refused store says what
differs in words, and `train` on an empty store says whether an extractor is alive and can give up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflash_stream.cli import main
from dflash_stream.config import config_from_dict
from dflash_stream.pipeline import trainer, waiting
from dflash_stream.pipeline.common import open_store
from dflash_stream.store import FingerprintMismatch

LAYERS, HIDDEN = [1, 3, 5], 64


def config_tree(tmp: Path, target_dir: Path, sources: list[dict]) -> dict:
    return {
        "output_dir": str(tmp / "out"),
        "target": {"model": str(target_dir), "layer_ids": LAYERS, "device": "cpu"},
        "data": {"sources": sources, "max_length": 128},
        "store": {"path": str(tmp / "store"), "budget": "8MiB", "segment_bytes": 60_000},
        "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 0},
        "train": {"batch_tokens": 256, "num_anchors": 8},
    }


def test_store_of_other_data_names_the_sources_in_words(tmp_path):
    import numpy as np
    import torch

    from dflash_stream.store import Sample

    first = config_from_dict(config_tree(tmp_path, tmp_path, [{"path": "a.jsonl"}]))
    store = open_store(first, LAYERS, HIDDEN)
    store.writer("w").write([Sample(1, np.arange(4, dtype=np.int32), np.ones(4, dtype=bool),
                                    torch.zeros(4, len(LAYERS) * HIDDEN, dtype=torch.bfloat16))])
    second = config_from_dict(config_tree(tmp_path, tmp_path, [{"path": "a.jsonl"}, {"path": "b.jsonl", "limit": 5}]))
    with pytest.raises(FingerprintMismatch) as err:
        open_store(second, LAYERS, HIDDEN)
    assert "data sources (data.sources) differ: stored ['a.jsonl'], this run ['a.jsonl', 'b.jsonl limit=5']" in str(
        err.value)
    assert "data_spec" not in str(err.value)


def test_failed_run_leaves_no_store_that_refuses_the_corrected_rerun(tmp_path, tiny_target_dir, capsys):
    """The data fail only after the store was created (a source that is not json/jsonl/parquet); a rerun with
    other data finds the same data error, not a fingerprint refusal, and the empty store takes its config."""
    for name in ("one.txt", "two.txt"):
        (tmp_path / name).write_text("not a dataset\n")
    for name in ("one.txt", "two.txt"):
        tree = config_tree(tmp_path, tiny_target_dir, [{"path": str(tmp_path / name)}])
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(tree))
        assert main(["run", "--config", str(tmp_path / "run.yaml")]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"'{tmp_path / name}' must be .json/.jsonl/.parquet" in err and "made by another config" not in err
    manifest = json.loads((tmp_path / "store" / "store.json").read_text())
    assert manifest["fingerprint"]["data_spec_detail"]["sources"] == [str(tmp_path / "two.txt")]


@pytest.fixture
def empty_store_config(tmp_path, tiny_target_dir, monkeypatch) -> Path:
    """A store that `extract` created and has not written to yet, and a config for `train` on it."""
    monkeypatch.setattr(waiting, "REMIND_SECONDS", 0.3)
    monkeypatch.setattr(trainer, "WAIT_POLL_SECONDS", 0.1)
    tree = config_tree(tmp_path, tiny_target_dir, [{"path": str(tmp_path / "data.jsonl")}])
    open_store(config_from_dict(tree), LAYERS, HIDDEN).set_expected_writers(1)
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(tree))
    return tmp_path / "train.yaml"


def test_train_on_an_empty_store_reminds_and_times_out(empty_store_config, capsys):
    assert main(["train", "--config", str(empty_store_config), "--wait-timeout", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "waiting for data" in err and "still waiting for data after" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("dflash-stream: error: no data came within --wait-timeout 1.5 s")
    assert "no extractor has started on this store" in last


def test_train_says_an_extractor_is_alive(empty_store_config, tmp_path, capsys):
    from dflash_stream.store import Store

    store = Store.attach(tmp_path / "store")
    with store.heartbeat("extractor-0"):  # as `extract` does from before it loads the target
        assert main(["train", "--config", str(empty_store_config), "--wait-timeout", "1"]) == 2
    assert "extractor-0 alive (heartbeat" in capsys.readouterr().err.strip().splitlines()[-1]
    assert store.heartbeats() == {}  # a writer that stopped leaves no heartbeat behind


def test_train_without_a_store_says_to_start_extract_first(tmp_path, tiny_target_dir, capsys):
    tree = config_tree(tmp_path, tiny_target_dir, [{"path": "data.jsonl"}])
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(tree))
    assert main(["train", "--config", str(tmp_path / "train.yaml")]) == 2
    assert "start `dflash-stream extract` with this config first" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()
