"""The DFlash drafter: spec, anchor mask, labels and weights of the loss, frozen head, export format."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from dflash_stream.config import ConfigError, config_from_dict
from dflash_stream.drafter import (
    DFlashDrafter,
    DrafterSpec,
    build_spec,
    dflash_loss,
    drafter_state,
    expected_acceptance,
    export_drafter,
    load_drafter,
    load_target_head,
    sample_anchors,
    save_checkpoint_drafter,
)
from dflash_stream.drafter.export import zlab_config
from dflash_stream.drafter.loss import eligible_anchors
from dflash_stream.target_model import shape_from_config, target_shape

LAYERS = [1, 3, 5]


def make_cfg(target_dir, **drafter) -> object:
    return config_from_dict({
        "output_dir": "unused",
        "target": {"model": str(target_dir), "layer_ids": LAYERS},
        "data": {"sources": [{"path": "unused.jsonl"}]},
        "store": {"path": "unused", "budget": "1GB"},
        "drafter": {"num_layers": 2, "block_size": 4, **drafter},
    })


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    """(spec, head, target model) for the tiny target."""
    from transformers import AutoModelForCausalLM

    cfg = make_cfg(tiny_target_dir)
    spec = build_spec(cfg, target_shape(cfg.target, count=False), LAYERS)
    head = load_target_head(cfg.target, "cpu")
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    return spec, head, target


def small_spec(**kw) -> DrafterSpec:
    base = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6, vocab_size=100, block_size=4, mask_token_id=99,
                target_layer_ids=[0, 1], num_target_layers=4, max_position_embeddings=512)
    return DrafterSpec(**{**base, **kw})


def features(n: int, s: int, spec: DrafterSpec, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, s, spec.num_context_layers * spec.hidden_size, generator=g)


# ---------------------------------------------------------------------------- spec


def test_spec_defaults_from_target(tiny):
    spec, _, target = tiny
    assert (spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (64, 4, 2, 16)
    assert spec.intermediate_size == 128 and spec.vocab_size == 49152 and spec.num_target_layers == 6
    assert spec.num_layers == 2 and spec.block_size == 4 and spec.target_layer_ids == LAYERS
    # SmolLM2's tokenizer fills the vocabulary and has no mask token: the unknown token's row is used.
    assert spec.mask_token_id == 0


def test_spec_rejects_mask_without_embedding_row(tiny_target_dir):
    cfg = make_cfg(tiny_target_dir, mask_token_id=49152)
    with pytest.raises(ConfigError, match="drafter.mask_token_id"):
        build_spec(cfg, target_shape(cfg.target, count=False), LAYERS)


def test_spec_rejects_other_width(tiny_target_dir):
    cfg = make_cfg(tiny_target_dir, hidden_size=128)
    with pytest.raises(ConfigError, match="drafter.hidden_size"):
        build_spec(cfg, target_shape(cfg.target, count=False), LAYERS)


# ---------------------------------------------------------------------------- anchors and mask


def test_anchor_eligibility():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0, 1, 0]], dtype=torch.bool)
    assert eligible_anchors(loss_mask)[0].nonzero().flatten().tolist() == [1, 2, 5]
    anchors, valid = sample_anchors(loss_mask, 10, torch.Generator().manual_seed(0))
    assert anchors[0].tolist() == [1, 2, 5] and valid.all()


def test_anchors_are_distinct_eligible_and_padded():
    g = torch.Generator().manual_seed(1)
    loss_mask = torch.rand(3, 50, generator=g) > 0.3
    loss_mask[2] = False
    loss_mask[2, 10:13] = True  # exactly two eligible anchors: 10, 11
    anchors, valid = sample_anchors(loss_mask, 8, g)
    eligible = eligible_anchors(loss_mask)
    assert anchors.shape[1] == 8
    for row in range(3):
        chosen = anchors[row][valid[row]]
        assert eligible[row, chosen].all() and len(set(chosen.tolist())) == len(chosen)
        assert chosen.tolist() == sorted(chosen.tolist())
        assert len(chosen) == min(8, int(eligible[row].sum()))
    assert anchors[2][valid[2]].tolist() == [10, 11]


def block_forward(drafter, ctx, anchors, block_ids, embed):
    """Training-style forward: all blocks of all sequences at once, with the anchor mask."""
    n, s, _ = ctx.shape
    bs = drafter.spec.block_size
    positions = (anchors[..., None] + torch.arange(bs)).flatten(1)
    context = drafter.context_kv(ctx, torch.arange(s).expand(n, s))
    return drafter(embed(block_ids.flatten(1)), positions, context, drafter.block_mask(anchors, s))


def setup_blocks(spec, n=2, s=24, anchors=((3, 9, 15), (5, 6, 20))):
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec, attention="sdpa").eval()
    embed = torch.nn.Embedding(spec.vocab_size, spec.hidden_size)
    anchors = torch.tensor(anchors)
    block_ids = torch.randint(0, spec.vocab_size, (n, anchors.shape[1], spec.block_size))
    return drafter, embed, features(n, s, spec), anchors, block_ids


@torch.no_grad()
def test_batched_blocks_equal_one_block_at_a_time():
    """The masked training forward equals drafting each block alone after exactly the context before it
    (what decoding does); a `<=` at the anchor or a leak between blocks breaks this."""
    spec = small_spec()
    drafter, embed, ctx, anchors, block_ids = setup_blocks(spec)
    batched = block_forward(drafter, ctx, anchors, block_ids, embed).view(*block_ids.shape, -1)
    for b in range(anchors.shape[0]):
        for j, a in enumerate(anchors[b].tolist()):
            context = drafter.context_kv(ctx[b : b + 1, :a], torch.arange(a)[None])
            pos = (a + torch.arange(spec.block_size))[None]
            alone = drafter(embed(block_ids[b : b + 1, j]), pos, context)
            torch.testing.assert_close(batched[b, j], alone[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_anchor_mask_is_strict():
    spec = small_spec()
    drafter, embed, ctx, anchors, block_ids = setup_blocks(spec)
    ref = block_forward(drafter, ctx, anchors, block_ids, embed).view(*block_ids.shape, -1)
    a = int(anchors[0, 1])  # block 1 of sequence 0, anchor 9

    at_anchor = ctx.clone()
    at_anchor[0, a:] += 5.0  # the anchor position and everything after it
    out = block_forward(drafter, at_anchor, anchors, block_ids, embed).view(*block_ids.shape, -1)
    torch.testing.assert_close(out[0, 1], ref[0, 1])
    torch.testing.assert_close(out[0, 0], ref[0, 0])
    assert not torch.allclose(out[0, 2], ref[0, 2])  # the later block (anchor 15) does see position 9..14

    before = ctx.clone()
    before[0, a - 1] += 5.0
    out = block_forward(drafter, before, anchors, block_ids, embed).view(*block_ids.shape, -1)
    assert not torch.allclose(out[0, 1], ref[0, 1])
    torch.testing.assert_close(out[0, 0], ref[0, 0])  # anchor 3 does not see position 8
    torch.testing.assert_close(out[1], ref[1])  # nor does the other sequence


@torch.no_grad()
def test_blocks_do_not_see_each_other():
    spec = small_spec()
    drafter, embed, ctx, anchors, block_ids = setup_blocks(spec)
    ref = block_forward(drafter, ctx, anchors, block_ids, embed).view(*block_ids.shape, -1)
    changed = block_ids.clone()
    changed[0, 1] = (changed[0, 1] + 1) % spec.vocab_size
    out = block_forward(drafter, ctx, anchors, changed, embed).view(*block_ids.shape, -1)
    torch.testing.assert_close(out[0, 0], ref[0, 0])
    torch.testing.assert_close(out[0, 2], ref[0, 2])
    assert not torch.allclose(out[0, 1], ref[0, 1])


@torch.no_grad()
def test_flex_attention_matches_sdpa_on_cpu():
    spec = small_spec(num_attention_heads=4, num_key_value_heads=1)  # GQA 4:1
    drafter, embed, ctx, anchors, block_ids = setup_blocks(spec)
    dense = block_forward(drafter, ctx, anchors, block_ids, embed)
    drafter.attention = "flex"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager (uncompiled) FlexAttention warns that it is slow
        flex = block_forward(drafter, ctx, anchors, block_ids, embed)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_flex_attention_refuses_training_off_cuda():
    drafter = DFlashDrafter(small_spec(), attention="flex")
    with pytest.raises(ConfigError, match="drafter.attention=flex"):
        drafter.block_mask(torch.tensor([[2, 5]]), 10)


# ---------------------------------------------------------------------------- loss


def test_loss_labels_and_decay_weights(tiny):
    """Slot k of the block at anchor a is scored against input_ids[a + k], weighted exp(-(k-1)/gamma),
    only where a + k is supervised and inside the sequence."""
    spec, head, _ = tiny
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec).eval()
    n, s, gamma, bs = 2, 20, 3.0, spec.block_size
    ids = torch.randint(0, spec.vocab_size, (n, s))
    loss_mask = torch.zeros(n, s, dtype=torch.bool)
    loss_mask[0, 4:20] = True
    loss_mask[1, 6:14] = True  # sequence 1 is 14 tokens long, then padding
    lengths = torch.tensor([20, 14])
    batch = {"hidden_states": features(n, s, spec).to(torch.bfloat16), "input_ids": ids,
             "loss_mask": loss_mask, "lengths": lengths}
    with torch.no_grad():
        out = dflash_loss(drafter, head, batch, num_anchors=4, gamma=gamma, generator=torch.Generator().manual_seed(7))
    anchors, valid = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(7))

    num = den = 0.0
    count = torch.zeros(bs - 1)
    correct = torch.zeros(bs - 1)
    with torch.no_grad():
        for b in range(n):
            for a in anchors[b][valid[b]].tolist():
                block = torch.full((1, bs), spec.mask_token_id)
                block[0, 0] = ids[b, a]
                context = drafter.context_kv(batch["hidden_states"][b : b + 1, :a], torch.arange(a)[None])
                logits = head.logits(drafter(head.embed(block), (a + torch.arange(bs))[None], context))[0]
                for k in range(1, bs):
                    if a + k < lengths[b] and loss_mask[b, a + k]:
                        w = math.exp(-(k - 1) / gamma)
                        num += w * F.cross_entropy(logits[k], ids[b, a + k]).item()
                        den += w
                        count[k - 1] += 1
                        correct[k - 1] += float(logits[k].argmax() == ids[b, a + k])
    assert out.loss.item() == pytest.approx(num / den, rel=1e-4)
    assert out.weight.item() == pytest.approx(den, rel=1e-5)
    assert out.count.tolist() == count.tolist() and out.correct.tolist() == correct.tolist()
    assert count[-1] < count[0]  # anchors near the end of sequence 1 lose their last slots


def test_loss_backpropagates_only_into_drafter(tiny):
    spec, head, _ = tiny
    drafter = DFlashDrafter(spec)
    ids = torch.randint(0, spec.vocab_size, (1, 12))
    batch = {"hidden_states": features(1, 12, spec), "input_ids": ids,
             "loss_mask": torch.ones(1, 12, dtype=torch.bool), "lengths": torch.tensor([12])}
    dflash_loss(drafter, head, batch, num_anchors=3, gamma=7.0).loss.backward()
    assert all(p.grad is not None for p in drafter.parameters())
    assert not head.embed_weight.requires_grad and head.embed_weight.grad is None


def _pinned_case(chunk_rows):
    """A seeded drafter, head and ragged batch; (loss output, two gradient figures) after backward."""
    from dflash_stream.drafter import TargetHead

    torch.manual_seed(0)
    spec = small_spec()
    drafter = DFlashDrafter(spec)
    head = TargetHead(torch.randn(spec.vocab_size, spec.hidden_size, generator=torch.Generator().manual_seed(1)))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, spec.vocab_size, (3, 40), generator=g)
    mask = torch.rand(3, 40, generator=g) > 0.2
    lengths = torch.tensor([40, 33, 25])
    for row, length in enumerate(lengths.tolist()):
        mask[row, length:] = False
    batch = {"hidden_states": features(3, 40, spec, seed=3), "input_ids": ids, "loss_mask": mask, "lengths": lengths}
    out = dflash_loss(drafter, head, batch, num_anchors=6, gamma=7.0, generator=torch.Generator().manual_seed(4),
                      chunk_rows=chunk_rows)
    out.loss.backward()
    grads = (drafter.fc.weight.grad.double().norm().item(), drafter.layers[1].mlp.down_proj.weight.grad.double().sum().item())
    return out, grads


@pytest.mark.parametrize("chunk_rows", [None, 5, 2048])
def test_loss_numbers_pinned_across_the_chunked_head(chunk_rows):
    """Loss, weight, per-slot counts and two gradient figures as the unchunked loss computed them before the LM
    head was chunked (same seeds), for the plain path, small ragged chunks and one chunk."""
    out, (fc_norm, down_sum) = _pinned_case(chunk_rows)
    assert out.loss.item() == pytest.approx(26.7116756439209, rel=1e-5)
    assert out.weight.item() == pytest.approx(33.54747772216797, rel=1e-6)
    assert out.count.tolist() == [18.0, 11.0, 8.0] and out.correct.tolist() == [0.0, 0.0, 0.0]
    assert fc_norm == pytest.approx(0.4382434939895425, rel=1e-5)
    assert down_sum == pytest.approx(0.0037780456925631256, rel=1e-5)


@pytest.mark.parametrize("rows, chunk_rows", [(300, 64), (300, 1), (300, 300), (300, 1000), (0, 16)])
def test_chunked_head_loss_equals_unchunked_in_float32(rows, chunk_rows):
    """Same weighted CE sum, argmax hits and input gradient (float32, <= 1e-5 relative) as plain autograd."""
    from dflash_stream.drafter.loss import head_cross_entropy

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(500, 24, generator=g)
    target = torch.randint(0, 500, (rows,), generator=g)
    w = torch.rand(rows, generator=g)
    base = torch.randn(rows, 24, generator=g) * 3
    results = []
    for chunk in (None, chunk_rows):
        hidden = base.clone().requires_grad_(True)
        total, hits = head_cross_entropy(hidden, weight, target, w, chunk)
        (total * 1.7).backward()  # a non-unit upstream gradient
        results.append((total.detach(), hits, hidden.grad))
    (ref, ref_hits, ref_grad), (got, got_hits, got_grad) = results
    assert torch.equal(ref_hits, got_hits) and got_hits.dtype == torch.bool
    assert got.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    assert got_grad.shape == ref_grad.shape == (rows, 24)
    if rows:
        assert float((got_grad - ref_grad).abs().max()) <= 1e-5 * float(ref_grad.abs().max())


def test_one_chunk_of_cross_entropy_computes_the_head_once(monkeypatch):
    """All rows in one chunk, cross-entropy alone: backward takes the softmax forward made (one head matmul for
    both passes, the same gradient); more chunks recompute theirs (the working set stays one chunk). A second
    backward through a retained graph recomputes it too."""
    from dflash_stream.drafter import loss

    calls = []
    real = loss._chunk_logits

    def counted(hidden, weight):
        calls.append(len(hidden))
        return real(hidden, weight)

    monkeypatch.setattr(loss, "_chunk_logits", counted)
    g = torch.Generator().manual_seed(3)
    weight, base = torch.randn(300, 16, generator=g), torch.randn(40, 16, generator=g)
    target, w = torch.randint(0, 300, (40,), generator=g), torch.rand(40, generator=g)
    grads = {}
    for chunk in (40, 16):
        calls.clear()
        hidden = base.clone().requires_grad_(True)
        total, _ = loss.head_cross_entropy(hidden, weight, target, w, chunk)
        total.backward(retain_graph=True)
        grads[chunk] = hidden.grad.clone()
        assert calls == ([40] if chunk == 40 else [16, 16, 8, 16, 16, 8])
        hidden.grad = None
        total.backward()  # the kept softmax became the first gradient: this one recomputes
        assert float((hidden.grad - grads[chunk]).abs().max()) <= 1e-6 * float(grads[chunk].abs().max())
    assert float((grads[40] - grads[16]).abs().max()) <= 1e-6 * float(grads[16].abs().max())


def test_chunked_head_loss_keeps_the_heads_dtype():
    """A bf16 head computes its chunks in bf16, forward and backward, and hands back a gradient in the rows'
    own dtype; the frozen head gets none."""
    from dflash_stream.drafter.loss import head_cross_entropy

    g = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 16, generator=g).to(torch.bfloat16)
    hidden = torch.randn(10, 16, generator=g).requires_grad_(True)
    target = torch.randint(0, 64, (10,), generator=g)
    total, _ = head_cross_entropy(hidden, weight, target, torch.ones(10), 3)
    total.backward()
    assert total.dtype == torch.float32 and hidden.grad.dtype == torch.float32 and weight.grad is None
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ref, _ = head_cross_entropy(ref_hidden, weight, target, torch.ones(10), None)
    ref.backward()
    assert total.item() == pytest.approx(ref.item(), rel=1e-3)
    assert torch.allclose(hidden.grad, ref_hidden.grad, rtol=2e-2, atol=1e-3)


def test_expected_acceptance():
    assert expected_acceptance([]) == 1.0
    assert expected_acceptance([1.0, 1.0, 1.0]) == 4.0
    assert expected_acceptance([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_acceptance([0.0, 1.0]) == 1.0


# ---------------------------------------------------------------------------- frozen head


def test_head_from_safetensors_is_the_targets(tiny):
    _, head, target = tiny
    assert torch.equal(head.embed_weight, target.get_input_embeddings().weight)
    assert head.lm_head_weight is head.embed_weight  # tie_word_embeddings
    h = torch.randn(3, 64)
    torch.testing.assert_close(head.logits(h), target.lm_head(h))


def test_head_from_sharded_untied_safetensors(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_stream.config import TargetConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    head = load_target_head(TargetConfig(model=str(tmp_path)), "cpu", torch.float64)
    assert head.embed_weight.dtype == torch.float64 and head.lm_head_weight is not head.embed_weight
    torch.testing.assert_close(head.embed_weight.float(), model.model.embed_tokens.weight)
    torch.testing.assert_close(head.lm_head_weight.float(), model.lm_head.weight)


# ---------------------------------------------------------------------------- export


def test_export_format(tiny, tmp_path):
    spec = tiny[0]
    drafter = DFlashDrafter(spec)
    out = export_drafter(drafter, spec, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 4 and config["num_target_layers"] == 6
    assert config["dflash_config"] == {"mask_token_id": spec.mask_token_id, "target_layer_ids": LAYERS}
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (64, 2, 16)
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= keys
    assert not any("embed" in k or "lm_head" in k or "rotary" in k for k in keys)
    per_layer = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"}
    assert keys == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}" for i in range(2) for name in per_layer}
    assert set(drafter_state(drafter)) == keys


@torch.no_grad()
def test_export_reload_gives_identical_logits(tiny, tmp_path):
    spec, head, _ = tiny
    torch.manual_seed(3)
    drafter = DFlashDrafter(spec).eval()
    for p in drafter.parameters():  # RMSNorm weights start at 1; make every tensor matter
        p.add_(0.01 * torch.randn_like(p))
    reloaded, spec2 = load_drafter(export_drafter(drafter, spec, tmp_path / "export"))
    assert spec2 == spec
    ctx = features(1, 10, spec)
    block = torch.tensor([[5, spec.mask_token_id, spec.mask_token_id, spec.mask_token_id]])
    pos = torch.arange(10, 14)[None]

    def logits(model):
        return head.logits(model(head.embed(block), pos, model.context_kv(ctx, torch.arange(10)[None])))

    assert torch.equal(logits(reloaded.eval()), logits(drafter))


def test_export_command_from_checkpoint(tiny, tmp_path, capsys):
    from dflash_stream.cli import main

    spec = tiny[0]
    drafter = DFlashDrafter(spec)
    ckpt = tmp_path / "run" / "checkpoints" / "step-5"
    ckpt.mkdir(parents=True)
    save_checkpoint_drafter(drafter, spec, ckpt)
    (ckpt / "COMPLETE").write_text("")
    for source in (ckpt, tmp_path / "run"):  # a checkpoint, or a run folder (its latest checkpoint)
        out = tmp_path / f"export-{source.name}"
        assert main(["export", str(source), "--out", str(out)]) == 0
        reloaded, _ = load_drafter(out)
        for name, t in drafter_state(drafter).items():
            assert torch.equal(drafter_state(reloaded)[name], t)
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2  # a user-fixable error (docs/troubleshooting.md: exit codes)
    assert "neither a trainer checkpoint" in capsys.readouterr().err


# ---------------------------------------------------------------------------- rope scaling, transformers loading

ROPE_SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


def test_plain_rope_frequencies_are_pinned():
    """Without rope_scaling the drafter keeps its original RoPE: theta^(-2i/Dh), cos/sin unscaled."""
    drafter = DFlashDrafter(small_spec())
    assert drafter.rotary.scale == 1.0
    assert drafter.rotary.inv_freq.tolist() == pytest.approx([1.0, 0.1, 0.01, 0.001], rel=1e-6)
    config = zlab_config(small_spec())
    assert config["rope_scaling"] is None and config["rope_parameters"] == {"rope_type": "default",
                                                                           "rope_theta": 10000.0}


@torch.no_grad()
def test_plain_rope_drafter_output_is_pinned():
    """Numbers recorded before rope_scaling support: a target without scaling drafts exactly as before."""
    torch.manual_seed(0)
    drafter = DFlashDrafter(small_spec(), attention="sdpa").eval()
    g = torch.Generator().manual_seed(1)
    ctx, emb = torch.randn(1, 12, 64, generator=g), torch.randn(1, 4, 32, generator=g)
    out = drafter(emb, torch.arange(12, 16)[None], drafter.context_kv(ctx, torch.arange(12)[None]))
    assert out.double().sum().item() == pytest.approx(-3.288314669393003, rel=1e-5)
    assert out[0, 1, :4].tolist() == pytest.approx([0.97104543, -0.05394808, -1.19594646, 0.59952575], rel=1e-5)


@pytest.mark.parametrize("kind", sorted(ROPE_SCALINGS))
def test_drafter_rotary_equals_the_targets_scaled_rope(kind, tiny_target_dir, tmp_path):
    """Training and decoding (the drafter's Rotary) and the export (config.json read by transformers' Qwen3
    rotary embedding, as z-lab's loader does) all rotate with the target's own scaled frequencies."""
    from transformers import AutoModel, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    target_config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                rope_parameters={**ROPE_SCALINGS[kind], "rope_theta": 50000.0})
    spec = build_spec(make_cfg(tiny_target_dir, mask_token_id=0), shape_from_config(target_config, "test", count=False), LAYERS)
    assert spec.rope_scaling["rope_type"] == kind and spec.rope_theta == 50000.0
    positions = torch.arange(0, 900, 7)[None]
    x = torch.zeros(1, positions.shape[1], 64)
    want_cos, want_sin = LlamaRotaryEmbedding(target_config)(x, positions)
    drafter = DFlashDrafter(spec).eval()
    cos, sin = drafter.rotary(positions)
    torch.testing.assert_close(cos[:, 0], want_cos)
    torch.testing.assert_close(sin[:, 0], want_sin)
    plain_cos, _ = DFlashDrafter(dataclasses.replace(spec, rope_scaling=None)).rotary(positions)
    assert not torch.allclose(plain_cos[:, 0], want_cos, atol=1e-3)  # the scaling matters at these positions

    out = export_drafter(drafter, spec, tmp_path / kind)
    assert load_drafter(out)[1] == spec
    loaded = AutoModel.from_pretrained(out, trust_remote_code=True)
    cos, sin = loaded.rotary_emb(x, positions)
    torch.testing.assert_close(cos, want_cos)
    torch.testing.assert_close(sin, want_sin)


@torch.no_grad()
def test_export_loads_with_transformers_automodel(tiny, tmp_path):
    """The export's auto_map + dflash.py: AutoModel(trust_remote_code) gives our drafter's hidden states, and
    its spec_generate reproduces the target's greedy output."""
    from transformers import AutoModel

    from dflash_stream.drafter.speculative import greedy_generate

    spec, head, target = tiny
    torch.manual_seed(5)
    drafter = DFlashDrafter(spec).eval()
    for p in drafter.parameters():
        p.add_(0.01 * torch.randn_like(p))
    out = export_drafter(drafter, spec, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"} and (out / "dflash.py").is_file()
    loaded = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    assert type(loaded).__name__ == "DFlashDraftModel"

    ctx = features(1, 10, spec)
    block = torch.tensor([[5, spec.mask_token_id, spec.mask_token_id, spec.mask_token_id]])
    ours = head.logits(drafter(head.embed(block), torch.arange(10, 14)[None],
                               drafter.context_kv(ctx, torch.arange(10)[None])))
    theirs = head.logits(loaded(torch.arange(14)[None], head.embed(block), ctx))
    torch.testing.assert_close(theirs, ours)

    prompt = torch.tensor([[1, 422, 3055, 314, 253, 1234, 28]])
    want = greedy_generate(target, prompt, 12, set()).tokens
    got = loaded.spec_generate(target, prompt, max_new_tokens=12, stop_token_ids=[])
    assert got[0, prompt.shape[1]:].tolist() == want
