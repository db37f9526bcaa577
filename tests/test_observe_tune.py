"""`tune` on a real (tiny, random-weight) target and real chat rows; the buffer recommendation by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from dflash_stream.config import load_config
from dflash_stream.observe.plan import build_plan
from dflash_stream.observe.tune import HEADROOM, MIB, recommend, run_tune

TOPICS = ["binary search", "quicksort", "hash maps", "decorators", "recursion", "SQL joins", "git rebase", "caching"]


@pytest.fixture
def chat_rows(tmp_path: Path) -> Path:
    path = tmp_path / "chat.jsonl"
    with path.open("w") as f:
        for i, topic in enumerate(TOPICS * 2):
            answer = " ".join(f"Step {k}: apply {topic} to a list of {7 * k + i} items and check the result."
                              for k in range(4 + i % 5))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Explain {topic} ({i})."},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


@pytest.mark.slow
def test_tune_measures_and_plan_uses_it(tiny_target_dir: Path, chat_rows: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(out),
        "target": {"model": str(tiny_target_dir), "num_capture_layers": 2, "device": "cpu"},
        "data": {"sources": [{"path": str(chat_rows)}], "max_length": 512},
        "store": {"path": str(tmp_path / "store"), "budget": "1GiB", "segment_bytes": "1MiB"},
        "drafter": {"num_layers": 1},
        "train": {"num_anchors": 8, "batch_tokens": 1024},
    }))
    cfg = load_config(config)
    result = run_tune(cfg, num_samples=6, train_steps=2)

    saved = json.loads((out / "tune.json").read_text())
    assert saved["layer_ids"] == [1, 3] and saved["hidden_size"] == 64
    assert saved["samples"] == 6 and saved["mean_tokens"] == pytest.approx(saved["tokens"] / 6)
    assert set(saved["compression"]) == {"lossless", "fp8", "none"}
    # fp8 halves the bytes before entropy coding; lossless keeps all 16 bits.
    assert saved["compression"]["fp8"] > saved["compression"]["lossless"] > 1.0
    assert saved["extract_tok_s"] > 0 and saved["train_tok_s"] > 0
    assert saved["recommendation"] == result["recommendation"]
    assert "recommended: --store.budget=" in capsys.readouterr().out
    # tune's scratch data report stays out of the run's own data folder.
    assert not (out / "data").exists()

    plan = build_plan(cfg)
    assert plan["volume"]["ratio"] == pytest.approx(saved["compression"]["lossless"])
    assert plan["data"]["mean_tokens"] == pytest.approx(saved["mean_tokens"])
    assert plan["time"]["phases"]["train"]["tok_s_per_process"] == pytest.approx(saved["train_tok_s"])


def test_recommend_by_hand() -> None:
    # 1,000 training tok/s at 2,000 raw / 1,000 stored bytes per token: 30 s of training = 60 MB raw -> 57 MiB.
    rec = recommend(free_bytes=100 * 2**30, stored_bytes_per_token=1000.0, raw_bytes_per_token=2000,
                    train_tok_s=1000.0, extract_tok_s=2000.0, min_segment_raw=MIB)
    assert rec["segment_bytes"] == 57 * MIB
    assert rec["segment_stored_bytes"] == pytest.approx(57 * MIB / 2)
    budgets = [o["budget_bytes"] for o in rec["options"]]
    # Two minutes of training is 120 MB stored, just above four segments (119.5 MB).
    assert budgets[0] == math.ceil(120e6 / MIB) * MIB
    assert budgets[2] == math.ceil(600e6 / MIB) * MIB
    assert rec["budget_bytes"] == budgets[2]  # ten minutes
    assert rec["bottleneck"] == "train"

    small = recommend(free_bytes=10**9, stored_bytes_per_token=1000.0, raw_bytes_per_token=2000,
                      train_tok_s=1000.0, extract_tok_s=500.0, min_segment_raw=MIB)
    assert [o["fits"] for o in small["options"]] == [b <= HEADROOM * 10**9 for b in budgets]
    assert small["budget_bytes"] == budgets[1]  # the largest that fits in half the free disk
    assert small["bottleneck"] == "extract"
