"""The DFlash2 drafter (issue 35): its convolution and selector, its loss, its export against vLLM 0.32's own module,
and training it (and DFlash with the KL loss) from the bounded stream through the whole pipeline."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import VLLM_PYTHON, needs_vllm
from test_drafter import LAYERS, block_forward, features, make_cfg, small_spec
from test_pipeline import write_run_config

from dflash_stream.cli import main
from dflash_stream.config import ConfigError
from dflash_stream.drafter import (
    DFlash2Drafter,
    DFlashDrafter,
    Objective,
    TargetHead,
    build_spec,
    dflash_loss,
    export_drafter,
    load_drafter,
    sample_anchors,
)
from dflash_stream.drafter.dflash2 import CandidateSelector, grouped_conv, walk
from dflash_stream.drafter.export import load_init_weights
from dflash_stream.drafter.speculative import greedy_generate, speculative_generate
from dflash_stream.pipeline.audit import audit_run
from dflash_stream.target_model import target_shape

REPO = Path(__file__).parent.parent


def dflash2_spec(**kw):
    return small_spec(kind="dflash2", conv_group_size=8, selector_rank=6, selector_top_k=5, **kw)


def randomized(drafter: torch.nn.Module, seed: int = 5, scale: float = 0.3) -> torch.nn.Module:
    """Every convolution and selector weight away from its identity/fresh value, so that they all matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return drafter


@torch.no_grad()
def test_a_fresh_dflash2_drafter_computes_its_dflash_backbone():
    """The convolutions start as the identity: DFlash2 with the same backbone weights drafts the same states."""
    spec = dflash2_spec()
    torch.manual_seed(0)
    ours = DFlash2Drafter(spec, attention="sdpa").eval()
    base = DFlashDrafter(small_spec(), attention="sdpa").eval()
    base.load_state_dict({k: v for k, v in ours.state_dict().items() if k in base.state_dict()})
    ctx, anchors = features(2, 24, spec), torch.tensor([[3, 9, 15], [5, 6, 20]])
    block_ids = torch.randint(0, spec.vocab_size, (2, 3, spec.block_size))
    embed = torch.nn.Embedding(spec.vocab_size, spec.hidden_size)
    torch.testing.assert_close(block_forward(ours, ctx, anchors, block_ids, embed),
                               block_forward(base, ctx, anchors, block_ids, embed))


def test_grouped_conv_is_causal_within_each_block():
    """A token changes its own slot and the next conv_kernel_size - 1 slots of its block, never another block."""
    g = torch.Generator().manual_seed(0)
    bs, taps, d, gs = 4, 2, 16, 4
    x = torch.randn(1, 3 * bs, d, generator=g)
    delta = torch.randn(1, 3 * bs, taps, d // gs, generator=g)
    base = torch.randn(taps, d, generator=g)
    ref = grouped_conv(x, delta, base, bs, gs)
    moved = x.clone()
    moved[0, 5] += 1.0  # block 1, slot 1
    changed = (grouped_conv(moved, delta, base, bs, gs) - ref).abs().amax(-1)[0] > 0
    assert changed.nonzero().flatten().tolist() == [5, 6]
    moved = x.clone()
    moved[0, 7] += 1.0  # block 1, last slot: the next block's slot 0 does not see it
    changed = (grouped_conv(moved, delta, base, bs, gs) - ref).abs().amax(-1)[0] > 0
    assert changed.nonzero().flatten().tolist() == [7]


@torch.no_grad()
def test_dflash2_batched_blocks_equal_one_block_at_a_time():
    """The training forward of many blocks (anchor mask, convolutions per block) equals drafting each block alone
    after exactly the context before it."""
    spec = dflash2_spec()
    torch.manual_seed(0)
    drafter = randomized(DFlash2Drafter(spec, attention="sdpa")).eval()
    embed = torch.nn.Embedding(spec.vocab_size, spec.hidden_size)
    ctx, anchors = features(2, 24, spec), torch.tensor([[3, 9, 15], [5, 6, 20]])
    block_ids = torch.randint(0, spec.vocab_size, (2, 3, spec.block_size))
    batched = block_forward(drafter, ctx, anchors, block_ids, embed).view(*block_ids.shape, -1)
    for b in range(2):
        for j, a in enumerate(anchors[b].tolist()):
            context = drafter.context_kv(ctx[b : b + 1, :a], torch.arange(a)[None])
            alone = drafter(embed(block_ids[b : b + 1, j]), (a + torch.arange(spec.block_size))[None], context)
            torch.testing.assert_close(batched[b, j], alone[0], atol=1e-5, rtol=1e-5)


def _selector_case(objective: Objective, chunk_rows):
    spec = dflash2_spec()
    torch.manual_seed(0)
    drafter = randomized(DFlash2Drafter(spec, attention="sdpa")).eval()
    g = torch.Generator().manual_seed(1)
    norm = torch.nn.RMSNorm(spec.hidden_size)
    with torch.no_grad():
        norm.weight.fill_(4.0)
    head = TargetHead(torch.randn(spec.vocab_size, spec.hidden_size, generator=g), final_norm=norm)
    n, s = 2, 22
    ids = torch.randint(0, spec.vocab_size - 1, (n, s), generator=g)
    mask = torch.ones(n, s, dtype=torch.bool)
    mask[1, 15:] = False
    lengths = torch.tensor([22, 15])
    states = torch.cat((features(n, s, spec, seed=2), torch.randn(n, s, spec.hidden_size, generator=g)), -1)
    batch = {"hidden_states": states, "input_ids": ids, "loss_mask": mask, "lengths": lengths}
    with torch.no_grad():
        out = dflash_loss(drafter, head, batch, num_anchors=5, gamma=3.0, generator=torch.Generator().manual_seed(3),
                          chunk_rows=chunk_rows, objective=objective)
    return spec, drafter, head, batch, out


@pytest.mark.parametrize("loss, chunk_rows", [("ce", None), ("ce", 4), ("kl", 7)])
def test_dflash2_loss_is_unary_plus_the_selectors_k_way_cross_entropy(loss, chunk_rows):
    """Restated slot by slot from speculators' DFlash2 (compute_metrics, compute_selector_loss): each block drafted
    alone; the unary term (CE on the label, or KL to the target's distribution at a + k - 1); the selector's
    classes are the head's top-K, the selector's target (the label, or the target's argmax with KL) put last where
    missing, scored by unary logit + transition from the true previous token; both decay-weighted, over the
    same weight sum; alpha = selector_weight; accuracy is the selector's pick against the label."""
    objective = Objective(1.0, 0.0, 0.7) if loss == "ce" else Objective(0.0, 1.0, 0.7)
    spec, drafter, head, batch, out = _selector_case(objective, chunk_rows)
    ids, mask, lengths, states = batch["input_ids"], batch["loss_mask"], batch["lengths"], batch["hidden_states"]
    selector, bs, k_top, d = drafter.candidate_selector, spec.block_size, spec.selector_top_k, spec.hidden_size
    anchors, valid = sample_anchors(mask, 5, torch.Generator().manual_seed(3))
    num = den = 0.0
    correct = torch.zeros(bs - 1)
    with torch.no_grad():
        for b in range(2):
            for a in anchors[b][valid[b]].tolist():
                block = torch.full((1, bs), spec.mask_token_id)
                block[0, 0] = ids[b, a]
                context = drafter.context_kv(states[b : b + 1, :a, :-d], torch.arange(a)[None])
                hidden = drafter(head.embed(block), (a + torch.arange(bs))[None], context)[0]
                logits = head.logits(hidden)
                for k in range(1, bs):
                    if not (a + k < lengths[b] and mask[b, a + k]):
                        continue
                    label = int(ids[b, a + k])
                    teacher = head.teacher_logits(head.verifier_normed(states[b, a + k - 1, -d:]))
                    if loss == "ce":
                        unary, target = F.cross_entropy(logits[k], torch.tensor(label)), label
                    else:
                        unary = F.kl_div(logits[k].log_softmax(-1), teacher.softmax(-1), reduction="sum")
                        target = int(teacher.argmax())
                    candidates = logits[k].topk(k_top).indices
                    if target not in candidates.tolist():
                        candidates[-1] = target
                    scores = logits[k][candidates] + selector.transition(hidden[k], ids[b, a + k - 1], candidates)
                    selected = F.cross_entropy(scores, torch.tensor(candidates.tolist().index(target)))
                    w = math.exp(-(k - 1) / 3.0)
                    num += w * (unary.item() + 0.7 * selected.item())
                    den += w
                    correct[k - 1] += float(candidates[scores.argmax()] == label)
    assert out.loss.item() == pytest.approx(num / den, rel=1e-5)
    assert out.correct.tolist() == correct.tolist()


def test_dflash2_loss_trains_every_weight():
    spec, drafter, head, batch, _ = _selector_case(Objective(0.0, 1.0), 4)
    drafter.train()
    dflash_loss(drafter, head, batch, num_anchors=5, gamma=3.0, chunk_rows=4, objective=Objective(0.0, 1.0)
                ).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())


def test_walk_follows_its_own_picks():
    """Slot 0 takes the best candidate after the anchor; slot l the best after slot l-1's pick (not after its
    best-scoring candidate)."""
    candidates = torch.tensor([[[10, 11], [20, 21], [30, 31]]])
    scores = torch.zeros(1, 3, 2, 2)
    scores[0, 0, :, 1] = 1.0  # slot 0 picks 11 (index 1)
    scores[0, 1, 1, 0], scores[0, 1, 0, 1] = 1.0, 5.0  # after index 1: 20; after index 0 would be 21
    scores[0, 2, 0, 1] = 1.0  # after index 0 (20): 31
    assert walk(scores, candidates).tolist() == [[11, 20, 31]]


def test_dflash2_spec_checks(tiny_target_dir):
    with pytest.raises(ConfigError, match="conv_group_size=24 must divide"):
        build_spec(make_cfg(tiny_target_dir, kind="dflash2", conv_group_size=24),
                   target_shape(make_cfg(tiny_target_dir).target, count=False), LAYERS)


@pytest.fixture(scope="module")
def exported(tiny_target_dir, tmp_path_factory):
    """A trained-looking DFlash2 drafter for the tiny target (every weight random), exported in float32."""
    cfg = make_cfg(tiny_target_dir, kind="dflash2", selector_rank=8, selector_top_k=4)
    spec = build_spec(cfg, target_shape(cfg.target, count=False), LAYERS)
    torch.manual_seed(0)
    drafter = randomized(DFlash2Drafter(spec, attention="sdpa"), scale=0.05).eval()
    out = export_drafter(drafter, spec, tmp_path_factory.mktemp("dflash2") / "drafter")
    return cfg, spec, drafter, out


def test_export_config_and_init_from(exported, tmp_path):
    cfg, spec, drafter, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and "auto_map" not in config
    assert {k: config["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                     "selector_top_k", "input_embedding_scale")} == {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4,
        "input_embedding_scale": 1.0}
    loaded, loaded_spec = load_drafter(out)
    assert isinstance(loaded, DFlash2Drafter) and loaded_spec == spec
    # drafter.init_from a DFlash2 folder: its selector shape comes along; a DFlash run is refused.
    init_cfg = make_cfg(cfg.target.model, kind="dflash2", init_from=str(out))
    init_spec = build_spec(init_cfg, target_shape(init_cfg.target, count=False), LAYERS)
    assert init_spec.selector_rank == 8 and init_spec.selector_top_k == 4
    fresh = DFlash2Drafter(init_spec)
    load_init_weights(fresh, out)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), drafter.state_dict().values(), strict=True))
    with pytest.raises(ConfigError, match="drafter.init_from: kind dflash2 in .*, this run dflash"):
        build_spec(make_cfg(cfg.target.model, init_from=str(out)), target_shape(init_cfg.target, count=False),
                   LAYERS)


def test_dflash2_speculative_decoding_equals_the_targets_greedy_output(exported, tiny_target_dir):
    from transformers import AutoModelForCausalLM

    _, _, drafter, _ = exported
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    head = TargetHead.from_model(target)
    prompt = torch.randint(3, 49152, (1, 17), generator=torch.Generator().manual_seed(4))
    base = greedy_generate(target, prompt, 24, {2})
    fast = speculative_generate(target, drafter, head, prompt, 24, {2})
    assert fast.tokens == base.tokens and len(fast.accepted) > 0


@pytest.mark.slow
@needs_vllm
def test_export_loads_into_vllms_dflash2_module_with_the_same_numbers(exported, tiny_target_dir, tmp_path):
    """In vLLM 0.32's environment: DFlash2Qwen3ForCausalLM's parameters are exactly the export's tensors (names,
    shapes, values; stacked q/k/v and gate/up as its loader stacks them), an unknown tensor is refused; its pure
    `_grouped_conv` and `_score_edges` equal ours on the same inputs; its forward of a block after a context
    (see tests/vllm_dflash2_check.py for the one kernel it stands in for) gives our final states, the same top-k
    candidates and logits, and the same edge scores, whose walk is our draft."""
    from transformers import AutoModelForCausalLM

    cfg, spec, drafter, out = exported
    g = torch.Generator().manual_seed(6)
    head = TargetHead.from_model(AutoModelForCausalLM.from_pretrained(tiny_target_dir))
    s, bs = 11, spec.block_size
    states = torch.randn(s, spec.num_context_layers * spec.hidden_size, generator=g)
    block = torch.full((bs,), spec.mask_token_id)
    block[0] = 1234
    with torch.no_grad():
        context = drafter.context_kv(states[None], torch.arange(s)[None])
        hidden = drafter(head.embed(block[None]), (s + torch.arange(bs))[None], context)[0]
        unary, candidates = head.logits(hidden[1:]).float().topk(spec.selector_top_k)
        scores = drafter.candidate_selector.edge_scores(candidates[None], unary[None], hidden[1:][None], block[:1])
        drafted = drafter.propose(head, block[None], (s + torch.arange(bs))[None], context)
    conv = {"x": torch.randn(3 * bs, spec.hidden_size, generator=g), "group_size": spec.conv_group_size,
            "delta": torch.randn(3 * bs, 2, spec.hidden_size // spec.conv_group_size, generator=g),
            "base": torch.randn(2, spec.hidden_size, generator=g)}
    edges = {"predecessor": torch.randn(50, 8, generator=g), "successor": torch.randn(50, 8, generator=g),
             "candidates": torch.randint(0, 50, (2, bs - 1, 4), generator=g), "unary": torch.randn(2, bs - 1, 4,
             generator=g), "hidden": torch.randn(2, bs - 1, 8, generator=g), "anchors": torch.tensor([3, 7])}
    case = {"block_size": bs, "port": 29500 + int(torch.randint(0, 400, ())), "embedding": head.embed_weight.data,
            "states": states, "context_positions": torch.arange(s), "block": block,
            "block_positions": s + torch.arange(bs), "conv": conv, "edges": edges,
            "spec": {"num_attention_heads": spec.num_attention_heads,
                     "num_key_value_heads": spec.num_key_value_heads, "head_dim": spec.head_dim}}
    torch.save(case, tmp_path / "case.pt")
    done = subprocess.run([str(VLLM_PYTHON), str(REPO / "tests" / "vllm_dflash2_check.py"), str(tiny_target_dir),
                           str(out), str(tmp_path / "case.pt"), str(tmp_path / "vllm.json")],
                          capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((tmp_path / "vllm.json").read_text())

    assert got["missing_in_vllm"] == [] and got["not_in_export"] == [] and got["shape_mismatch"] == []
    assert got["loaded_equal"] and got["rejects_unknown_tensor"]
    assert "model.candidate_selector.predecessor_codebook" in got["parameters"]
    assert "model.layers.1.mlp_conv.kernel_projection.weight" in got["parameters"]
    ours_conv = grouped_conv(conv["x"][None], conv["delta"][None], conv["base"], bs, spec.conv_group_size)[0]
    torch.testing.assert_close(torch.tensor(got["grouped_conv"]), ours_conv, rtol=1e-5, atol=1e-6)
    selector = CandidateSelector(small_spec(hidden_size=8, vocab_size=50, mask_token_id=49, kind="dflash2",
                                            conv_group_size=8, selector_rank=8, selector_top_k=4))
    with torch.no_grad():
        selector.predecessor_codebook.copy_(edges["predecessor"])
        selector.successor_codebook.copy_(edges["successor"])
        selector.hidden_projection.weight.copy_(torch.eye(8))  # vLLM's function takes the projected hidden
        ours_edges = selector.edge_scores(edges["candidates"], edges["unary"], edges["hidden"], edges["anchors"])
    torch.testing.assert_close(torch.tensor(got["score_edges"]), ours_edges, rtol=1e-5, atol=1e-5)

    torch.testing.assert_close(torch.tensor(got["hidden"]), hidden, rtol=1e-4, atol=1e-5)
    assert got["candidates"] == candidates.tolist()
    torch.testing.assert_close(torch.tensor(got["unary"]), unary, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.tensor(got["scores"]), scores, rtol=1e-4, atol=1e-4)
    assert walk(torch.tensor(got["scores"]), torch.tensor([got["candidates"]])).tolist() == drafted.tolist()


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_kl_training_from_the_stream_exports_and_evaluates(kind, tiny_target_dir, tmp_path):
    """`run` with train.loss kl: the extractors store the verifier's state (the store is one layer wider and its
    fingerprint says so), the trainer learns from the target's distribution, the drafter exports and speculative
    decoding reproduces the target's output; the audit holds."""
    config = write_run_config(tmp_path, tiny_target_dir, rows=10, **{
        "train.loss": "kl", "drafter.kind": kind, "train.epochs": 1,
        **({"drafter.selector_rank": 16, "drafter.selector_top_k": 4} if kind == "dflash2" else {}),
        "eval.prompts": str(REPO / "dflash_stream" / "demo_data" / "heldout_prompts.jsonl"), "eval.num_prompts": 1,
        "eval.max_new_tokens": 12})
    assert main(["run", "--config", str(config)]) == 0
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples_trained"] == summary["samples_extracted"] > 0 and summary["final_loss"] > 0
    assert summary["eval"]["matches_target"] is True
    assert audit_run(out)["ok"]
    drafter, spec = load_drafter(out / "drafter")
    assert spec.kind == kind and type(drafter) is (DFlash2Drafter if kind == "dflash2" else DFlashDrafter)
    store = json.loads((out / "store" / "store.json").read_text())
    assert store["fingerprint"]["layer_ids"] == [1, 2, 3, 5] and store["fingerprint"]["verifier_layer"] == 5
    metrics = [json.loads(line) for path in (out / "metrics").glob("*.jsonl") for line in path.read_text().splitlines()]
    losses = [m["loss"] for m in metrics if m["event"] == "train"]
    assert losses and all(math.isfinite(x) for x in losses)

