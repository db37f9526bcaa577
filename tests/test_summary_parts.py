"""summary.json merges every rank's part, even a part written after trainer 0 finished (issue 26, item 5).

An extractor stays to re-extract damaged segments until trainer 0's part exists, so it finishes last; a summary
merged at once read its figures as zeros (extract 240.7 s in the part, 0.0 in summary.json and `status`).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from dflash_stream.observe.status import collect_status, render_status
from dflash_stream.pipeline.run import _complete_summary, write_summary
from dflash_stream.rundir import RunDir

EXPECTED = ["extractor-0", "trainer-0"]
EXTRACTOR = {"role": "extractor", "index": 0, "extract_seconds": 240.7, "backpressure_seconds": 235.8,
             "stall_seconds": 12.5}
TRAINER = {"role": "trainer", "index": 0, "samples_trained": 64, "steps": 16, "final_loss": 1.5,
           "train_seconds": 230.0, "data_wait_seconds": 3.0, "checkpoints": 9, "checkpoint_stall_seconds": 4.5,
           "checkpoint_write_seconds": 3.9}


class _Store:
    def published(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(sample_ids=list(range(64)), num_tokens=9000)]


def _cfg(out: Path) -> SimpleNamespace:
    return SimpleNamespace(output_dir=str(out), store=SimpleNamespace(budget=2**30))


def _write_part(out: Path, part: dict, written: float | None = None) -> None:
    path = RunDir(out).summary_part(part["role"], part["index"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**part, "written": time.time() if written is None else written}))


def test_summary_waits_for_the_extractor_that_finishes_last(tmp_path: Path) -> None:
    started = time.time()
    _write_part(tmp_path, TRAINER)
    late = threading.Timer(1.0, _write_part, (tmp_path, EXTRACTOR))  # the extractor leaves after trainer 0's part
    late.start()
    try:
        summary = write_summary(_cfg(tmp_path), _Store(), started, EXPECTED, wait_s=60.0)
    finally:
        late.join()
    assert summary["missing_parts"] == []
    assert (summary["extract_seconds"], summary["extractor_backpressure_seconds"]) == (240.7, 235.8)
    assert summary["extractor_forward_stall_seconds"] == 12.5
    assert (summary["samples_trained"], summary["steps"], summary["train_seconds"]) == (64, 16, 230.0)
    assert (summary["checkpoints"], summary["checkpoint_stall_seconds"], summary["checkpoint_write_seconds"]) == \
        (9, 4.5, 3.9)
    assert json.loads(RunDir(tmp_path).summary.read_text()) == summary


def test_a_part_that_never_came_is_named_and_added_when_it_comes(tmp_path: Path) -> None:
    started = time.time()
    _write_part(tmp_path, TRAINER)
    _write_part(tmp_path, {**EXTRACTOR, "extract_seconds": 999.0}, written=started - 3600)  # an earlier launch's
    summary = write_summary(_cfg(tmp_path), _Store(), started, EXPECTED, wait_s=0.3)
    assert summary["missing_parts"] == ["extractor-0"]
    assert summary["extract_seconds"] == 0.0  # neither the stale part's figure nor a silent zero: it is named
    status = collect_status(tmp_path)
    assert status["state"] == "finished" and "without the figures of extractor-0" in status["state_reason"]
    assert "missing_parts" in render_status(status) and "extractor-0" in render_status(status)

    _write_part(tmp_path, EXTRACTOR)  # the extractor finishes after the merge gave up waiting for it
    status = collect_status(tmp_path)
    assert status["summary"]["missing_parts"] == [] and status["summary"]["extract_seconds"] == 240.7
    assert "without the figures" not in status["state_reason"]
    _complete_summary(_cfg(tmp_path))  # what the late rank does itself
    on_disk = json.loads(RunDir(tmp_path).summary.read_text())
    assert on_disk["missing_parts"] == [] and on_disk["extractor_backpressure_seconds"] == 235.8
    assert on_disk["steps"] == 16 and on_disk["samples_extracted"] == 64
