"""Speculative decoding on hybrid targets: rejected drafts are rolled back in sliding-window and Gated-DeltaNet
layers too, so the output stays the target's greedy output token for token (prompts longer than the windows)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dflash_stream.bench.tiny_targets import VOCAB, WINDOW, build_config
from dflash_stream.config import config_from_dict
from dflash_stream.drafter import DFlashDrafter, build_spec, export_drafter
from dflash_stream.drafter import speculative as spec_module
from dflash_stream.drafter.head import TargetHead
from dflash_stream.drafter.speculative import greedy_generate, replay_generate, speculative_generate
from dflash_stream.target_model.shape import shape_from_config

BLOCK = 4
LAYERS = [1, 3, 4]
PROMPT_LEN = 2 * WINDOW + 3  # past every sliding window before the first draft
NEW_TOKENS = 40
# Accepted drafts per step the oracle aims for: partial (0 < n < B-1), none and all (n = B-1) rejections.
SCHEDULE = [1, BLOCK - 1, 0, 2, BLOCK - 1, BLOCK - 1, 1]
HYBRID = ["qwen3_5", "qwen3_5_text", "qwen3_next", "mistral", "gemma3_text", "gemma3", "gpt_oss"]


def make_target(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random target whose greedy output varies: scaled-up matrices, or a random Llama-style model keeps
    repeating one token and a wrong rollback could go unnoticed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(build_config(family)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(4.0)
    return model


def make_drafter(target: torch.nn.Module) -> DFlashDrafter:
    cfg = config_from_dict({
        "output_dir": "unused", "target": {"model": "unused", "layer_ids": LAYERS},
        "data": {"sources": [{"path": "unused.jsonl"}]}, "store": {"path": "unused", "budget": "1GB"},
        "drafter": {"num_layers": 1, "block_size": BLOCK, "mask_token_id": VOCAB - 1},
    })
    spec = build_spec(cfg, shape_from_config(target.config, "test", count=False), LAYERS)
    torch.manual_seed(1)
    return DFlashDrafter(spec).eval()


def prompt(seed: int = 2) -> torch.Tensor:
    return torch.randint(3, VOCAB - 1, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def oracle(reference: list[int], steps: list[int]) -> Callable[..., torch.Tensor]:
    """A drafter stand-in that knows the target's greedy continuation (`reference`: prompt + output) and spoils
    it after SCHEDULE[step] tokens, so that every rollback depth is exercised at known steps."""

    def draft(drafter, head, block, positions, context):
        start = int(positions[0, 0])  # absolute position of the block's first (already accepted) token
        want = SCHEDULE[len(steps) % len(SCHEDULE)]
        steps.append(want)
        guess = (reference[start + 1 : start + BLOCK] + [0] * BLOCK)[: BLOCK - 1]  # padded past the end
        if want < BLOCK - 1:
            guess[want] = (guess[want] + 1) % VOCAB  # never the target's token
        return torch.tensor(guess)

    return draft


@pytest.fixture(scope="module", params=HYBRID + ["qwen3"])
def family_target(request):
    return request.param, make_target(request.param)


def test_oracle_drafts_roll_back_exactly(family_target, monkeypatch):
    """Every rollback depth, in windows already full and after GDN state updates: output = greedy output."""
    family, target = family_target
    drafter = make_drafter(target)
    head = TargetHead.from_model(target)
    ids = prompt()
    base = greedy_generate(target, ids, NEW_TOKENS, set())
    assert len(set(base.tokens)) > 5, f"{family}: the target's greedy output is degenerate: {base.tokens}"
    steps: list[int] = []
    monkeypatch.setattr(spec_module, "_draft", oracle(ids[0].tolist() + base.tokens, steps))
    fast = speculative_generate(target, drafter, head, ids, NEW_TOKENS, set())
    assert fast.tokens == base.tokens, family
    # The oracle's plan was carried out (the last step may be cut by max_new_tokens).
    assert fast.accepted[:-1] == steps[: len(fast.accepted) - 1]
    assert {0, 1, BLOCK - 1} <= set(fast.accepted)


@pytest.mark.parametrize("family", ["qwen3_5", "mistral"])
def test_replay_on_another_answer_takes_its_verdicts_from_that_answer(family, monkeypatch):
    """An engine's answer that parts from the target's greedy one after 10 tokens: the replay emits that answer,
    and each step accepts what the drafts share with it (the oracle drafts it, spoiled on schedule), as though
    the target had answered so; on the target's own answer it takes speculative decoding's steps."""
    target = make_target(family)
    drafter, head, ids = make_drafter(target), TargetHead.from_model(target), prompt()
    base = greedy_generate(target, ids, NEW_TOKENS, set())
    foreign = torch.randint(3, VOCAB - 1, (NEW_TOKENS,), generator=torch.Generator().manual_seed(5)).tolist()
    answer = base.tokens[:10] + [t for t in foreign if t != base.tokens[10]][: NEW_TOKENS - 10]
    runs = {}
    for name, path in (("own", base.tokens), ("engine's", answer), ("speculative", None)):
        steps: list[int] = []
        monkeypatch.setattr(spec_module, "_draft", oracle(ids[0].tolist() + (path or base.tokens), steps))
        if path is None:
            runs[name] = speculative_generate(target, drafter, head, ids, NEW_TOKENS, set())
            continue
        runs[name] = replay_generate(target, drafter, head, ids, path, NEW_TOKENS, set())
        assert runs[name].tokens == path, (family, name)
        assert runs[name].accepted[:-1] == steps[: len(runs[name].accepted) - 1], (family, name)
    assert runs["own"].accepted == runs["speculative"].accepted, family


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text"])
def test_untrained_drafter_matches_greedy(family):
    """The real drafter path (embeddings as the engine feeds them, context KV) on a hybrid target."""
    target = make_target(family)
    drafter = make_drafter(target)
    ids = prompt(3)
    base = greedy_generate(target, ids, NEW_TOKENS, set())
    fast = speculative_generate(target, drafter, TargetHead.from_model(target), ids, NEW_TOKENS, set())
    assert fast.tokens == base.tokens


def test_head_embeds_as_the_target_does():
    """Gemma scales its embeddings inside the module: the frozen head must give the drafter the same rows."""
    for family in ("gemma3_text", "qwen3_5"):
        target = make_target(family)
        head = TargetHead.from_model(target)
        ids = torch.arange(0, 200, 7)[None]
        torch.testing.assert_close(head.embed(ids), target.get_input_embeddings()(ids), rtol=0, atol=0)


def test_export_spec_generate_on_hybrid_target(tmp_path, monkeypatch):
    """The exported dflash.py rolls hybrid caches back too: first with the exported drafter itself, then with
    oracle drafts (its forward and the target's LM head replaced) that reach every rollback depth."""
    from transformers import AutoModel

    target = make_target("qwen3_5")
    drafter = make_drafter(target)
    loaded = AutoModel.from_pretrained(export_drafter(drafter, drafter.spec, tmp_path / "export"),
                                       trust_remote_code=True).eval()
    ids = prompt(4)
    base = greedy_generate(target, ids, NEW_TOKENS, set())
    got = loaded.spec_generate(target, ids, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    assert got[0, PROMPT_LEN:].tolist() == base.tokens

    steps: list[int] = []
    draft = oracle(ids[0].tolist() + base.tokens, steps)
    starts: list[int] = []

    def fake_forward(position_ids, noise_embedding, target_hidden, **kwargs):
        starts.append(position_ids.shape[1] - BLOCK)  # the block's first position
        return noise_embedding

    def fake_head(hidden):
        guess = draft(None, None, None, torch.tensor([[starts[-1]]]), None)
        return torch.nn.functional.one_hot(guess, VOCAB).float()[None]

    monkeypatch.setattr(loaded, "forward", fake_forward)
    monkeypatch.setattr(target, "get_output_embeddings", lambda: fake_head)
    got = loaded.spec_generate(target, ids, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    assert got[0, PROMPT_LEN:].tolist() == base.tokens
    assert len(steps) < NEW_TOKENS // 2  # drafts were accepted, several blocks at a time


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_text", "qwen3_next", "gemma3", "mistral"])
def test_padded_regeneration_equals_each_prompt_alone(family):
    """Left padding in a batch changes nothing under greedy decoding: Gated-DeltaNet layers zero the padded
    positions' inputs (their recurrent and convolution states stay at zero), windows count real tokens."""
    from types import SimpleNamespace

    from dflash_stream.config import GenerationConfig
    from dflash_stream.target_model.generate import generate_responses

    model = make_target(family)
    model.generation_config.eos_token_id = None  # full-length answers: every position is compared
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=rng).numpy() for n in (2 * WINDOW + 8, 9, WINDOW + 7)]
    batched = generate_responses(model, tokenizer, prompts, GenerationConfig(), max_new_tokens=16)
    alone = [generate_responses(model, tokenizer, [p], GenerationConfig(), max_new_tokens=16)[0] for p in prompts]
    assert batched == alone and all(len(r) == 16 for r in batched)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text"])
def test_baseline_calls_the_target_as_verification_does(family, monkeypatch):
    """The speedup's baseline (`verify_block`) decodes the target's greedy tokens through the calls a verification
    makes: a Gated-DeltaNet layer then never takes its one-token convolution-update path, which a plain decoding
    loop takes and the verification loop cannot (its layers record their states for rollback)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    updates: list[int] = []
    original = modeling_qwen3_5.causal_conv1d_update

    def counted(*args, **kwargs):
        updates.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(modeling_qwen3_5, "causal_conv1d_update", counted)
    target = make_target(family)
    ids = prompt(6)
    plain = greedy_generate(target, ids, 12, set())
    plain_updates = len(updates)
    mirrored = greedy_generate(target, ids, 12, set(), verify_block=BLOCK)
    assert mirrored.tokens == plain.tokens
    assert len(updates) == plain_updates  # none in the mirrored decode
    if family == "qwen3_5":
        assert plain_updates > 0
