"""Speculative evaluation: output identical to the target's greedy output, reports, and evidence of learning."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from dflash_stream.config import ConfigError, TargetConfig, config_from_dict
from dflash_stream.drafter import (
    DFlashDrafter,
    build_spec,
    dflash_loss,
    evaluate,
    export_drafter,
    load_target_head,
)
from dflash_stream.drafter.evaluate import (
    Evaluator,
    _stderr,
    read_prompts,
    relative_difference,
    render_prompt,
    run_summary,
    stop_token_ids,
)
from dflash_stream.drafter.head import TargetHead
from dflash_stream.drafter.speculative import greedy_generate, replay_generate, speculative_generate
from dflash_stream.target_model import model_shape, target_shape

LAYERS = [1, 3, 5]
PROMPTS = [
    {"prompt": "Write a haiku about rain."},
    {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]},
    {"prompt": "Name three colours."},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Explain gravity."}]},
]


@pytest.fixture(scope="module")
def chaotic_target_dir(tiny_target_dir, tmp_path_factory):
    """The tiny target with its matrices scaled up: at the default init a random Llama greedily repeats one
    token, which would make drafting trivial; scaled, its greedy output varies with the prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(6.0)
    out = tmp_path_factory.mktemp("chaotic-target")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_target_dir).save_pretrained(out)
    return out


def make_cfg(target_dir):
    return config_from_dict({
        "output_dir": "unused",
        "target": {"model": str(target_dir), "layer_ids": LAYERS, "device": "cpu"},
        "data": {"sources": [{"path": "unused.jsonl"}]},
        "store": {"path": "unused", "budget": "1GB"},
        "drafter": {"num_layers": 1, "block_size": 4},
    })


@pytest.fixture(scope="module")
def setup(chaotic_target_dir, tmp_path_factory):
    cfg = make_cfg(chaotic_target_dir)
    spec = build_spec(cfg, target_shape(cfg.target, count=False), LAYERS)
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec)
    untrained = export_drafter(drafter, spec, tmp_path_factory.mktemp("untrained"))
    return cfg, spec, drafter, untrained


REQUIRED = {"acceptance_length", "matches_target", "speedup", "prompts", "acceptance_histogram"}
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def untrained_result(setup):
    cfg, _, _, untrained = setup
    return evaluate(cfg, untrained, PROMPTS, NEW_TOKENS)


def test_untrained_drafter_reproduces_target_greedy(untrained_result):
    result = untrained_result
    assert set(result) >= REQUIRED
    assert result["matches_target"] and all(p["matches_target"] for p in result["prompts"])
    assert len(result["prompts"]) == 4 and all(p["new_tokens"] == NEW_TOKENS for p in result["prompts"])
    assert result["acceptance_length"] == pytest.approx(1.0)  # random drafts are never accepted
    assert sum(result["acceptance_histogram"]) == 4 * (NEW_TOKENS - 1) and len(result["acceptance_histogram"]) == 4


def test_overfit_drafter_accepts_and_stays_exact(setup, untrained_result, chaotic_target_dir, tmp_path):
    """Evidence it learns: trained on the target's own answers to a few prompts, the drafter's acceptance
    length on those prompts rises well above the untrained drafter's, and the output stays the target's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, spec, drafter, _ = setup
    target = AutoModelForCausalLM.from_pretrained(chaotic_target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(chaotic_target_dir)
    stops = stop_token_ids(target, tokenizer)
    pairs = []
    for row in PROMPTS:
        prompt = render_prompt(tokenizer, row)
        pairs.append((prompt, greedy_generate(target, torch.tensor([prompt]), NEW_TOKENS, stops).tokens))

    n, s = len(pairs), max(len(p) + len(r) for p, r in pairs)
    input_ids = torch.zeros(n, s, dtype=torch.long)
    loss_mask = torch.zeros(n, s, dtype=torch.bool)
    for i, (prompt, response) in enumerate(pairs):
        input_ids[i, : len(prompt) + len(response)] = torch.tensor(prompt + response)
        loss_mask[i, len(prompt) : len(prompt) + len(response)] = True
    with torch.no_grad():
        states = target(input_ids, output_hidden_states=True).hidden_states
    batch = {
        "hidden_states": torch.cat([states[i + 1] for i in LAYERS], dim=-1).to(torch.bfloat16),
        "input_ids": input_ids, "loss_mask": loss_mask, "lengths": torch.tensor([len(p) + len(r) for p, r in pairs]),
    }
    head = load_target_head(cfg.target, "cpu")
    model = DFlashDrafter(spec)
    model.load_state_dict(drafter.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        out = dflash_loss(model, head, batch, num_anchors=64, gamma=7.0, generator=generator)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    trained = export_drafter(model, spec, tmp_path / "trained")

    # One Evaluator for both drafters, as `bench quality` compares them: the target's outputs are reused.
    evaluator = Evaluator(cfg, PROMPTS)
    after = evaluator.evaluate(trained, NEW_TOKENS)
    again = evaluator.evaluate(setup[3], NEW_TOKENS)
    assert after["matches_target"] and again["matches_target"]
    assert untrained_result["acceptance_length"] < 1.2
    assert after["acceptance_length"] > 2.5, after["acceptance_histogram"]
    assert again["acceptance_histogram"] == untrained_result["acceptance_histogram"]
    assert again["target_s"] == after["target_s"]  # the target ran once per prompt
    assert after["acceptance_stderr"] > 0 and untrained_result["acceptance_stderr"] == 0
    # Replayed on the target's own answers (as on an engine's that equals ours), the trained drafter takes the
    # steps speculative decoding took: the states of one forward over the answer stand for the verification's.
    model.eval()
    for ids in evaluator.encoded:
        fast = speculative_generate(evaluator.target, model, evaluator.head, ids, NEW_TOKENS, evaluator.stops)
        replay = replay_generate(evaluator.target, model, evaluator.head, ids, fast.tokens, NEW_TOKENS,
                                 evaluator.stops)
        assert (replay.tokens, replay.accepted) == (fast.tokens, fast.accepted)


def test_tau_standard_error_is_over_prompts():
    # tau = 30 / 20 = 1.5; residuals -5 and +5; sqrt(2 / 1 * 50) / 20 = 0.5
    assert _stderr([10, 20], [10, 10]) == pytest.approx(0.5)
    assert _stderr([10, 10], [10, 10]) == 0.0
    assert _stderr([10], [10]) is None


def test_prompt_files(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in PROMPTS) + "\n\n")
    assert read_prompts(path) == PROMPTS
    path.write_text(json.dumps(PROMPTS[0]) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"prompts.jsonl:2: not valid JSON"):
        read_prompts(path)
    with pytest.raises(ConfigError, match="prompts file not found"):
        read_prompts(tmp_path / "missing.jsonl")


def test_render_prompt_drops_reference_answer(tiny_target_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    text = tokenizer.decode(render_prompt(tokenizer, PROMPTS[1]))
    assert "What is 2+2?" in text and text.rstrip().endswith("assistant") and "4<|im_end|>" not in text
    with pytest.raises(ConfigError, match="no_user_turn"):
        render_prompt(tokenizer, {"messages": [{"role": "assistant", "content": "hi"}]})


def test_eval_command_json(setup, tmp_path, capsys):
    from dflash_stream.cli import main

    cfg, _, _, untrained = setup
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in PROMPTS[:2]))
    args = ["eval", "--drafter", str(untrained), "--config", str(config), "--prompts", str(prompts),
            "--max-new-tokens", "6", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= REQUIRED and result["matches_target"] and len(result["prompts"]) == 2
    assert main(args[:-1] + ["--eval.num_prompts=1"]) == 0
    assert "acceptance length tau" in capsys.readouterr().out


@pytest.mark.slow
def test_head_from_gguf_matches_transformers(demo_model, demo_target):
    """The frozen head read from the GGUF file alone equals what transformers loads with the whole model."""
    folder, gguf = demo_model
    model = demo_target[0]
    head = load_target_head(TargetConfig(model=str(folder), gguf_file=gguf), "cpu")
    assert head.embed_weight.shape == (49152, 576)
    torch.testing.assert_close(head.embed_weight, model.get_input_embeddings().weight)
    torch.testing.assert_close(head.lm_head_weight, model.get_output_embeddings().weight)


@pytest.mark.slow
def test_real_target_output_is_identical(demo_model, demo_target):
    """On SmolLM2 (GGUF), speculative decoding reproduces the target's greedy tokens exactly."""
    folder, gguf = demo_model
    target, tokenizer = demo_target
    cfg = config_from_dict({
        "output_dir": "unused", "target": {"model": str(folder), "gguf_file": gguf, "num_capture_layers": 5},
        "data": {"sources": [{"path": "unused.jsonl"}]}, "store": {"path": "unused", "budget": "1GB"},
        "drafter": {"num_layers": 1, "block_size": 8},
    })
    spec = build_spec(cfg, model_shape(target), [1, 7, 14, 20, 27], tokenizer)
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec).eval()
    head = TargetHead.from_model(target)
    stops = stop_token_ids(target, tokenizer)
    ids = torch.tensor([render_prompt(tokenizer, PROMPTS[3])])
    base = greedy_generate(target, ids, 12, stops)
    fast = speculative_generate(target, drafter, head, ids, 12, stops)
    assert fast.tokens == base.tokens and len(base.tokens) > 1


def test_an_engines_answer_other_than_ours_is_replayed(setup, monkeypatch):
    """Where the engine's answer parts from our loop's, our τ beside the engine's is drafted on the engine's answer
    (`on_engine_answers`): here an untrained drafter, which accepts nothing, takes one step per token of each
    answer, ours on the first prompt and the engine's own on the second."""
    from dflash_stream.drafter.commands import engine_table

    cfg, _, _, untrained = setup
    evaluator = Evaluator(cfg, PROMPTS[:2])
    mine = [greedy_generate(evaluator.target, ids, NEW_TOKENS, evaluator.stops).tokens for ids in evaluator.encoded]
    foreign = [t for t in range(10, 10 + NEW_TOKENS + 1) if t not in evaluator.stops and t != mine[1][0]]
    answers = [mine[0], [mine[1][0], *foreign[: NEW_TOKENS - 1]]]
    steps = [len(a) - 1 for a in answers]
    served = {"acceptance_length": 1.0, "per_position": [0, 0, 0], "drafts": sum(steps), "accepted_tokens": 0,
              "answers_as_target": 1, "matches_target": False,
              "prompts": [{"index": i, "verify_steps": s, "accepted": 0, "as_target": i == 0, "answer": a}
                          for i, (s, a) in enumerate(zip(steps, answers, strict=True))]}
    monkeypatch.setattr(Evaluator, "served", lambda self, *args: served)
    result = evaluator.evaluate(untrained, NEW_TOKENS, engine="sglang", endpoint="http://unused:1")
    mirrored = result["on_engine_answers"]
    assert (mirrored["engine"], mirrored["prompts"], mirrored["replayed"]) == ("sglang", 2, 1)
    assert mirrored["ours"] == {"acceptance_length": 1.0, "per_position": [0, 0, 0], "drafts": sum(steps),
                                "accepted_tokens": 0}
    assert mirrored["sglang"]["drafts"] == sum(steps) and mirrored["agree"] is True
    assert engine_table(result)[-1] == ("on SGLang's own answers (1 of 2 prompts replayed): tau 1.000 ours, 1.000 "
                                        "SGLang (+0.00 %, within 2 %: True)")
    # The run summary carries the engine's τ beside ours, on its own answers too.
    summary = run_summary(result)
    assert summary["engine"] == {"name": "sglang", "acceptance_length": 1.0,
                                 "relative_difference": relative_difference(1.0, result["acceptance_length"]),
                                 "agree": result["engines_agree"]}
    assert summary["on_engine_answers"] == {"replayed": 1, "prompts": 2, "ours": 1.0, "sglang": 1.0,
                                            "relative_difference": 0.0, "agree": True}
    assert set(run_summary({**result, "engines": {"ours": {}}, "on_engine_answers": None})) == {
        "acceptance_length", "matches_target", "speedup"}
