"""Regeneration faults at the level of the commands a user types, against small vLLM-like endpoints
(json_endpoint.py) that answer as a failing or misconfigured server would: `regenerate` on an output folder of
another target, two `regenerate` processes side by side, and `run` when one sample or every sample gets no
answer. The chaos test with real servers is in test_faults_chaos.py."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import pytest
import yaml
from json_endpoint import answering, json_endpoint, url
from test_regenerate_server import _regenerate_process, regen_summary, write_config

from dflash_stream.cli import main
from dflash_stream.rundir import RunDir


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


def _set(config: Path, **dotted) -> Path:
    cfg = yaml.safe_load(config.read_text())
    for key, value in dotted.items():
        node = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    config.write_text(yaml.safe_dump(cfg))
    return config


def _records(output: Path) -> list[dict]:
    """Every line of every part of the response cache, parsed: a torn line fails here."""
    return [json.loads(line) for path in sorted(RunDir(output).data.glob("responses-*.jsonl"))
            for line in path.read_text().splitlines() if line]


def test_another_target_on_the_same_output_folder_is_asked_anew(demo_tokenizer_dir, tiny_target_dir, tokenizer,
                                                                tmp_path, capfd):
    """Case 3: answers cached for one target are not taken for another (nor for another data.max_length): every
    sample is asked for again, and one line says which answers were left and why."""
    from dflash_stream.bench.tiny_targets import save_target

    output = tmp_path / "out"
    with json_endpoint("served-model", **answering(tokenizer)) as server:
        config = write_config(tmp_path, tiny_target_dir, [url(server)])
        assert main(["regenerate", "--config", str(config)]) == 0
        first = regen_summary(output)
        assert first["asked"] == first["samples"] > 0
        assert main(["regenerate", "--config", str(config)]) == 0
        assert regen_summary(output)["asked"] == 0  # the same target: all cached
        capfd.readouterr()

        other = save_target("qwen3", tmp_path / "other-target", demo_tokenizer_dir)
        assert main(["regenerate", "--config", str(write_config(tmp_path, other, [url(server)]))]) == 0
        assert regen_summary(output)["asked"] == first["samples"]
        err = capfd.readouterr().err
        assert "holds answers this run does not take" in err and f"target '{tiny_target_dir}' there" in err

        config = _set(write_config(tmp_path, tiny_target_dir, [url(server)]), **{"data.max_length": 200})
        assert main(["regenerate", "--config", str(config)]) == 0
        assert regen_summary(output)["asked"] == first["samples"]
        assert "max_length 160 there, 200 here" in capfd.readouterr().err


@pytest.mark.slow
def test_two_regenerate_processes_keep_each_sample_s_first_answer_in_whole_lines(tiny_target_dir, tokenizer,
                                                                               tmp_path):
    """Case 10: two `regenerate` processes on one output folder, answers of ~15 KB lines (past an 8 KB write
    buffer), each request answered differently: no line is torn (each process writes a part of its own, one
    write per line), and a later load gives each sample its first answer, whichever part it is in."""
    asked: Counter[tuple[int, ...]] = Counter()
    lock = threading.Lock()
    # No answer until both processes ask (a prompt asked twice): a process that started late on a busy machine
    # would otherwise find every answer written by the other and write no part of its own.
    both_asking = threading.Event()

    def answer(body: dict) -> list[int]:
        with lock:
            asked[tuple(body["prompt"])] += 1
            n = asked[tuple(body["prompt"])]
        if n == 2:
            both_asking.set()
        both_asking.wait(timeout=100)
        return [1000 + n] * 2500 + [tokenizer.eos_token_id]

    with json_endpoint("served-model", **answering(tokenizer, answer)) as server:
        config = _set(write_config(tmp_path, tiny_target_dir, [url(server)], concurrency=8, max_new_tokens=3000,
                                   timeout_s=120,
                                   sources=["sharegpt_chats.jsonl", "openai_messages.jsonl", "alpaca_tasks.json"]),
                      **{"data.max_length": 4096})
        procs = [_regenerate_process(config) for _ in range(2)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    output = tmp_path / "out"
    records = _records(output)  # every line whole
    parts = sorted(RunDir(output).data.glob("responses-*-regenerate-*.jsonl"))
    assert len(parts) == 2
    first: dict[int, dict] = {}
    for record in records:
        if record["sample_id"] not in first or record["t"] < first[record["sample_id"]]["t"]:
            first[record["sample_id"]] = record
    assert len(records) > len(first), "the two processes never answered one sample twice: nothing was tested"
    from dflash_stream.config import load_config
    from dflash_stream.regenerate.cache import ResponseCache, answers_key
    from dflash_stream.target_model.loading import target_stop_ids

    cfg = load_config(config)
    cache = ResponseCache(output, answers_key(cfg, tokenizer, target_stop_ids(cfg.target, tokenizer)), "check")
    assert {i: cache.get(i) for i in first} == {i: r["tokens"] for i, r in first.items()}


def test_run_with_a_sample_that_never_gets_an_answer_trains_the_rest_and_exits_1(tiny_target_dir, tokenizer,
                                                                                tmp_path, capfd):
    """Case 2 at the command: a proxy's 504 on one sample every time; the run trains on the others, names that
    sample once with its last error, and exits 1: regeneration is incomplete."""
    good = answering(tokenizer, lambda body: [*body["prompt"][-8:], tokenizer.eos_token_id])
    victim: list[list[int]] = []

    def respond(body: dict):
        if isinstance(body["prompt"], list):
            if not victim:
                victim.append(body["prompt"])
            if body["prompt"] == victim[0]:
                return 504, {"detail": "upstream request timeout"}
        return good["respond"](body)

    with json_endpoint("served-model", respond=respond, tokenize=good["tokenize"]) as server:
        config = _set(write_config(tmp_path, tiny_target_dir, [url(server)], retries=1, concurrency=2),
                      **{"roles.trainers": "auto"})
        assert main(["run", "--config", str(config)]) == 1
    err = capfd.readouterr().err
    assert err.count("no answer after 2 tries (data.generation.retries 1)") == 1
    assert "HTTP 504: upstream request timeout" in err
    assert "regeneration is incomplete: 1 sample(s) got no answer" in err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["samples_trained"] > 0 and summary["regenerate"]["errors"] == 1
    assert (tmp_path / "out" / "drafter" / "model.safetensors").is_file()


def test_run_with_a_refused_api_key_stops_at_once_and_exports_nothing(tiny_target_dir, tokenizer, tmp_path,
                                                                     capfd, monkeypatch):
    """Case 7 at the command: a wrong API key (401 on every request, the model named in the config so that no
    listing is needed) stops the run in one line naming the key's variable; no untrained drafter is exported."""
    monkeypatch.setenv("DFLASH_TEST_KEY", "wrong")
    refused = {"error": {"message": "Incorrect API key provided"}}
    with json_endpoint("served-model", 401, refused, models_reply=lambda: (401, refused)) as server:
        config = _set(write_config(tmp_path, tiny_target_dir, [url(server)], model="served-model",
                                   api_key_env="DFLASH_TEST_KEY"), **{"roles.trainers": "auto"})
        assert main(["run", "--config", str(config)]) == 2
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("dflash-stream: error:")]
    assert len(errors) == 1 and "HTTP 401 (Incorrect API key provided)" in errors[0] and "$DFLASH_TEST_KEY" in errors[0]
    assert not (tmp_path / "out" / "drafter").exists()
