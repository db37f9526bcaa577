"""Regeneration through real serving engines (data.generation.engine: openai): `transformers serve` processes
started with continuous batching, on the tiny target (conftest's `servers`, shared with the chaos test). Answers land in the cache, two endpoints share the
work, a server killed mid-phase or a killed `regenerate` loses nothing asked, errors and hangs are retried with
one clear line, and a whole `accelerate launch run` trains from the servers' answers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from json_endpoint import json_endpoint, url

from dflash_stream.cli import main
from dflash_stream.regenerate.servers import LocalServer
from dflash_stream.rundir import RunDir

REPO = Path(__file__).parent.parent
DATA = REPO / "dflash_stream" / "demo_data"
LAUNCH_2CPU = REPO / "launch" / "cpu-2proc.yaml"

pytestmark = pytest.mark.slow


def write_config(tmp: Path, target: Path, endpoints: list[str], sources: list[str] | None = None,
                 **generation) -> Path:
    cfg = {
        "output_dir": str(tmp / "out"),
        "target": {"model": str(target), "dtype": "float32", "device": "cpu", "num_capture_layers": 3},
        "data": {
            "sources": [{"path": str(DATA / name)} for name in (sources or ["sharegpt_chats.jsonl"])],
            "max_length": 160, "regenerate": True, "min_supervised_tokens": 4,
            "generation": {"engine": "openai", "endpoints": endpoints, "concurrency": 4, "max_new_tokens": 24,
                           "timeout_s": 20, **generation},
        },
        "extract": {"batch_tokens": 1024},
        "store": {"path": str(tmp / "out" / "store"), "budget": 1_500_000, "segment_bytes": 100_000},
        "drafter": {"num_layers": 1, "block_size": 4},
        "train": {"epochs": 1, "batch_tokens": 256, "num_anchors": 8, "checkpoint_every": 4, "log_every": 2},
        "roles": {"trainers": 1},
    }
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cache_lines(output: Path) -> list[dict]:
    lines = []
    for path in sorted(RunDir(output).data.glob("responses-*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines


def regen_summary(output: Path) -> dict:
    return json.loads((RunDir(output).data / "regenerate.json").read_text())


def test_answers_land_in_the_cache_as_the_target_wrote_them(servers, tiny_target_dir, tmp_path):
    import torch

    from dflash_stream.config import load_config
    from dflash_stream.data.prepare import prepare_samples
    from dflash_stream.target_model import load_target
    from dflash_stream.target_model.generate import generate_responses

    config = write_config(tmp_path, tiny_target_dir, [servers[0].url])
    assert main(["regenerate", "--config", str(config)]) == 0
    cached = {r["sample_id"]: r for r in cache_lines(tmp_path / "out")}
    cfg = load_config(config)
    model, tokenizer = load_target(cfg.target, torch.device("cpu"))
    samples, _ = prepare_samples(cfg, tokenizer, 0, 1)
    assert set(cached) == {s.sample_id for s in samples}
    # `transformers serve` returns text: the answer the target wrote is its ids decoded and tokenized again.
    agree = 0
    for sample in samples:
        budget = min(24, 160 - sample.num_tokens)
        ids = generate_responses(model, tokenizer, [sample.input_ids], cfg.data.generation, budget)[0]
        expected = tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=True), add_special_tokens=False)
        agree += cached[sample.sample_id]["tokens"][: len(expected)] == expected
        assert cached[sample.sample_id]["finish"] in ("stop", "length")
    assert agree >= 0.9 * len(samples), f"{agree} of {len(samples)} answers as HF generate wrote them"
    summary = regen_summary(tmp_path / "out")
    assert summary["answers"] == len(samples) and summary["errors"] == 0 and summary["from_text"] == len(samples)
    # Asked again: everything is in the cache, nothing is sent.
    assert main(["regenerate", "--config", str(config)]) == 0
    assert regen_summary(tmp_path / "out")["asked"] == 0 and len(cache_lines(tmp_path / "out")) == len(samples)


def test_two_endpoints_share_the_work(servers, tiny_target_dir, tmp_path):
    config = write_config(tmp_path, tiny_target_dir, [s.url for s in servers],
                          sources=["sharegpt_chats.jsonl", "openai_messages.jsonl", "alpaca_tasks.json"])
    assert main(["regenerate", "--config", str(config)]) == 0
    summary = regen_summary(tmp_path / "out")
    per_endpoint = [ep["answers"] for ep in summary["endpoints"].values()]
    assert len(per_endpoint) == 2 and sum(per_endpoint) == summary["answers"] == summary["samples"]
    # Work goes to whichever endpoint is free, so the split follows each server's speed on shared cores (60/38
    # quiet, 69/29 loaded): each answered a real share.
    assert min(per_endpoint) > 0.1 * summary["answers"], per_endpoint


def _wait_for_lines(output: Path, count: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    started = time.monotonic()
    while len(cache_lines(output)) < count:
        assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else ""
        assert time.monotonic() - started < timeout
        time.sleep(0.05)


def _regenerate_process(config: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash_stream", "regenerate", "--config", str(config)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_killed_server_and_killed_phase_lose_nothing_asked(servers, tiny_target_dir, tmp_path):
    alive, server = servers
    sources = ["sharegpt_chats.jsonl", "openai_messages.jsonl", "prompts_only.jsonl"]
    config = write_config(tmp_path, tiny_target_dir, [server.url], sources=sources, concurrency=1,
                          max_new_tokens=32, give_up_s=4)
    output = tmp_path / "out"
    # The server dies mid-phase: the phase waits give_up_s for it, then stops and says so.
    proc = _regenerate_process(config)
    try:
        _wait_for_lines(output, 5, proc)
        server.send(signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        server.stop()
        server.start()  # ready again by the end of the test; the phases below ask the other server meanwhile
    try:
        assert proc.returncode == 2, out[-3000:]
        assert "out of rotation" in out and "no endpoint answered for 4 s" in out
        first = len(cache_lines(output))
        assert first >= 5
        # The phase itself killed with SIGKILL mid-way: what was answered stays. Where answers come from (the
        # endpoints, their concurrency) is not part of what decides them, so the cache carries over.
        config = write_config(tmp_path, tiny_target_dir, [alive.url], sources=sources, concurrency=1,
                              max_new_tokens=32, give_up_s=4)
        proc = _regenerate_process(config)
        try:
            _wait_for_lines(output, first + 5, proc)
        finally:
            proc.kill()
            proc.communicate()
        second = len(cache_lines(output))
        config = write_config(tmp_path, tiny_target_dir, [alive.url], sources=sources, concurrency=4,
                              max_new_tokens=32, give_up_s=4)
        assert main(["regenerate", "--config", str(config)]) == 0
        summary = regen_summary(output)
        assert summary["asked"] == summary["samples"] - second
        counts = Counter(r["sample_id"] for r in cache_lines(output))
        assert len(counts) == summary["samples"] and max(counts.values()) == 1, "an answer was asked for twice"
    finally:
        server.wait_ready(240)


def test_failing_endpoint_leaves_the_rotation_and_a_hung_one_is_retried(servers, tiny_target_dir, tmp_path, capfd):
    # An engine in a bad state: it lists its model but fails every completion.
    with json_endpoint(str(tiny_target_dir), 500, {"error": {"message": "EngineCore encountered an issue"}}) as failing:
        bad_url = url(failing)
        config = write_config(tmp_path, tiny_target_dir, [servers[0].url, bad_url], retries=3)
        assert main(["regenerate", "--config", str(config)]) == 0
    err = capfd.readouterr().err
    summary = regen_summary(tmp_path / "out")
    assert summary["missing"] == 0 and summary["endpoints"][bad_url]["answers"] == 0
    assert failing.posts >= 3
    assert err.count(f"endpoint {bad_url} out of rotation") == 1, err[-3000:]
    assert "EngineCore encountered an issue" in err

    # A hung server (stopped with SIGSTOP): requests time out, are retried, and go through once it runs again.
    hung = servers[0]
    config = write_config(tmp_path / "hang", tiny_target_dir, [hung.url], timeout_s=2, give_up_s=60, retries=5,
                          sources=["openai_messages.jsonl"])
    hung.send(signal.SIGSTOP)
    timer = threading.Timer(5.0, hung.send, args=(signal.SIGCONT,))
    timer.start()
    try:
        assert main(["regenerate", "--config", str(config)]) == 0
    finally:
        timer.join()
        hung.send(signal.SIGCONT)
    err = capfd.readouterr().err
    assert f"endpoint {hung.url} out of rotation" in err and f"endpoint {hung.url} answers again" in err, err[-3000:]
    assert regen_summary(tmp_path / "hang" / "out")["missing"] == 0


def test_run_trains_from_the_servers_answers(servers, tiny_target_dir, tmp_path):
    """The main job with engine openai: the same kind of run as in-process regeneration (audit exact, drafter
    exported, tau reported), the target loaded only to extract."""
    from dflash_stream.observe.status import collect_status, render_status
    from dflash_stream.pipeline.audit import audit_run

    config = write_config(tmp_path, tiny_target_dir, [s.url for s in servers],
                          sources=["sharegpt_chats.jsonl", "openai_messages.jsonl", "alpaca_tasks.json"])
    cfg = yaml.safe_load(config.read_text())
    cfg["eval"] = {"prompts": str(DATA / "heldout_prompts.jsonl"), "num_prompts": 2, "max_new_tokens": 8}
    config.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(LAUNCH_2CPU),
           "-m", "dflash_stream", "run", "--config", str(config)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    output = tmp_path / "out"
    report = audit_run(output)
    assert report["ok"], report
    summary = json.loads((output / "summary.json").read_text())
    assert summary["samples_extracted"] > 0 and "acceptance_length" in summary["eval"]
    assert (output / "drafter" / "model.safetensors").is_file()
    extractor = json.loads((output / "summary-parts" / "extractor-0.json").read_text())
    regen = extractor["regenerate"]
    assert regen["answers"] == regen["asked"] > 0 and regen["errors"] == 0
    assert sum(ep["answers"] for ep in regen["endpoints"].values()) == regen["answers"]
    assert summary["regenerate"]["answers"] == regen["answers"]
    # `status` shows the servers' progress from the extractor's metrics.
    shown = collect_status(output)
    assert shown["regeneration"]["answered"] == shown["regeneration"]["asked"] == regen["asked"]
    assert "regen " in render_status(shown)
    assert "regeneration:" in done.stdout + done.stderr


def test_hybrid_target_answers_published_rows_then_trains(demo_tokenizer_dir, tmp_path):
    """The headline's layer mix (Qwen3.5's Gated-DeltaNet + attention hybrid, tiny, from transformers' config
    class) served by `transformers serve`, on rows in the six headline sources' published schemas: `regenerate`
    answers every kept sample, and `run` then extracts and trains from the cache alone. The text model: for the
    VLM wrapper `transformers serve` loads an image processor, which needs torchvision (a real checkpoint's
    servers, vLLM and SGLang, serve the wrapper; the extraction side of it is test_families.py's)."""
    from published_rows import write_rows

    from dflash_stream.bench.tiny_targets import save_target
    from dflash_stream.pipeline.audit import audit_run

    target = save_target("qwen3_5_text", tmp_path / "target", demo_tokenizer_dir)
    rows = write_rows(tmp_path / "rows")
    # Without continuous batching: transformers serve's paged cache has no Gated-DeltaNet layers yet.
    with LocalServer("transformers", target, tmp_path / "server.log", continuous_batching=False) as server:
        server.start().wait_ready(240)
        config = write_config(tmp_path, target, [server.url])
        cfg = yaml.safe_load(config.read_text())
        cfg["data"]["sources"] = [{"path": str(path)} for path in rows.values()]
        cfg["data"]["max_length"] = 512
        cfg["target"]["num_capture_layers"] = 2
        config.write_text(yaml.safe_dump(cfg))
        assert main(["regenerate", "--config", str(config)]) == 0
    summary = regen_summary(tmp_path / "out")
    assert summary["samples"] == summary["answers"] == len(cache_lines(tmp_path / "out")) >= len(rows)
    # The server is gone: the run must find every answer in the cache.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(LAUNCH_2CPU),
           "-m", "dflash_stream", "run", "--config", str(config)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "every answer came from the cache" in done.stdout + done.stderr
    assert audit_run(tmp_path / "out")["ok"]
