"""`dflash-stream bench regenerate`: the engines answer the same prompts, the JSON has the promised shape, and the
servers are gone afterwards."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import VLLM_PYTHON, needs_vllm

from dflash_stream.bench.regenerate import BenchOptions, run_bench, table
from dflash_stream.bench.synthetic import DEMO_DATA
from dflash_stream.cli import main
from dflash_stream.config import config_from_dict
from dflash_stream.regenerate.servers import LocalServer, vllm_binding

REPO = Path(__file__).resolve().parents[1]
ENTRY_KEYS = {"tokens_per_s", "seconds", "responses", "agree_with_hf"}


def tiny_config(target_dir: Path, tmp: Path) -> dict:
    return {
        "output_dir": str(tmp / "out"),
        "target": {"model": str(target_dir), "dtype": "float32", "device": "cpu"},
        "data": {"sources": [{"path": str(DEMO_DATA / "sharegpt_chats.jsonl"), "limit": 4},
                             {"path": str(DEMO_DATA / "alpaca_tasks.json"), "limit": 4}],
                 "max_length": 256, "regenerate": True, "generation": {"batch_size": 2}},
        "store": {"path": str(tmp / "out" / "store"), "budget": "10MB"},
    }


def check_shape(result: dict, prompts: int, max_new_tokens: int, engines: set[str]) -> None:
    assert set(result) == {"prompts", "max_new_tokens", "engines"}
    assert result["prompts"] == prompts and result["max_new_tokens"] == max_new_tokens
    assert set(result["engines"]) == engines
    for name, entry in result["engines"].items():
        assert set(entry) >= ENTRY_KEYS, (name, entry)
        assert entry["responses"] == prompts, (name, entry)
        assert 0 <= entry["agree_with_hf"] <= entry["responses"], (name, entry)
        assert entry["tokens_per_s"] > 0 and entry["seconds"] > 0
    assert result["engines"]["hf"]["agree_with_hf"] == prompts


@pytest.mark.slow
def test_hf_and_transformers_serve_answer_the_same_prompts(tiny_target_dir, tmp_path, capsys, monkeypatch):
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_target_dir, tmp_path)))
    # The servers the bench starts (here, in the main thread: the servers other tests share start meanwhile in
    # conftest's background thread).
    started: list[int] = []
    start = LocalServer.start

    def recorded_start(server: LocalServer, *args, **kwargs) -> LocalServer:
        start(server, *args, **kwargs)
        if threading.current_thread() is threading.main_thread():
            started.append(server.process.pid)
        return server

    monkeypatch.setattr(LocalServer, "start", recorded_start)
    code = main(["bench", "regenerate", "--config", str(config), "--engines", "hf,transformers", "--prompts", "3",
                 "--max-new-tokens", "6", "--workdir", str(tmp_path / "work"), "--json"])
    assert code == 0
    assert started and not any(psutil.pid_exists(pid) for pid in started)  # the bench's server is stopped
    result = json.loads(capsys.readouterr().out)
    check_shape(result, 3, 6, {"hf", "transformers"})
    served = result["engines"]["transformers"]
    assert served["from_text"] == 3  # transformers serve takes no token ids: the client sent text
    assert served["startup_seconds"] > 0 and served["threads"] >= 1
    assert "x hf" in "\n".join(table(result))


def test_vllm_without_its_environment_is_skipped_with_the_command_to_make_it(tiny_target_dir, tmp_path):
    cfg = config_from_dict(tiny_config(tiny_target_dir, tmp_path))
    options = BenchOptions(prompts=2, max_new_tokens=4, engines=["vllm"], workdir=tmp_path / "work",
                           vllm_python=tmp_path / "no-venv" / "bin" / "python")
    result = run_bench(cfg, options)
    entry = result["engines"]["vllm"]
    assert "not found" in entry["skipped"] and entry["command"] == "make vllm-env"
    assert "make vllm-env" in "\n".join(table(result))


def test_vllm_binding_is_read_from_its_log():
    log = ("INFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]\n"
           "INFO [ompmultiprocessing.py:185] \treserved_cpus=[]\n")
    assert vllm_binding(log) == ([0, 1], [])
    assert vllm_binding("no binding here") is None


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("CI")), reason="starts a vLLM server (minutes on a CPU); not in CI")
@needs_vllm
def test_vllm_answers_as_hf_does_on_the_demo_target(tmp_path):
    # The demo target itself: vLLM's CPU attention refuses the tiny model's 16-wide heads.
    tree = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    for source in tree["data"]["sources"]:
        source["path"] = str(REPO / source["path"])
    tree["output_dir"] = str(tmp_path / "out")
    tree["store"]["path"] = str(tmp_path / "out" / "store")
    options = BenchOptions(prompts=4, max_new_tokens=8, engines=["hf", "vllm"], workdir=tmp_path / "work",
                           vllm_python=VLLM_PYTHON)
    result = run_bench(config_from_dict(tree), options)
    check_shape(result, 4, 8, {"hf", "vllm"})
    entry = result["engines"]["vllm"]
    assert entry["from_text"] == 0  # vLLM returns the answers' token ids
    assert entry["omp_threads"] >= 1 and entry["cores"] >= 1
    # Greedy float32 on both sides: a handful of short answers come out the same.
    assert entry["agree_with_hf"] >= 3


@pytest.mark.slow
def test_a_running_server_is_measured_as_it_is(tiny_target_dir, tmp_path, capsys):
    """`--endpoint URL` times a server the bench did not start (a user's), the figure plan's
    data.generation.tokens_per_s takes; without local engines (`--engines ''`) nothing else runs."""
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_target_dir, tmp_path)))
    with LocalServer("transformers", tiny_target_dir, tmp_path / "server.log") as server:
        server.start().wait_ready(240)
        code = main(["bench", "regenerate", "--config", str(config), "--engines", "", "--endpoint",
                     server.url, "--prompts", "3", "--max-new-tokens", "5", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["engines"]) == {server.url}
    entry = result["engines"][server.url]
    assert entry["responses"] == 3 and entry["tokens_per_s"] > 0 and entry["agree_with_hf"] is None
    assert entry["cores"] is None and entry["model"] == str(tiny_target_dir)
    assert server.url in "\n".join(table(result))
