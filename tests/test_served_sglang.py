"""`eval --engine sglang`: τ read from an SGLang server's per-request counts, in the schema SGLang 0.5.23 answers
(`/server_info`; `/generate`'s `output_ids` and `meta_info`). The server here is a stand-in that answers as SGLang
does; the reading was checked against SGLang itself (patched to run on this CPU): τ 1.890 in both, per position
identical (docs/engines.md)."""

from __future__ import annotations

import pytest
from json_endpoint import json_endpoint, url

from dflash_stream.bench.tiny_targets import build_config
from dflash_stream.config import TargetConfig
from dflash_stream.drafter.evaluate import same_answers, same_answers_line
from dflash_stream.drafter.served import EngineError, ServedEval
from dflash_stream.drafter.served_sglang import sglang_eval

BLOCK = 4
STOP = 2
INFO = {"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": BLOCK,
        "speculative_draft_model_path": "/models/drafter", "version": "0.5.23"}
PROMPTS = [[5, 6, 7], [8, 9]]
REFERENCES = [[10, 11, 12, 13, 14], [20, 21, STOP]]
# Per prompt, what SGLang answers: its output ids (the stop token it matched included, as 0.5.23 keeps it) and its
# counts: steps by tokens accepted 0 .. 3 (a histogram as long as the largest count seen).
ANSWERS = {
    (5, 6, 7): ([10, 11, 12, 13, 14], {"finish_reason": {"type": "length", "length": 5}, "spec_verify_ct": 2,
                                       "spec_num_correct_drafts": 3, "spec_correct_drafts_histogram": [0, 1, 1]}),
    (8, 9): ([20, 21, STOP], {"finish_reason": {"type": "stop", "matched": STOP}, "spec_verify_ct": 2,
                              "spec_num_correct_drafts": 1, "spec_correct_drafts_histogram": [1, 1]}),
}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> TargetConfig:
    folder = tmp_path_factory.mktemp("qwen3")
    build_config("qwen3").save_pretrained(folder)
    return TargetConfig(model=str(folder))


def job(target: TargetConfig, references=REFERENCES) -> ServedEval:
    return ServedEval(target=target, tokenizer=None, prompts=PROMPTS, references=references, stops={STOP})


def sglang_like(info=INFO, meta=None, info_page="/server_info", drop_stop=False):
    """An endpoint answering as SGLang does: `/server_info` (`/get_server_info` before it), and `/generate` from
    ANSWERS (warm-up: 2 tokens), with the matched stop token left out of output_ids where `drop_stop`."""
    def respond(body):
        ids, answer = ANSWERS[tuple(body["input_ids"])]
        ids = [t for t in ids if t != STOP] if drop_stop else ids
        n = body["sampling_params"]["max_new_tokens"]
        return 200, {"output_ids": ids[:n], "meta_info": meta if meta is not None else answer}
    return json_endpoint("unused", respond=respond, pages={info_page: (200, info)},
                         models_reply=lambda: (404, {"detail": "Not Found"}))


@pytest.mark.parametrize("drop_stop", [False, True])
def test_counts_are_summed_per_request_and_a_matched_stop_token_is_kept_as_our_loop_keeps_it(qwen3, drop_stop):
    with sglang_like(drop_stop=drop_stop) as server:
        entry = sglang_eval(job(qwen3), url(server), BLOCK, 5)
        bodies = server.bodies
    assert (entry["drafts"], entry["accepted_tokens"]) == (4, 4) and entry["acceptance_length"] == 2.0
    assert entry["per_position"] == [3, 1, 0]  # steps that accepted 0, 1, 2 drafts: 1, 2, 1
    assert [p["as_target"] for p in entry["prompts"]] == [True, True] and entry["answers_as_target"] == 2
    assert entry["new_tokens"] == 8 and entry["draft_model"] == "/models/drafter" and "notes" not in entry
    assert bodies[0]["sampling_params"]["max_new_tokens"] == 2  # the warm-up
    assert bodies[1] == {"input_ids": PROMPTS[0], "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 5, "stop_token_ids": [STOP], "skip_special_tokens": False}}
    mine = [{"index": i, "matches_target": True, "verify_steps": 3, "accepted": 2} for i in range(2)]
    same = same_answers(mine, entry["prompts"], "sglang")
    assert (same["ours"], same["sglang"], same["engine"]) == (pytest.approx(5 / 3), 2.0, "sglang")
    assert same_answers_line({**same, "prompts": [0]}, 2).endswith("tau 1.667 ours, 2.000 SGLang")


def test_an_older_sglang_is_asked_at_get_server_info(qwen3):
    with sglang_like(info_page="/get_server_info") as server:
        assert sglang_eval(job(qwen3), url(server), BLOCK, 5)["acceptance_length"] == 2.0


def test_an_answer_other_than_the_targets_is_counted_as_such_and_a_target_of_sliding_layers_only_noted(tmp_path):
    """SGLang 0.5.23 served a tiny Mistral (every layer sliding, window 16) without its window: its answers were
    the windowless model's from the first token on (docs/engines.md)."""
    build_config("mistral").save_pretrained(tmp_path)
    with sglang_like() as server:
        entry = sglang_eval(job(TargetConfig(model=str(tmp_path)), [[10, 11, 12, 13, 15], REFERENCES[1]]),
                            url(server), BLOCK, 5)
    assert [p["as_target"] for p in entry["prompts"]] == [False, True] and not entry["matches_target"]
    note = entry["notes"]["sliding_target"]
    assert "every layer of the target is sliding-window (window 16)" in note and "\n" not in note


@pytest.mark.parametrize(("info", "meta", "words"), [
    ({**INFO, "speculative_algorithm": "EAGLE3"}, None, "drafts with EAGLE3, not DFLASH"),
    ({**INFO, "speculative_num_draft_tokens": 8}, None, "serve it with --speculative-num-draft-tokens 4"),
    (INFO, {"finish_reason": {"type": "length"}}, "has no spec_verify_ct"),
    (INFO, {"spec_verify_ct": 2, "spec_num_correct_drafts": 5, "spec_correct_drafts_histogram": [1, 1]},
     "do not add up for a block of 4"),
    (INFO, {"spec_verify_ct": 1, "spec_num_correct_drafts": 4, "spec_correct_drafts_histogram": [0, 0, 0, 0, 1]},
     "do not add up for a block of 4"),
])
def test_a_server_that_is_not_drafting_this_drafters_blocks_is_refused_in_one_line(qwen3, info, meta, words):
    with sglang_like(info, meta) as server, pytest.raises(EngineError, match=words) as err:
        sglang_eval(job(qwen3), url(server), BLOCK, 5)
    assert "\n" not in str(err.value)
