"""The trainer's parts on a real store: the reader asked with a timeout, the data position saved and loaded,
the stop request; and the run directory's one rule for the latest complete checkpoint, which resume, the
audit, `status` and `export` all read."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import torch

from dflash_stream.drafter.batches import TokenBatcher
from dflash_stream.drafter.commands import _checkpoint_dir
from dflash_stream.drafter.shapes import ShapePlan
from dflash_stream.observe.status import _checkpoints
from dflash_stream.pipeline import checkpoint as ckpt
from dflash_stream.pipeline.audit import audit_run
from dflash_stream.pipeline.position import DataPosition
from dflash_stream.pipeline.rollback import ReleaseJournal
from dflash_stream.pipeline.signals import StopRequest
from dflash_stream.rundir import RunDir, write_atomic
from dflash_stream.store import Sample, SegmentReader, Store

WIDTH = 16


def _store(path: Path) -> Store:
    return Store.open(path, budget=10**8, codec="none", reuse=1, fingerprint={"layer_ids": [1], "hidden_size": WIDTH},
                      max_segment_raw_bytes=64 * (2 * WIDTH + 5) + 24)


def _samples(ids: list[int], length: int = 6) -> list[Sample]:
    return [Sample(i, np.arange(length, dtype=np.int32), np.ones(length, dtype=bool),
                   torch.full((length, WIDTH), float(i)).bfloat16()) for i in ids]


def test_reader_next_waits_at_most_the_timeout_then_returns_the_segment_and_the_end(tmp_path):
    store = _store(tmp_path / "store")
    store.set_expected_writers(1)
    writer = store.writer("w")
    reader = SegmentReader(store.consumer("c"), prefetch=1)
    try:
        assert reader.next(timeout=0) is None and reader.next(timeout=0.1) is None  # nothing written yet
        assert not reader.exhausted
        writer.write(_samples([1, 2]))
        claim, samples = reader.next(timeout=30)
        assert claim.sample_ids == (1, 2) and [s.sample_id for s in samples] == [1, 2]
        writer.finish()
        assert reader.next(timeout=30) is None and reader.exhausted
        assert reader.next(timeout=None) is None  # stays at the end without blocking
    finally:
        reader.close()


def test_data_position_round_trip_resumes_a_half_trained_segment_and_releases_a_finished_one(tmp_path):
    store = _store(tmp_path / "store")
    writer = store.writer("w")
    writer.write(_samples([1, 2]))
    writer.write(_samples([3, 4, 5]))
    journal = ReleaseJournal(tmp_path / "out", 0)
    position = DataPosition(store, "trainer-0", TokenBatcher(ShapePlan([4096], 10**6, num_anchors=4, block_size=4)),
                            journal)
    position.load_state_dict(DataPosition.EMPTY)
    for _ in range(2):
        claim = position.consumer.claim(timeout=1)
        position.add(claim, position.consumer.read(claim))
    batch = position.batcher.next_batch()  # all five samples, shortest (here: lowest id) first
    assert position.mark_trained(batch[:3]) == 0  # 1, 2 (the first segment, done) and 3
    assert position.finished_bytes() > 0
    state = position.state_dict()
    assert [r["segment_id"] for r in state["finished"]] == [batch[0].segment_id]
    assert [(r["claim"]["sample_ids"], r["trained"]) for r in state["partial"]] == [((3, 4, 5), [3])]

    # A restart: a new position from the saved state keeps only the untrained samples 4 and 5.
    resumed = DataPosition(store, "trainer-0", TokenBatcher(ShapePlan([4096], 10**6, num_anchors=4, block_size=4)),
                           journal)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [m.sample.sample_id for m in resumed.batcher.next_batch()] == [4, 5]
    segments = store.status()["segments"]
    assert segments["released"] == 1 and segments["claimed"] == 1 and segments["ready"] == 0


def test_stop_request_catches_sigterm_only_while_entered():
    stop = StopRequest()
    previous = signal.getsignal(signal.SIGTERM)
    with stop:
        os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested and stop.name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is previous


def _checkpoint(run: RunDir, step: int, complete: bool) -> None:
    run.checkpoint(step).mkdir(parents=True)
    (run.checkpoint(step) / "drafter_spec.json").write_text("{}")
    if complete:
        (run.checkpoint(step) / ckpt.COMPLETE).write_text(f"{step}\n")


def test_resume_audit_status_and_export_agree_on_the_latest_complete_checkpoint(tmp_path):
    run = RunDir(tmp_path / "out")
    _checkpoint(run, 3, complete=True)
    _checkpoint(run, 12, complete=True)
    _checkpoint(run, 20, complete=False)  # crashed before its marker
    run.staging(25).mkdir()
    run.data.mkdir()
    write_atomic(run.data_report(0), json.dumps({"kept": 3, "sample_ids": [1, 2, 3]}))
    for step, ids in ((3, [1]), (12, [2, 3]), (20, [1, 2, 3])):  # ledger 20 belongs to the crashed one
        ckpt.write_ledger(run.root, 0, step, [{"segment": "s", "epoch": 0, "sample_ids": ids}])

    latest = run.latest_checkpoint()
    assert latest == run.checkpoint(12) == ckpt.latest_checkpoint(run.root)
    assert _checkpoint_dir(run.root) == latest
    assert _checkpoints(run.root) == {"count": 2, "latest_step": 12, "latest": str(latest),
                                      "written": 0, "stall_s": 0, "write_s": 0, "last_bytes": None}
    assert audit_run(run.root)["passes"][0] == {"epoch": 0, "expected": 3, "trained": 3, "missing": 0,
                                                "duplicated": 0, "unexpected": 0, "redone": 0}


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    write_atomic(path, "old")
    write_atomic(path, "new", durable=True)
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_write_then_rename_has_one_home():
    """Every file replaced atomically goes through `rundir.write_atomic` (checkpoint folders and the store's
    lifecycle moves are renames of their own, not file writes). The vLLM connector runs inside vLLM's own
    environment and imports no part of ours, so it renames its spool files itself."""
    package = Path(__file__).resolve().parent.parent / "dflash_stream"
    users = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py")
                   if "os.replace(" in p.read_text() or "tmp.replace(" in p.read_text())
    assert users == ["rundir.py", "vllm_plugin/dflash_vllm_connector.py"]
