"""The trainer's fixed family of batch shapes: buckets, the bucketed batcher, padding that leaves the loss and its
gradients unchanged, and the count of compiled graphs."""

from __future__ import annotations

import logging

import pytest
import torch

from dflash_stream.config import ConfigError, config_from_dict
from dflash_stream.drafter import DFlashDrafter, DrafterSpec, TargetHead, batches, dflash_loss
from dflash_stream.drafter.batches import TokenBatcher, collate
from dflash_stream.drafter.shapes import CompileWatch, ShapePlan, default_buckets
from dflash_stream.store.segment import StoredSample


def _samples(lengths: list[int], start: int = 0, width: int = 8, seed: int = 0) -> list[StoredSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3:] = True  # a prompt, then the supervised response
        out.append(StoredSample(start + i, torch.randint(1, 99, (n,), generator=g), mask,
                           torch.randn(n, width, generator=g)))
    return out


def small_spec(**kw) -> DrafterSpec:
    base = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6, vocab_size=100, block_size=4, mask_token_id=99,
                target_layer_ids=[0, 1], num_target_layers=4, max_position_embeddings=512)
    return DrafterSpec(**{**base, **kw})


def _cfg(**train) -> dict:
    return {"output_dir": "unused", "data": {"sources": [{"path": "unused.jsonl"}], "max_length": 3072},
            "store": {"path": "unused", "budget": "1GB"}, "train": train}


def test_default_buckets_end_at_max_length_and_stay_under_the_recompile_limit():
    assert default_buckets(3072) == [256, 384, 512, 768, 1024, 1536, 2048, 3072]
    assert default_buckets(384) == [64, 96, 128, 192, 256, 384]
    assert default_buckets(100) == [64, 96, 100]
    assert all(len(default_buckets(n)) <= 8 and default_buckets(n)[-1] == n for n in range(8, 5000, 37))


def test_plan_shapes_fit_the_budget_and_cost_no_more_than_the_longest_bucket():
    plan = ShapePlan(default_buckets(3072), batch_tokens=49152, num_anchors=512, block_size=16)
    top = plan.shapes[-1]
    assert (top.rows, top.length, top.blocks) == (16, 3072, 512)
    for shape in plan.shapes:
        assert shape.rows * shape.length <= 49152
        assert shape.blocks == min(512, shape.length - 1)  # the most any sample of that length can need
        assert shape.rows * (shape.length + 16 * shape.blocks) <= top.rows * (top.length + 16 * top.blocks)
    assert plan.bucket(1) == 0 and plan.bucket(256) == 0 and plan.bucket(257) == 1 and plan.bucket(3072) == 7


def test_length_buckets_are_validated_in_one_line():
    cfg = config_from_dict(_cfg(length_buckets=[1024, 3072]))
    assert ShapePlan.from_config(cfg).buckets == [1024, 3072]
    for bad, match in [([512, 256, 3072], "train.length_buckets"), (list(range(100, 1000, 100)) + [3072], "1 to 8"),
                       ([512, 2048], "at least data.max_length")]:
        with pytest.raises(ConfigError, match=match):
            config_from_dict(_cfg(length_buckets=bad))
    with pytest.raises(ConfigError, match="train.fixed_shapes"):
        config_from_dict(_cfg(fixed_shapes="yes"))


def _drain(batcher: TokenBatcher) -> list[list[batches.Member]]:
    out = []
    while batch := batcher.next_batch():
        out.append(batch)
    return out


def test_every_sample_leaves_once_in_a_batch_that_fits_its_shape():
    plan = ShapePlan([32, 64, 128], batch_tokens=256, num_anchors=8, block_size=4)
    batcher = TokenBatcher(plan)
    lengths = torch.randint(5, 129, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    out = []
    for seg in range(10):
        batcher.add(f"s{seg}", _samples(lengths[seg * 30:(seg + 1) * 30], start=seg * 30))
        while batcher.full_batch_ready():
            out.append(batcher.next_batch())
    full = len(out)
    out += _drain(batcher)
    seen = [m.sample.sample_id for batch in out for m in batch]
    assert sorted(seen) == list(range(300))
    for batch in out:
        shape = batcher.shape(batch)
        assert len(batch) <= shape.rows and max(m.length for m in batch) <= shape.length
    # Batches cut before the end-of-data flush are full: the rows of the bucket of their longest sample, or of
    # a longer bucket that shorter samples moved up into.
    for batch in out[:full]:
        first = plan.bucket(max(m.length for m in batch))
        assert len(batch) in {shape.rows for shape in plan.shapes[first:]}


def test_a_rare_length_moves_up_a_bucket_instead_of_waiting_or_going_out_as_empty_rows():
    plan = ShapePlan([16, 64], batch_tokens=256, num_anchors=4, block_size=4)  # N x S: 10 x 16, 4 x 64
    batcher = TokenBatcher(plan)
    batcher.add("rare", _samples([10]))
    assert not batcher.full_batch_ready()  # 1 of 10 rows: it waits for company
    out = []
    for seg in range(batches.HOLD_BATCHES + 1):  # more than HOLD_BATCHES batches' worth of 64-token samples
        batcher.add(f"s{seg}", _samples([60, 60, 60, 60], start=100 + 4 * seg))
        while batcher.full_batch_ready():
            out.append(batcher.next_batch())
    rare = [batch for batch in out if any(m.segment_id == "rare" for m in batch)]
    assert len(rare) == 1 and len(rare[0]) == 4  # it went out in a full 64-token batch
    assert len(batcher) < 4


def test_a_partial_batch_is_the_longest_bucket_topped_up_with_shorter_samples():
    plan = ShapePlan([16, 64], batch_tokens=256, num_anchors=4, block_size=4)
    batcher = TokenBatcher(plan)
    batcher.add("a", _samples([10, 12, 50]))
    assert not batcher.full_batch_ready()
    batch = batcher.next_batch()  # nothing more to come (the trainer found no segment at hand)
    assert sorted(m.length for m in batch) == [10, 12, 50] and len(batcher) == 0


def test_collate_pads_rows_and_length_to_the_shape():
    plan = ShapePlan([16, 64], batch_tokens=256, num_anchors=4, block_size=4)
    batcher = TokenBatcher(plan)
    batcher.add("a", _samples([3, 5]))
    members = batcher.next_batch()
    batch = collate(members, torch.device("cpu"), batcher.shape(members))
    assert batch["input_ids"].shape == (10, 16) and batch["hidden_states"].shape == (10, 16, 8)
    assert batch["lengths"].tolist() == [3, 5] + [0] * 8
    assert batch["loss_mask"][2:].sum() == 0 and batch["input_ids"][0, 3:].sum() == 0


def test_padding_to_the_shape_changes_neither_the_loss_nor_its_gradients():
    """float32, SDPA: empty rows, padded positions and blocks beyond a sample's anchors contribute nothing, and
    the anchors drawn are those of the unpadded batch (same generator)."""
    spec = small_spec(block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec, attention="sdpa")
    head = TargetHead(torch.randn(spec.vocab_size, spec.hidden_size) * 0.1)
    width = spec.num_context_layers * spec.hidden_size
    plan = ShapePlan([32, 64], batch_tokens=256, num_anchors=6, block_size=4)
    batcher = TokenBatcher(plan)
    batcher.add("a", _samples([20, 37, 41], width=width))
    members = batcher.next_batch()
    shape = batcher.shape(members)
    assert (shape.rows, shape.length, shape.blocks) == (4, 64, 6)

    def loss_and_grads(batch, num_blocks):
        drafter.zero_grad()
        out = dflash_loss(drafter, head, batch, num_anchors=6, gamma=4.0, generator=torch.Generator().manual_seed(3),
                          num_blocks=num_blocks)
        (out.loss * out.weight).backward()
        return out, [p.grad.clone() for p in drafter.parameters()]

    plain, plain_grads = loss_and_grads(collate(members, torch.device("cpu")), None)
    padded, padded_grads = loss_and_grads(collate(members, torch.device("cpu"), shape), shape.blocks)
    assert plain.count.sum() > 0
    torch.testing.assert_close(padded.loss, plain.loss, rtol=1e-6, atol=1e-6)
    assert torch.equal(padded.count, plain.count) and torch.equal(padded.correct, plain.correct)
    assert padded.weight == plain.weight
    for a, b in zip(padded_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # float32 summation order, nothing more


def test_compile_watch_counts_graphs_and_warns_past_the_plan(caplog):
    """Real torch.compile (the eager backend: dynamo builds and counts the graphs, nothing is code-generated)."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    watch = CompileWatch(bound=2)
    with caplog.at_level(logging.WARNING, logger="dflash_stream"):
        for n in (3, 3, 4, 3, 4):
            fn(torch.ones(n))
            watch.observe((n, 1))
        assert watch.graphs_compiled == 2 and not caplog.records
        fn(torch.ones(5))
        watch.observe((5, 1))
    assert watch.graphs_compiled == 3
    assert "past the 2 planned" in caplog.text and len(watch.shapes) == 3


def test_bucketed_shapes_waste_less_than_per_batch_shapes_on_headline_like_lengths():
    """The real batcher over a synthetic stream shaped like the headline job's (bench compile's figure)."""
    from dflash_stream.bench.compile import HEADLINE, headline_lengths, wastes

    cfg = config_from_dict({**_cfg(batch_tokens=49152, num_anchors=512), "drafter": {"block_size": 16}})
    samples = headline_lengths(3000, cfg.data.max_length, cfg.min_supervised_tokens)
    result = wastes(cfg, samples, int(cfg.store.segment_bytes) // HEADLINE["bytes_per_token"], 60)
    assert result["batches"] >= 60 and len({s for _, s in result["new"]}) <= 8
    assert result["padding_waste"] < min(0.3, result["baseline_padding_waste"])


@pytest.mark.slow
def test_bench_compile_stays_within_one_graph_per_bucket(capsys):
    """`bench compile` on the CPU: real demo lengths through compiled FlexAttention (needs a C compiler)."""
    import json

    from dflash_stream.cli import main

    # One whole pass over the demo data (47 batches): every bucket it uses comes round many times.
    assert main(["bench", "compile", "--json", "--batches", "40"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["batches"] >= 40
    assert result["graphs_compiled"] <= min(8, len(result["buckets"]))
    assert 0 < result["distinct_shapes"] <= len(result["buckets"]) and result["padding_waste"] < 0.3
