"""Every target family DFlash drafters are published for, end to end: plan, run (regenerate, extract, train,
export, eval) and audit on tiny random-weight models built from transformers' config classes and saved as their
hub checkpoints are (VLM wrappers included); and captured states of a padded batch equal each sample alone."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from test_pipeline import write_run_config

from dflash_stream.bench.tiny_targets import FAMILIES, save_target
from dflash_stream.cli import main
from dflash_stream.config import GenerationConfig, TargetConfig
from dflash_stream.drafter.export import load_drafter
from dflash_stream.pipeline.audit import audit_run
from dflash_stream.target_model import load_target, resolve_layer_ids, target_shape
from dflash_stream.target_model.capture import LayerCapture
from dflash_stream.target_model.generate import generate_responses, generate_with_states

DEMO_DATA = Path(__file__).parent.parent / "dflash_stream" / "demo_data"
FAST = ("qwen3_5", "qwen3_next")  # the headline target as saved (a VLM wrapper), and a hybrid text model
PARAMS = [pytest.param(f, marks=() if f in FAST else pytest.mark.slow) for f in FAMILIES]
OTHER_DRAFTERS = {
    "qwen3_next": {"drafter.kind": "dflash2", "train.loss": "kl", "drafter.selector_rank": 16},
    "gemma3": {"drafter.kind": "dflash2", "train.loss": "ce+kl"},  # its embedding scale: vLLM's input_embedding_scale
    "gpt_oss": {"train.loss": "kl"},
}
"""Families that train another drafter or loss than DFlash with cross-entropy (issue 35), the stream the same."""
VERIFIER_FAST = ("llama", "gemma3", "qwen3_5", "qwen3_next")
"""The final norms and names that differ: plain RMSNorm, Gemma's and Qwen3.5's 1 + weight, VLM wrappers' nesting."""
LAYER_KINDS = {
    "qwen3_5": {"linear_attention": 4, "full_attention": 2},
    "qwen3_next": {"linear_attention": 4, "full_attention": 2},
    "gemma3": {"sliding_attention": 3, "full_attention": 3},
    "gemma4": {"sliding_attention": 4, "full_attention": 2},
    "mistral": {"sliding_attention": 6},
    "llama": {"full_attention": 6},
}


@pytest.fixture(scope="module")
def targets(demo_tokenizer_dir, tmp_path_factory) -> Iterator[dict[str, Path]]:
    """Each family saved once per module, lazily; removed after it (~400 MB in all, which a CI disk may lack)."""
    root = tmp_path_factory.mktemp("families")

    class Lazy(dict):
        def __missing__(self, family: str) -> Path:
            self[family] = save_target(family, root / family, demo_tokenizer_dir)
            return self[family]

    yield Lazy()
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("family", PARAMS)
def test_family_plans_runs_exports_evaluates_and_audits(family, targets, tmp_path, capsys):
    target = targets[family]
    config = write_run_config(
        tmp_path, target, rows=12, **{
            "data.regenerate": True, "data.generation": {"max_new_tokens": 24, "batch_size": 4},
            "data.min_supervised_tokens": 4, "data.max_length": 80, "train.epochs": 1,
            "eval.prompts": str(DEMO_DATA / "heldout_prompts.jsonl"), "eval.num_prompts": 2,
            "eval.max_new_tokens": 24, **OTHER_DRAFTERS.get(family, {}),
        })
    assert main(["plan", "--config", str(config), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["target"]["num_layers"] == 6 and plan["target"]["hidden_size"] == 64
    assert plan["target"]["model_type"] == FAMILIES[family][0]
    assert sum(plan["target"]["layer_types"].values()) == 6
    if family in LAYER_KINDS:
        assert plan["target"]["layer_types"] == LAYER_KINDS[family]
    assert 0 < plan["target"]["active_parameters"] <= plan["target"]["num_parameters"]

    assert main(["run", "--config", str(config)]) == 0
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples_trained"] == summary["samples_extracted"] > 0
    assert summary["eval"]["matches_target"] is True, summary["eval"]
    assert audit_run(out)["ok"]
    _, spec = load_drafter(summary["checkpoint"])  # the exported drafter
    assert spec.hidden_size == 64 and spec.target_layer_ids == [1, 2, 3]
    assert spec.kind == OTHER_DRAFTERS.get(family, {}).get("drafter.kind", "dflash")
    # The drafter's heads are as wide as the target's (MLA: its value heads, not the narrow RoPE part).
    assert spec.head_dim == (32 if family == "deepseek_v3" else 16)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_batch_captures_each_sample_as_alone(family, targets):
    """Right padding (the extractor's) must not leak into a sample's states, recurrent and windowed layers
    included: float32 outputs of every captured layer agree with the sample run alone."""
    cfg = TargetConfig(model=str(targets[family]), dtype="float32", device="cpu", num_capture_layers=3)
    model, tokenizer = load_target(cfg, torch.device("cpu"))
    layer_ids = resolve_layer_ids(target_shape(cfg).num_layers, cfg)
    capture = LayerCapture(model, layer_ids)
    gen = torch.Generator().manual_seed(1)
    lengths = [37, 9, 22]  # longer and shorter than the sliding windows
    rows = [torch.randint(3, 49152, (n,), generator=gen) for n in lengths]
    ids = torch.full((3, max(lengths)), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    batched = capture(ids, mask)
    for i, row in enumerate(rows):
        alone = capture(row[None], torch.ones(1, len(row), dtype=torch.long))[0]
        # Captured as bf16: equal float32 states round to the same bf16 value, up to one ulp at a rounding edge.
        torch.testing.assert_close(batched[i, : len(row)].float(), alone.float(), rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_states_recorded_while_generating_are_the_capture_forwards(family, targets):
    """In-process regeneration records the states as the answers decode: left-padded prompts, then one token a
    step through the KV cache (or the recurrent state). Each row's states equal the capture forward over its
    prompt + answer to bf16 rounding, every family's layers included, the answers are `generate_responses`'
    own, and a row that stops early has its stop token's states too."""
    cfg = TargetConfig(model=str(targets[family]), dtype="float32", device="cpu", num_capture_layers=3)
    model, tokenizer = load_target(cfg, torch.device("cpu"))
    capture = LayerCapture(model, resolve_layer_ids(target_shape(cfg).num_layers, cfg))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).numpy().astype(np.int32) for n in (19, 7, 12)]
    free = generate_responses(model, tokenizer, prompts, GenerationConfig(), max_new_tokens=6)
    # The third token the second row generates becomes a stop token: that row ends early, the others run on.
    model.generation_config.eos_token_id = free[1][2]
    answers = generate_responses(model, tokenizer, prompts, GenerationConfig(), max_new_tokens=6)
    recorded = generate_with_states(model, tokenizer, prompts, GenerationConfig(), 6, capture)
    assert [r for r, _ in recorded] == answers
    assert answers[1] == free[1][: free[1].index(free[1][2]) + 1] and len(max(answers, key=len)) == 6
    for prompt, (answer, states) in zip(prompts, recorded, strict=True):
        ids = torch.from_numpy(np.concatenate([prompt, np.asarray(answer, dtype=np.int32)]).astype(np.int64))
        alone = capture(ids[None], torch.ones(1, len(ids), dtype=torch.long))[0]
        torch.testing.assert_close(states.float(), alone.float(), rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in VERIFIER_FAST else pytest.mark.slow)
                                    for f in FAMILIES])
def test_verifier_state_through_the_final_norm_and_head_is_the_targets_logits(family, targets):
    """With the verifier's state the capture adds the last decoder layer, pre-norm (vLLM's aux layer id =
    num_layers), after the K layers; the target's final norm and LM head, read alone from its weight files
    (Gemma's and Qwen3.5's 1 + weight norms, wrappers' nested names), turn it into the target's own logits."""
    from dflash_stream.drafter import load_target_head
    from dflash_stream.target_model import stored_layer_ids

    cfg = TargetConfig(model=str(targets[family]), dtype="float32", device="cpu", num_capture_layers=3)
    model, _ = load_target(cfg, torch.device("cpu"))
    layers = target_shape(cfg).num_layers
    ids = stored_layer_ids(layers, cfg, verifier=True)
    assert ids == [*resolve_layer_ids(layers, cfg), layers - 1]
    last: list[torch.Tensor] = []
    hook = model.get_decoder().layers[-1].register_forward_hook(
        lambda module, args, out: last.append(out[0] if isinstance(out, tuple) else out))
    rows = torch.randint(3, 49152, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(rows).logits.float()
    hook.remove()
    states = LayerCapture(model, ids)(rows, torch.ones_like(rows))
    assert states.shape[-1] == len(ids) * 64
    assert torch.equal(states[..., -64:], last[0].to(torch.bfloat16))
    head = load_target_head(cfg, "cpu", verifier=True)
    with torch.no_grad():
        ours = head.teacher_logits(head.verifier_normed(last[0]))
    torch.testing.assert_close(ours, logits, rtol=1e-5, atol=1e-5)


def test_a_moe_target_without_a_dense_mlp_gets_a_drafter(targets, tmp_path):
    """Qwen3.5/3.6-MoE configs name their experts' widths and no dense `intermediate_size` (the tiny one is
    built so): the drafter's MLP defaults to 3 x hidden, as z-lab's Qwen3.5-35B-A3B drafter (2048 -> 6144), the
    drafter builds, and `plan` sizes the same drafter."""
    from dflash_stream.config import load_config
    from dflash_stream.drafter import DFlashDrafter, build_spec
    from dflash_stream.sizing.memory import drafter_dims, target_dims

    config = write_run_config(tmp_path, targets["qwen3_5_moe"], rows=4)
    cfg = load_config(config)
    shape = target_shape(cfg.target, count=False)
    assert shape.intermediate_size is None  # as the hub config
    layer_ids = resolve_layer_ids(shape.num_layers, cfg.target)
    spec = build_spec(cfg, shape, layer_ids)
    assert spec.intermediate_size == 3 * 64
    drafter = DFlashDrafter(spec)
    assert sum(p.numel() for p in drafter.parameters()) == \
        drafter_dims(cfg, target_dims(shape), len(layer_ids)).num_parameters
