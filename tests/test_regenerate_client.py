"""The completions client's refusals and its faults, against a small HTTP endpoint that answers as a
misconfigured or failing server would (the tests against real servers are in test_regenerate_server.py): each
ends with one clear line, or costs one request or one endpoint, never the phase, and never forever."""

from __future__ import annotations

import time

import pytest
from json_endpoint import answering, json_endpoint, url

from dflash_stream.config import ConfigError, GenerationConfig
from dflash_stream.regenerate.client import (
    MALFORMED_TO_DROP,
    Answer,
    CompletionClient,
    Prompt,
    RegenerationError,
)

KEY_BASE = 1000
"""A prompt's first id is KEY_BASE + its key, so that an endpoint knows which sample it answers."""


@pytest.fixture(scope="module")
def tokenizer(demo_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_tokenizer_dir)


@pytest.fixture
def endpoint():
    """A server without the completions API."""
    with json_endpoint("served-model", 404, {"detail": "Not Found"}) as server:
        yield server


def _client(tokenizer, servers, **gen) -> CompletionClient:
    config = GenerationConfig(engine="openai", endpoints=[url(s) for s in servers],
                              **{"concurrency": 2, "give_up_s": 5, **gen})
    return CompletionClient(config, tokenizer, {tokenizer.eos_token_id}, target="/models/served-model",
                            max_length=160)


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(i, [KEY_BASE + i, 5, 6], 8) for i in range(n)]


def _key(body: dict) -> int:
    return body["prompt"][0] - KEY_BASE


def _run(client: CompletionClient, prompts: list[Prompt]) -> dict[int, Answer]:
    answers: dict[int, Answer] = {}
    client.run(prompts, lambda answer: answers.__setitem__(answer.key, answer))
    return answers


def test_a_server_without_completions_stops_the_phase(tokenizer, endpoint):
    with pytest.raises(RegenerationError, match="completions not found"):
        _run(_client(tokenizer, [endpoint]), _prompts(5))


def test_a_model_the_server_does_not_serve_is_named(tokenizer, endpoint):
    with pytest.raises(ConfigError, match="data.generation.model: 'other' is not served .* served-model"):
        _run(_client(tokenizer, [endpoint], model="other"), _prompts(1))


def test_the_api_key_comes_from_the_named_variable(tokenizer, endpoint, monkeypatch):
    with pytest.raises(ConfigError, match="DFLASH_TEST_KEY is not set"):
        _client(tokenizer, [endpoint], api_key_env="DFLASH_TEST_KEY")
    monkeypatch.setenv("DFLASH_TEST_KEY", "s3cret")
    with pytest.raises(RegenerationError):
        _run(_client(tokenizer, [endpoint], api_key_env="DFLASH_TEST_KEY"), _prompts(1))
    assert endpoint.auth == ["Bearer s3cret"]


# -------------------------------------------------------------------- case 2: retries without end


@pytest.mark.parametrize("concurrency", [1, 3])
def test_a_request_that_always_fails_is_reported_and_the_others_go_on(tokenizer, concurrency, caplog):
    """A proxy's 504 on one long generation, every time: the request is tried retries + 1 times while the
    endpoint answers the others (alone in flight too: the endpoint's /models says it is up), then reported with
    its sample id and the last answer; the others are answered and the phase ends."""
    tried = []

    def respond(body: dict):
        if isinstance(body["prompt"], list) and _key(body) == 7:
            tried.append(time.monotonic())
            return 504, {"detail": "upstream request timeout"}
        return good["respond"](body)

    good = answering(tokenizer)
    with json_endpoint("served-model", respond=respond, tokenize=good["tokenize"]) as server:
        answers = _run(_client(tokenizer, [server], retries=2, concurrency=concurrency), _prompts(12))
    assert len(tried) == 3
    assert answers[7].tokens is None and "HTTP 504: upstream request timeout" in answers[7].error
    assert all(answers[i].tokens for i in range(12) if i != 7)
    assert "sample 7: no answer after 3 tries (data.generation.retries 2)" in caplog.text


def test_an_endpoint_wide_outage_costs_no_request_a_try(tokenizer):
    """A server restarting (every request and /models answer 503 for a while): no request loses a try, even with
    data.generation.retries 0; the endpoint leaves the rotation and comes back."""
    good = answering(tokenizer)
    back_at = time.monotonic() + 1.5

    def down() -> bool:
        return time.monotonic() < back_at

    def respond(body: dict):
        return (503, {"detail": "restarting"}) if down() else good["respond"](body)

    with json_endpoint("served-model", respond=respond, tokenize=good["tokenize"],
                       models_reply=lambda: (503, {"detail": "restarting"}) if down() else None) as server:
        # The first contact got through before the outage: it starts now.
        client = _client(tokenizer, [server], retries=0, give_up_s=30, concurrency=3)
        back_at = time.monotonic() + 1.5
        answers = _run(client, _prompts(9))
    assert all(a.tokens for a in answers.values()) and len(answers) == 9
    assert client.endpoints[0].outages >= 1 and client.endpoints[0].errors == 0


# -------------------------------------------------------------------- case 4: the wrong server


def test_a_server_with_another_tokenizer_leaves_the_phase_and_the_others_answer(tokenizer, caplog):
    """An endpoint that serves another model (its /tokenize gives other ids) is dropped at the first contact,
    named with the reason; the target's server answers everything."""
    good = answering(tokenizer)

    def other_tokenize(body: dict):
        return 200, {"tokens": [t + 1 for t in tokenizer.encode(body["prompt"], add_special_tokens=False)]}

    with (json_endpoint("served-model", **good) as right,
          json_endpoint("served-model", respond=good["respond"], tokenize=other_tokenize) as wrong):
        client = _client(tokenizer, [right, wrong])
        answers = _run(client, _prompts(10))
        assert wrong.posts == 0
    assert all(a.tokens and a.endpoint == url(right) for a in answers.values())
    reason = client.endpoints[1].dropped
    assert reason and "whose tokenizer is not the target's" in reason and "differing from position 0" in reason
    assert f"endpoint {url(wrong)} left the phase" in caplog.text
    # Alone, it leaves nothing to ask: the phase stops in one line.
    with (json_endpoint("served-model", respond=good["respond"], tokenize=other_tokenize) as wrong,
          pytest.raises(RegenerationError, match="no endpoint is left to ask: .* tokenizer is not the target's")):
        _run(_client(tokenizer, [wrong]), _prompts(2))


def test_a_server_counting_other_prompt_tokens_leaves_the_phase(tokenizer):
    """Without /tokenize (transformers serve), the prompt token count of a one-token completion tells."""
    good = answering(tokenizer)

    def respond(body: dict):
        if isinstance(body["prompt"], str):
            return 200, {"choices": [{"text": "x", "finish_reason": "length"}], "usage": {"prompt_tokens": 3}}
        return good["respond"](body)

    with (json_endpoint("served-model", respond=respond) as wrong,
          pytest.raises(RegenerationError, match="it counts 3 tokens in a probe text, the target's tokenizer")):
        _run(_client(tokenizer, [wrong]), _prompts(2))


@pytest.mark.parametrize("bad", ["id", "choice"])
def test_malformed_answers_drop_their_endpoint_not_the_phase(tokenizer, bad, caplog):
    """Ids past the tokenizer's vocabulary (which would crash every later extraction of that sample, cached), or
    a choice that is not one: the request is sent again, and after MALFORMED_TO_DROP such answers in a row the
    endpoint leaves; the other endpoint answers everything, with ids inside the vocabulary."""
    good = answering(tokenizer)
    vocab = len(tokenizer)

    def broken(body: dict):
        if isinstance(body["prompt"], str):
            return good["respond"](body)
        if bad == "id":
            return 200, {"choices": [{"text": "", "token_ids": [5, vocab + 7, 2], "finish_reason": "stop"}]}
        return 200, {"choices": [17]}

    with (json_endpoint("served-model", respond=broken, tokenize=good["tokenize"]) as faulty,
          json_endpoint("served-model", **good) as right):
        client = _client(tokenizer, [faulty, right], retries=MALFORMED_TO_DROP + 1)
        answers = _run(client, _prompts(12))
    assert len(answers) == 12 and all(a.tokens and a.endpoint == url(right) for a in answers.values())
    assert all(0 <= t < vocab for a in answers.values() for t in a.tokens)
    # The requests in flight when it left count too.
    assert MALFORMED_TO_DROP <= client.endpoints[0].malformed < MALFORMED_TO_DROP + client.concurrency
    assert f"{MALFORMED_TO_DROP} malformed answers in a row" in client.endpoints[0].dropped
    assert (f"token id {vocab + 7} outside the target's tokenizer" if bad == "id" else "not an object") in caplog.text


def test_without_generation_model_the_one_named_as_the_target_is_asked(tokenizer):
    """A server listing several models: the one named as target.model is asked, not the first listed; none of
    them so named is refused naming data.generation.model."""
    good = answering(tokenizer)
    listed = [{"id": "some/other-model"}, {"id": "served-model"}]
    with json_endpoint("served-model", models=listed, **good) as server:
        _run(_client(tokenizer, [server]), _prompts(2))
        assert {b["model"] for b in server.bodies} == {"served-model"}
    with (json_endpoint("served-model", models=[{"id": "a"}, {"id": "b"}], **good) as server,
          pytest.raises(ConfigError, match="data.generation.model: .* serves a, b, none named as target.model")):
        _run(_client(tokenizer, [server]), _prompts(2))


# -------------------------------------------------------------------- case 6: aborted answers


@pytest.mark.parametrize("finish", ["abort", "content_filter", None])
def test_an_aborted_answer_is_sent_again_and_never_taken(tokenizer, finish, caplog):
    """Finish reasons other than stop and length are not answers: sample 3 always gets one and ends as an error
    after its tries; sample 4 gets one once and its next try is taken."""
    good = answering(tokenizer)
    seen: dict[int, int] = {}

    def respond(body: dict):
        if isinstance(body["prompt"], str):
            return good["respond"](body)
        key = _key(body)
        seen[key] = seen.get(key, 0) + 1
        if key == 3 or (key == 4 and seen[key] == 1):
            return 200, {"choices": [{"text": "", "token_ids": [5, 6], "finish_reason": finish}]}
        return good["respond"](body)

    with json_endpoint("served-model", respond=respond, tokenize=good["tokenize"]) as server:
        answers = _run(_client(tokenizer, [server], retries=2), _prompts(6))
    assert answers[3].tokens is None and f"finish_reason {finish!r}" in answers[3].error and seen[3] == 3
    assert answers[4].tokens and answers[4].finish == "stop" and seen[4] == 2
    assert all(a.finish in ("stop", "length") for a in answers.values() if a.tokens)


# -------------------------------------------------------------------- case 7: everything refused


@pytest.mark.parametrize("model", [None, "served-model"])
def test_a_refused_api_key_stops_the_phase_at_once_naming_the_variable(tokenizer, model, monkeypatch):
    monkeypatch.setenv("DFLASH_TEST_KEY", "wrong")
    with json_endpoint("served-model", 401, {"error": {"message": "Incorrect API key provided"}},
                       models_reply=lambda: (401, {"error": {"message": "Incorrect API key provided"}})) as server:
        started = time.monotonic()
        with pytest.raises(RegenerationError) as refused:
            _run(_client(tokenizer, [server], api_key_env="DFLASH_TEST_KEY", model=model), _prompts(50))
        assert time.monotonic() - started < 5 and server.posts <= 1
    line = str(refused.value)
    assert "HTTP 401 (Incorrect API key provided)" in line and "$DFLASH_TEST_KEY (data.generation.api_key_env)" in line
    # Without a key configured, the line says which key sends one.
    with (json_endpoint("served-model", 401, {"detail": "Unauthorized"}) as server,
          pytest.raises(RegenerationError, match="set data.generation.api_key_env")):
        _run(_client(tokenizer, [server]), _prompts(3))


def test_a_server_shorter_than_data_max_length_is_refused_at_the_start(tokenizer):
    good = answering(tokenizer)
    with json_endpoint("served-model", models=[{"id": "served-model", "max_model_len": 128}], **good) as server:
        with pytest.raises(ConfigError, match="data.max_length: .* maximum model length of 128 tokens, below "
                                              "data.max_length 160.*--max-model-len 160"):
            _run(_client(tokenizer, [server]), _prompts(3))
        assert server.posts == 0
