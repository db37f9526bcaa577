"""Drafter layouts (`drafter.layer_types` / `sliding_window`, z-lab's sliding layers) and `drafter.init_from`.

The reference for sliding layers is z-lab's dflash (github.com/z-lab/dflash, dflash/model.py at 10129599:
`_attention_mask` and `Qwen3DFlashAttention.is_causal`), restated here on its own terms: when one block is drafted
after its context, the keys are the context (positions 0..S-1) then the block, query i stands at key position
kv_len - q_len + i; a layer is causal when config `is_causal` says so or, unset, when it is a sliding layer; a
causal layer hides keys after the query; a sliding window W hides keys W or more positions behind the query (and,
not causal, W or more ahead). Training draws many blocks at once, and each must see what decoding it alone sees.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings

import pytest
import torch

from dflash_stream.config import ConfigError, config_from_dict
from dflash_stream.drafter import (
    DFlashDrafter,
    DrafterSpec,
    build_spec,
    drafter_state,
    export_drafter,
    load_drafter,
)
from dflash_stream.drafter.export import zlab_config
from dflash_stream.drafter.model import attend
from dflash_stream.drafter.spec import spec_from_zlab_config
from dflash_stream.target_model import target_shape

FULL, SLIDING = "full_attention", "sliding_attention"
LAYERS = [1, 3, 5]


def zlab_visible(q_len: int, kv_len: int, layer_type: str, window: int | None, is_causal: bool | None = None
                 ) -> list[list[bool]]:
    """z-lab's decoding mask, from its source's rule (see the module docstring), in plain Python."""
    causal = (layer_type == SLIDING) if is_causal is None else is_causal
    window = window if layer_type == SLIDING else None
    rows = []
    for i in range(q_len):
        q = kv_len - q_len + i
        row = []
        for k in range(kv_len):
            ok = not (causal and k > q)
            if window is not None:
                ok = ok and q - k < window and (causal or k - q < window)
            row.append(ok)
        rows.append(row)
    return rows


def reference_training_mask(anchors: torch.Tensor, s: int, block_size: int, layer_type: str, window: int | None
                            ) -> torch.Tensor:
    """[N, 1, A*B, S + A*B]: block j (anchor a) sees, at training key indices, what z-lab's decoding mask shows
    it over the keys [context 0..a-1 ; its block] — and nothing of other blocks."""
    n, a_count = anchors.shape
    q_len = a_count * block_size
    mask = torch.zeros(n, 1, q_len, s + q_len, dtype=torch.bool)
    for b in range(n):
        for j, a in enumerate(anchors[b].tolist()):
            keys = list(range(a)) + [s + j * block_size + k for k in range(block_size)]
            rows = zlab_visible(block_size, len(keys), layer_type, window)
            for i, row in enumerate(rows):
                for key, ok in zip(keys, row, strict=True):
                    mask[b, 0, j * block_size + i, key] = ok
    return mask


def spec_of(layer_types: list[str] | None, window: int | None, **kw) -> DrafterSpec:
    base = dict(hidden_size=32, intermediate_size=48, num_layers=len(layer_types or ()), num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6, vocab_size=100,
                block_size=4, mask_token_id=99, target_layer_ids=[0, 1], num_target_layers=4,
                max_position_embeddings=512, layer_types=layer_types, sliding_window=window)
    return DrafterSpec(**{**base, **kw})


HYBRID = spec_of([SLIDING, FULL, SLIDING], 6)
ANCHORS = torch.tensor([[2, 9, 15], [0, 7, 20]])  # anchor 0: a block with no context at all
S = 26


def perturbed(drafter: DFlashDrafter, seed: int = 3) -> DFlashDrafter:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():  # RMSNorm weights start at 1; make every tensor matter
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return drafter.eval()


# ---------------------------------------------------------------------------- masks against z-lab's rule


@pytest.mark.parametrize("window", [None, 1, 3, 6, 40])
def test_training_mask_is_zlabs_rule(window):
    drafter = DFlashDrafter(HYBRID, attention="sdpa")
    layer_type = FULL if window is None else SLIDING
    got = drafter.block_mask(ANCHORS, S, window)
    want = reference_training_mask(ANCHORS, S, HYBRID.block_size, layer_type, window)
    assert torch.equal(got.expand_as(want), want)
    if window is None:  # a drafter without sliding layers keeps its own (original) mask code: the same mask
        assert torch.equal(DFlashDrafter(spec_of([FULL], None), attention="sdpa").block_mask(ANCHORS, S), got)


def test_sliding_rule_in_words():
    """W = 6, block 4 at anchor 9: slot k sees context 4 + k .. 8 and block slots 0..k."""
    mask = DFlashDrafter(HYBRID, attention="sdpa").block_mask(ANCHORS, S, 6)[0, 0]
    for k in range(4):
        row = mask[4 + k]  # block 1 of sequence 0
        assert row[:S].nonzero().flatten().tolist() == list(range(4 + k, 9))
        assert row[S:].nonzero().flatten().tolist() == [4 + i for i in range(k + 1)]


@pytest.mark.parametrize("is_causal", [None, True, False])
@pytest.mark.parametrize("layer_type", [FULL, SLIDING])
def test_export_modeling_default_mask_is_zlabs_rule(layer_type, is_causal):
    from dflash_stream.drafter.hf_modeling import default_mask

    causal = (layer_type == SLIDING) if is_causal is None else is_causal
    window = 5 if layer_type == SLIDING else None
    got = default_mask(4, 13, causal, window, torch.device("cpu"))
    want = torch.tensor(zlab_visible(4, 13, layer_type, 5, is_causal))
    assert torch.equal(got if got is not None else torch.ones_like(want), want)


@torch.no_grad()
@pytest.mark.parametrize("window", [None, 3, 6])
def test_attention_output_with_flex_and_sdpa_equals_reference(window):
    """Both kernels the trainer uses, under the drafter's masks, equal softmax attention masked by the
    reference rule (GQA 4:2)."""
    g = torch.Generator().manual_seed(0)
    n, q_len = ANCHORS.shape[0], ANCHORS.shape[1] * HYBRID.block_size
    q = torch.randn(n, 4, q_len, 8, generator=g)
    k, v = torch.randn(2, n, 2, S + q_len, 8, generator=g)
    ref_mask = reference_training_mask(ANCHORS, S, HYBRID.block_size, FULL if window is None else SLIDING, window)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) / 8**0.5
    want = scores.masked_fill(~ref_mask, float("-inf")).softmax(-1) @ v.repeat_interleave(2, dim=1)
    sdpa = attend(q, k, v, DFlashDrafter(HYBRID, attention="sdpa").block_mask(ANCHORS, S, window))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager (uncompiled) FlexAttention warns that it is slow
        flex = attend(q, k, v, DFlashDrafter(HYBRID, attention="flex").block_mask(ANCHORS, S, window))
    torch.testing.assert_close(sdpa, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile (inductor) on the CPU needs a C compiler")
@torch.no_grad()
def test_compiled_flex_builds_one_graph_for_both_layer_types():
    """On CUDA the trainer compiles FlexAttention once per length bucket (at most 8, torch's recompile limit):
    the full and the sliding layers' masks must share that graph, not double it. Inductor's CPU kernel stands
    in for the CUDA one here (forward only)."""
    from torch._dynamo.utils import counters

    from dflash_stream.drafter.model import _compiled_flex

    spec = spec_of([SLIDING, FULL], 6, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    drafter = DFlashDrafter(spec, attention="flex")
    g = torch.Generator().manual_seed(0)
    q_len = ANCHORS.shape[1] * spec.block_size
    q = torch.randn(2, 4, q_len, 64, generator=g)
    k, v = torch.randn(2, 2, 2, S + q_len, 64, generator=g)
    before = counters["stats"]["unique_graphs"]
    for shift in (0, 1):  # new anchors, same shapes: no new graph either
        for window, mask in drafter.block_masks(ANCHORS + shift, S).items():
            want = reference_training_mask(ANCHORS + shift, S, 4, FULL if window is None else SLIDING, window)
            scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) / 8
            ref = scores.masked_fill(~want, float("-inf")).softmax(-1) @ v.repeat_interleave(2, dim=1)
            torch.testing.assert_close(_compiled_flex()(q, k, v, block_mask=mask, enable_gqa=True), ref,
                                       atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] - before == 1


# ---------------------------------------------------------------------------- the whole drafter


def training_forward(drafter: DFlashDrafter, ctx: torch.Tensor, block_embeds: torch.Tensor) -> torch.Tensor:
    n, s, _ = ctx.shape
    positions = (ANCHORS[..., None] + torch.arange(drafter.spec.block_size)).flatten(1)
    context = drafter.context_kv(ctx, torch.arange(s).expand(n, s))
    return drafter(block_embeds.flatten(1, 2), positions, context, drafter.block_masks(ANCHORS, s))


@torch.no_grad()
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_training_forward_equals_drafting_each_block_alone(attention):
    """A hybrid drafter trained on many blocks at once sees, per block, what it sees when decoding that block
    after exactly its context (the decoding mask of each sliding layer built from the window alone)."""
    torch.manual_seed(0)
    drafter = perturbed(DFlashDrafter(HYBRID, attention=attention))
    g = torch.Generator().manual_seed(1)
    ctx = torch.randn(2, S, 2 * 32, generator=g)
    block_embeds = torch.randn(2, 3, 4, 32, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batched = training_forward(drafter, ctx, block_embeds).view(2, 3, 4, -1)
    for b in range(2):
        for j, a in enumerate(ANCHORS[b].tolist()):
            context = drafter.context_kv(ctx[b : b + 1, :a], torch.arange(a)[None])
            alone = drafter(block_embeds[b : b + 1, j], (a + torch.arange(4))[None], context)
            torch.testing.assert_close(batched[b, j], alone[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_sliding_layers_forget_context_beyond_the_window():
    torch.manual_seed(0)
    spec = spec_of([SLIDING, SLIDING], 4)
    drafter = perturbed(DFlashDrafter(spec, attention="sdpa"))
    ctx = torch.randn(1, 12, 64)
    emb = torch.randn(1, 4, 32)

    def draft(c: torch.Tensor) -> torch.Tensor:
        return drafter(emb, torch.arange(12, 16)[None], drafter.context_kv(c, torch.arange(12)[None]))

    ref = draft(ctx)
    far = ctx.clone()
    far[0, :9] += 5.0  # out of every slot's window (slot 0 at position 12 sees 9..12) in every layer
    torch.testing.assert_close(draft(far), ref)
    near = ctx.clone()
    near[0, 10] += 5.0  # slot 0 sees 9..12; slot 3 sees 12..15, but layer 2's slot 3 reads layer 1's slots 0..2
    assert not torch.allclose(draft(near)[0, 3], ref[0, 3])

    one = DFlashDrafter(spec_of([SLIDING], 4), attention="sdpa")
    one.load_state_dict(drafter.state_dict(), strict=False)
    ref = one(emb, torch.arange(12, 16)[None], one.context_kv(ctx, torch.arange(12)[None]))
    out = one(emb, torch.arange(12, 16)[None], one.context_kv(near, torch.arange(12)[None]))
    assert not torch.allclose(out[0, 0], ref[0, 0])
    torch.testing.assert_close(out[0, 3], ref[0, 3])  # one layer: slot 3 never sees position 10


def test_one_mask_cannot_serve_sliding_layers():
    drafter = DFlashDrafter(HYBRID, attention="sdpa")
    context = drafter.context_kv(torch.randn(1, 5, 64), torch.arange(5)[None])
    with pytest.raises(ValueError, match="block_masks"):
        drafter(torch.randn(1, 4, 32), torch.arange(5, 9)[None], context, torch.ones(1, 1, 4, 9, dtype=torch.bool))


@torch.no_grad()
def test_all_full_layout_is_todays_drafter():
    """Explicit all-full layer types build the very same drafter as specs without the keys."""
    old, new = spec_of(None, None, num_layers=2), spec_of([FULL, FULL], None)
    assert old == new
    torch.manual_seed(0)
    a = DFlashDrafter(old, attention="sdpa").eval()
    torch.manual_seed(0)
    b = DFlashDrafter(new, attention="sdpa").eval()
    ctx, emb = torch.randn(2, S, 64), torch.randn(2, 3, 4, 32)
    assert torch.equal(training_forward(a, ctx, emb), training_forward(b, ctx, emb))
    mask = a.block_masks(ANCHORS, S)
    assert list(mask) == [None] and torch.equal(mask[None], a.block_mask(ANCHORS, S))


# ---------------------------------------------------------------------------- spec, config, export


def test_old_spec_files_load_as_all_full():
    old = {k: v for k, v in dataclasses.asdict(spec_of([FULL] * 3, None)).items()
           if k not in ("layer_types", "sliding_window")}
    spec = DrafterSpec(**old)
    assert spec.layer_types == [FULL] * 3 and spec.sliding_window is None and spec.layer_windows == [None] * 3


def test_spec_rejects_bad_layouts():
    with pytest.raises(ConfigError, match="drafter.sliding_window is required"):
        spec_of([SLIDING, FULL], None)
    with pytest.raises(ConfigError, match="2 entries, drafter.num_layers is 3"):
        spec_of([SLIDING, FULL], 8, num_layers=3)
    with pytest.raises(ConfigError, match="unknown chunked_attention"):
        spec_of(["chunked_attention"], 8)


def run_config(tmp, target_dir, **drafter) -> object:
    return config_from_dict({
        "output_dir": str(tmp / "out"),
        "target": {"model": str(target_dir), "layer_ids": LAYERS},
        "data": {"sources": [{"path": "unused.jsonl"}], "max_length": 128},
        "store": {"path": str(tmp / "store"), "budget": "8MiB", "segment_bytes": 60_000},
        "drafter": {"num_layers": 2, "block_size": 4, "mask_token_id": 0, **drafter},
        "train": {"total_steps": 10},
    })


def test_config_keys_are_checked_at_load(tmp_path):
    with pytest.raises(ConfigError, match="layer_types has 1 entries, num_layers is 2"):
        run_config(tmp_path, "x", layer_types=[FULL])
    with pytest.raises(ConfigError, match="sliding_window is required"):
        run_config(tmp_path, "x", layer_types=[SLIDING, FULL])
    with pytest.raises(ConfigError, match="drafter.layer_types.0"):
        run_config(tmp_path, "x", layer_types=["global", FULL])
    with pytest.raises(ConfigError, match="drafter.sliding_window"):
        run_config(tmp_path, "x", layer_types=[SLIDING, FULL], sliding_window=0)
    cfg = run_config(tmp_path, "x", layer_types=[SLIDING, FULL], sliding_window=2048)
    assert cfg.drafter.layer_types == [SLIDING, FULL] and cfg.drafter.sliding_window == 2048


ZLAB_QWEN36_27B = {
    # z-lab's released Qwen3.6-27B drafter config, as SpecForge keeps a copy (configs/qwen3.6-27b-dflash.json).
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    "dtype": "bfloat16", "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 17408,
    "layer_types": [SLIDING] * 4 + [FULL], "max_position_embeddings": 262144, "max_window_layers": 5,
    "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8,
    "num_target_layers": 64, "rms_norm_eps": 1e-06, "sliding_window": 2048, "tie_word_embeddings": False,
    "use_sliding_window": True, "vocab_size": 248320, "rope_theta": 10000000, "rope_scaling": None,
}


def test_zlab_published_layout_round_trips():
    spec = spec_from_zlab_config(ZLAB_QWEN36_27B)
    assert spec.layer_types == [SLIDING] * 4 + [FULL] and spec.sliding_window == 2048
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (32, 8, 128)
    assert (spec.intermediate_size, spec.rope_theta, spec.rope_scaling) == (17408, 1e7, None)
    assert spec.mask_token_id == 248070 and spec.target_layer_ids == [1, 16, 31, 46, 61]
    config = zlab_config(spec)
    for key in ("layer_types", "sliding_window", "use_sliding_window", "max_window_layers", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "block_size",
                "dflash_config", "vocab_size", "hidden_size", "num_target_layers"):
        assert config[key] == ZLAB_QWEN36_27B[key], key
    assert "is_causal" not in config  # z-lab's default: sliding layers causal, full layers not
    assert spec_from_zlab_config(config) == spec


def test_layout_fields_of_zlab_configs():
    full = zlab_config(spec_of([FULL, FULL], None))
    assert (full["layer_types"], full["sliding_window"], full["use_sliding_window"]) == ([FULL] * 2, None, False)
    # Without layer_types, transformers' Qwen3Config rule: sliding from max_window_layers on.
    derived = {**ZLAB_QWEN36_27B, "layer_types": None, "max_window_layers": 3}
    assert spec_from_zlab_config(derived).layer_types == [FULL] * 3 + [SLIDING] * 2
    with pytest.raises(ConfigError, match="is_causal=False"):
        spec_from_zlab_config({**ZLAB_QWEN36_27B, "is_causal": False})
    assert spec_from_zlab_config({**ZLAB_QWEN36_27B, "layer_types": [SLIDING] * 5, "is_causal": True})


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()


def test_build_spec_with_layout_and_attention_widths(tiny_target_dir, tmp_path):
    cfg = run_config(tmp_path, tiny_target_dir, layer_types=[SLIDING, FULL], sliding_window=7,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=12, intermediate_size=40)
    spec = build_spec(cfg, target_shape(cfg.target, count=False), LAYERS)
    assert (spec.layer_types, spec.sliding_window) == ([SLIDING, FULL], 7)
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, spec.intermediate_size) == (8, 2, 12, 40)
    plain = build_spec(run_config(tmp_path, tiny_target_dir, sliding_window=7), target_shape(cfg.target, count=False),
                       LAYERS)
    assert plain.layer_types == [FULL, FULL] and plain.sliding_window is None  # no sliding layer, no window


@torch.no_grad()
def test_export_runs_the_same_layers_in_transformers(tiny_target_dir, tmp_path):
    """The export's dflash.py (AutoModel, trust_remote_code) gives our drafter's hidden states for a hybrid
    layout with its own heads/KV heads/head_dim/MLP, on a context longer than the window."""
    from transformers import AutoModel

    cfg = run_config(tmp_path, tiny_target_dir, layer_types=[SLIDING, FULL], sliding_window=5,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=12, intermediate_size=40)
    spec = build_spec(cfg, target_shape(cfg.target, count=False), LAYERS)
    torch.manual_seed(0)
    drafter = perturbed(DFlashDrafter(spec, attention="sdpa"))
    out = export_drafter(drafter, spec, tmp_path / "export")
    assert load_drafter(out)[1] == spec
    loaded = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    ctx = torch.randn(1, 11, 3 * 64)
    emb = torch.randn(1, 4, 64)
    ours = drafter(emb, torch.arange(11, 15)[None], drafter.context_kv(ctx, torch.arange(11)[None]))
    theirs = loaded(torch.arange(15)[None], emb, ctx)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    # A per-layer-type mask dict, as SpecForge passes: the reference masks give the same result.
    masks = {t: torch.tensor(zlab_visible(4, 15, t, 5))[None, None] for t in (FULL, SLIDING)}
    torch.testing.assert_close(loaded(torch.arange(15)[None], emb, ctx, attention_mask=masks), ours,
                               atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- init_from


@pytest.fixture(scope="module")
def published(tiny_target_dir, tmp_path_factory):
    """A hybrid drafter for the tiny target, exported (z-lab format) with its own architecture."""
    tmp = tmp_path_factory.mktemp("published")
    cfg = run_config(tmp, tiny_target_dir, layer_types=[SLIDING, FULL], sliding_window=6, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, intermediate_size=96, mask_token_id=3, rope_theta=5e5)
    spec = build_spec(cfg, target_shape(cfg.target, count=False), LAYERS)
    torch.manual_seed(1)
    drafter = perturbed(DFlashDrafter(spec))
    return export_drafter(drafter, spec, tmp / "drafter"), spec, drafter_state(drafter)


def new_trainer(cfg):
    from dflash_stream.observe.metrics import MetricsWriter
    from dflash_stream.pipeline.common import open_store
    from dflash_stream.pipeline.roles import RoleInfo
    from dflash_stream.pipeline.trainer import Trainer

    store = open_store(cfg, LAYERS, 64)
    return Trainer(cfg, RoleInfo("trainer", 0, 1, 0, 1), store, MetricsWriter(cfg.output_dir, "trainer", 0),
                   torch.device("cpu"))


def test_init_from_starts_from_the_exported_weights_and_architecture(published, tiny_target_dir, tmp_path):
    folder, spec, weights = published
    cfg = run_config(tmp_path, tiny_target_dir, init_from=str(folder), mask_token_id=None)
    trainer = new_trainer(cfg)
    try:
        assert trainer.spec == spec  # heads, MLP, layout, window, mask token and RoPE from its config.json
        state = drafter_state(trainer.drafter)
        assert state.keys() == weights.keys()
        for name, t in weights.items():
            assert torch.equal(state[name], t), name

        # Exactly-once resume wins: with a checkpoint in the run, init_from is ignored.
        with torch.no_grad():
            trainer.drafter.fc.weight.add_(1.0)
        trainer.steps = 1
        trainer._checkpoint("test")
        trainer._drain()  # durable before the next trainer starts (train.async_checkpoint writes in the background)
        trained = drafter_state(trainer.drafter)
    finally:
        trainer.close()
    resumed = new_trainer(cfg)
    try:
        assert torch.equal(drafter_state(resumed.drafter)["fc.weight"], trained["fc.weight"])
    finally:
        resumed.close()


@pytest.mark.parametrize(("drafter", "message"), [
    ({"block_size": 8}, "block_size 4 in {config}, this run 8"),
    ({"num_layers": 3}, "num_hidden_layers 2 in {config}, this run 3"),
    ({"layer_types": [FULL, FULL]}, "layer_types ['sliding_attention', 'full_attention'] in {config}, "
                                    "this run ['full_attention', 'full_attention']"),
    ({"sliding_window": 9}, "sliding_window 6 in {config}, this run 9"),
    ({"num_attention_heads": 4}, "num_attention_heads 2 in {config}, this run 4"),
    ({"intermediate_size": 64}, "intermediate_size 96 in {config}, this run 64"),
    ({"layer_ids": [1, 2, 5]}, "target_layer_ids [1, 3, 5] in {config}, this run [1, 2, 5]"),
])
def test_init_from_mismatches_name_both_values(published, tiny_target_dir, tmp_path, drafter, message):
    folder = published[0]
    layer_ids = drafter.pop("layer_ids", LAYERS)
    cfg = run_config(tmp_path, tiny_target_dir, init_from=str(folder), **drafter)
    with pytest.raises(ConfigError) as err:
        build_spec(cfg, target_shape(cfg.target, count=False), layer_ids)
    assert str(err.value) == "drafter.init_from: " + message.format(config=folder / "config.json")


def test_init_from_other_target_is_refused(published, tiny_target_dir, tmp_path):
    folder = tmp_path / "wide"
    folder.mkdir()
    config = json.loads((published[0] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 1000, "hidden_size": 32}))
    (folder / "model.safetensors").write_bytes((published[0] / "model.safetensors").read_bytes())
    cfg = run_config(tmp_path, tiny_target_dir, init_from=str(folder))
    with pytest.raises(ConfigError, match=r"vocab_size 1000 in .*config.json, this run 49152"):
        build_spec(cfg, target_shape(cfg.target, count=False), LAYERS)


def test_init_from_missing_folder_is_one_clear_line(tiny_target_dir, tmp_path):
    cfg = run_config(tmp_path, tiny_target_dir, init_from=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"drafter.init_from: .*nowhere/config.json not found; expected a z-lab"):
        build_spec(cfg, target_shape(cfg.target, count=False), LAYERS)


def test_init_weights_must_match_tensor_for_tensor(published, tmp_path):
    from safetensors.torch import load_file, save_file

    from dflash_stream.drafter.export import load_init_weights

    folder, spec, _ = published
    state = load_file(folder / "model.safetensors")
    for name, broken in (("missing", {k: v for k, v in state.items() if k != "norm.weight"}),
                         ("resized", {**state, "norm.weight": torch.ones(3)})):
        (tmp_path / name).mkdir()
        save_file(broken, tmp_path / name / "model.safetensors")
    with pytest.raises(ConfigError, match="model.safetensors lacks norm.weight"):
        load_init_weights(DFlashDrafter(spec), tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"norm.weight is \[3\] in .*, this run \[64\]"):
        load_init_weights(DFlashDrafter(spec), tmp_path / "resized")


def test_hybrid_drafter_trains_through_the_loss(tiny_target_dir, tmp_path):
    from dflash_stream.drafter import dflash_loss, load_target_head

    cfg = run_config(tmp_path, tiny_target_dir, layer_types=[SLIDING, FULL], sliding_window=3)
    spec = build_spec(cfg, target_shape(cfg.target, count=False), LAYERS)
    drafter, head = DFlashDrafter(spec, attention="sdpa"), load_target_head(cfg.target, "cpu")
    ids = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"hidden_states": torch.randn(2, 16, 3 * 64), "input_ids": ids,
             "loss_mask": torch.ones(2, 16, dtype=torch.bool), "lengths": torch.tensor([16, 16])}
    out = dflash_loss(drafter, head, batch, num_anchors=4, gamma=7.0)
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(p.grad is not None for p in drafter.parameters())
