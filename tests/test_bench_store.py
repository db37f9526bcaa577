"""`bench store --rate` and `--metadata` report what the issue names, and the rate run stays within its budget."""

from __future__ import annotations

import argparse
import json

import pytest

from dflash_stream.bench.store import synthetic_states
from dflash_stream.bench.store_metadata import run_metadata
from dflash_stream.bench.store_rate import run_rate


def test_metadata_bench_reports_each_step_early_and_late(capsys) -> None:
    assert run_metadata(40, as_json=True) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["segments"] == 40 and report["kept_records"] == {"info": 0, "done": 0}
    assert report["ledger"]["files"] == 1 and 0 < report["ledger"]["bytes_per_segment"] < 512
    assert report["stored_sample_ids"]["samples"] == 40 and max(report["largest_dir_entries"].values()) <= 1
    for step in ("publish", "claim", "release"):
        assert report[step]["first"]["median_ms"] > 0 and report[step]["last"]["median_ms"] > 0
        assert report["aged_vs_fresh"]["aged_over_fresh"][step] > 0


@pytest.mark.slow
def test_rate_bench_sustains_a_low_rate_within_the_budget(capsys) -> None:
    data, source = synthetic_states(512)
    args = argparse.Namespace(rate=0.02, writers=1, readers=1, seconds=3.0, budget_segments=3, json=True)
    assert run_rate(args, data, source) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("sustained_gb_s", "cores", "per_core_gb_s", "writer_encode_wait_fraction", "peak_store_bytes",
                "budget_bytes", "segments"):
        assert key in report
    assert 0 < report["peak_store_bytes"] <= report["budget_bytes"]
    assert report["segments"] >= 2 and report["segments_read"] == report["segments"]
