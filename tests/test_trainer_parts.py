"""The trainer's building blocks: token-budget batching, the LR schedule, atomic checkpoints and the ledger."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_stream.drafter.batches import TokenBatcher, collate
from dflash_stream.drafter.shapes import ShapePlan
from dflash_stream.pipeline import checkpoint as ckpt
from dflash_stream.pipeline.trainer import WarmupCosine
from dflash_stream.store.segment import StoredSample


def _samples(lengths: list[int], start: int = 0, width: int = 8) -> list[StoredSample]:
    return [
        StoredSample(start + i, torch.arange(n) + 1, torch.ones(n, dtype=torch.bool), torch.randn(n, width).bfloat16())
        for i, n in enumerate(lengths)
    ]


def _batcher(batch_tokens: int, buckets: list[int]) -> TokenBatcher:
    return TokenBatcher(ShapePlan(buckets, batch_tokens, num_anchors=4, block_size=4))


def test_batches_respect_the_token_budget_padding_included():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 120, (200,), generator=gen).tolist()
    batcher = _batcher(256, [32, 64, 128])
    batcher.add("a", _samples(lengths[:90]))
    batcher.add("b", _samples(lengths[90:], start=90))
    seen = []
    while batch := batcher.next_batch():
        shape = batcher.shape(batch)
        assert len(batch) <= shape.rows and shape.rows * shape.length <= 256
        seen += [m.sample.sample_id for m in batch]
    assert sorted(seen) == list(range(200))


def test_an_oversized_sample_is_a_batch_of_its_own():
    batcher = _batcher(64, [32, 128])
    batcher.add("a", _samples([10, 100, 20]))
    sizes = []
    while batch := batcher.next_batch():
        sizes.append(sorted(m.length for m in batch))
    assert sizes == [[10, 20], [100]]


def test_full_batch_ready_only_when_more_samples_would_not_fit():
    batcher = _batcher(100, [10, 30])  # N x S: 5 x 10 (no dearer than 3 x 30), 3 x 30
    batcher.add("a", _samples([10, 10, 10]))
    assert not batcher.full_batch_ready()  # 3 of 5 rows: a later segment could fill it
    batcher.add("b", _samples([30] * 4, start=3))
    assert batcher.full_batch_ready()
    assert [m.segment_id for m in batcher.next_batch()] == ["b", "b", "b"]  # a full 30-token batch


def test_collate_pads_right_and_masks_padding():
    members = _batcher(1000, [8])
    members.add("a", _samples([3, 5]))
    batch = collate(members.next_batch(), torch.device("cpu"))
    assert batch["hidden_states"].shape == (2, 5, 8)
    assert batch["lengths"].tolist() == [3, 5]
    assert batch["loss_mask"].sum(1).tolist() == [3, 5]
    assert batch["input_ids"][0].tolist() == [1, 2, 3, 0, 0]
    assert torch.all(batch["hidden_states"][0, 3:] == 0)


def test_schedule_warms_up_decays_and_holds_its_floor_past_the_estimate():
    sched = WarmupCosine(total_steps=100, warmup_ratio=0.1)
    assert sched(0) == pytest.approx(0.1)
    assert sched(9) == pytest.approx(1.0)
    assert sched(55) == pytest.approx(0.5)
    assert sched(100) == pytest.approx(0.0)
    assert sched(150) == pytest.approx(0.0)  # not back up the cosine
    assert all(sched(s) >= sched(s + 1) for s in range(10, 200))
    sched.open_ended = True  # the data's size is unknown: past the estimate, assume half done
    assert sched(50) == pytest.approx(WarmupCosine(100, 0.1)(50))
    assert 0 < sched(400) == pytest.approx(WarmupCosine(800, 0.1)(400))


def _stage(tmp_path, step: int) -> None:
    staging = ckpt.begin(tmp_path, step)
    ckpt.save_torch({"step": step, "x": torch.arange(3)}, staging / "trainer_state.pt")


def test_checkpoint_is_invisible_until_complete_and_keeps_the_last_two(tmp_path):
    for step in (10, 20, 30):
        _stage(tmp_path, step)
        assert ckpt.checkpoint_step(ckpt.latest_checkpoint(tmp_path)) == step - 10
        ckpt.publish(tmp_path, step)
        assert ckpt.checkpoint_step(ckpt.latest_checkpoint(tmp_path)) == step
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step-20", "step-30"]
    state = ckpt.load_torch(ckpt.latest_checkpoint(tmp_path) / "trainer_state.pt")
    assert state["step"] == 30 and state["x"].tolist() == [0, 1, 2]


def test_a_renamed_checkpoint_without_its_marker_is_ignored_and_replaced(tmp_path):
    _stage(tmp_path, 5)
    ckpt.publish(tmp_path, 5)
    _stage(tmp_path, 9)
    ckpt.publish(tmp_path, 9)
    (tmp_path / "checkpoints" / "step-9" / ckpt.COMPLETE).unlink()  # crash before the marker
    assert ckpt.latest_checkpoint(tmp_path).name == "step-5"
    _stage(tmp_path, 9)
    ckpt.publish(tmp_path, 9)
    assert ckpt.latest_checkpoint(tmp_path).name == "step-9"


def test_ledger_files_after_the_resumed_checkpoint_are_dropped(tmp_path):
    for step in (4, 8, 12):
        ckpt.write_ledger(tmp_path, 1, step, [{"segment": f"s{step}", "epoch": 0, "sample_ids": [step]}])
    dropped = ckpt.drop_ledger_after(tmp_path, 1, 8)
    assert [p.name for p in dropped] == ["12.jsonl"]
    folder = ckpt.ledger_dir(tmp_path, 1)
    assert sorted(p.name for p in folder.iterdir()) == ["4.jsonl", "8.jsonl"]
    assert json.loads((folder / "8.jsonl").read_text()) == {"segment": "s8", "epoch": 0, "sample_ids": [8]}
