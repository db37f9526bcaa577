"""Chaos with real servers: a `run` that regenerates through two `transformers serve` processes (conftest's
`servers`) and trains with background checkpoints, while a serving process, the extractor and the trainer are each
killed with SIGKILL once at random moments (the server while the answers come in, then the ranks in a random order),
and the launch is restarted after each rank kill.
Then the audit: every kept sample trained exactly once per epoch (none lost, none twice), the store never past
its budget as `du` sees it, and every sample's answer the first one written."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from test_pipeline import LAUNCH_2CPU, REPO, DiskSampler, assert_exactly_once, rank_pids
from test_regenerate_server import cache_lines, write_config

from dflash_stream.observe.metrics import read_metrics

pytestmark = pytest.mark.slow

BUDGET = 1_200_000


def _launch(config: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(LAUNCH_2CPU), "-m",
           "dflash_stream", "run", "--config", str(config)]
    with open(log, "a") as out:
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _trained_steps(output: Path, since: float) -> int:
    return sum(1 for e in read_metrics(output) if e["event"] == "train" and e["time"] >= since)


def _answers_written(output: Path) -> int:
    """Lines in the answer cache so far (the last one may still be being written)."""
    return sum(path.read_bytes().count(b"\n") for path in (output / "data").glob("responses-*.jsonl"))


def _end(launch: subprocess.Popen, output: Path, timeout: float = 60) -> None:
    """A launch whose rank was killed ends (the launcher stops the other rank); leftovers are killed."""
    try:
        launch.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        launch.wait()
    for pid in rank_pids(output).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_kill_9_of_a_server_the_extractor_and_the_trainer_then_the_audit(servers, tiny_target_dir, tmp_path):
    seed = int(os.environ.get("DFLASH_CHAOS_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    # The server first: the answers come in within seconds, and a later launch finds them all in the cache.
    victims = ["server", *rng.sample(["extractor", "trainer"], 2)]
    config = write_config(tmp_path, tiny_target_dir, [s.url for s in servers], retries=6, concurrency=2,
                          sources=["sharegpt_chats.jsonl", "openai_messages.jsonl", "alpaca_tasks.json"])
    cfg = yaml.safe_load(config.read_text())
    cfg["store"]["budget"] = BUDGET
    cfg["train"].update(epochs=2, checkpoint_every=2, async_checkpoint=True)
    config.write_text(yaml.safe_dump(cfg))
    output, log = tmp_path / "out", tmp_path / "run.log"
    restarts: list[threading.Thread] = []
    killed: list[str] = []
    with DiskSampler(output / "store") as disk:
        launch, started = _launch(config, log), time.time()
        for victim in victims:
            deadline = time.monotonic() + 240
            if victim == "server":  # a random moment while the answers come in
                answered = rng.randint(5, 60)
                while _answers_written(output) < answered and launch.poll() is None:
                    assert time.monotonic() < deadline, log.read_text()[-3000:]
                    time.sleep(0.02)
                server = rng.choice(servers)
                server.send(signal.SIGKILL)
                server.process.wait()
                thread = threading.Thread(target=lambda s=server: (s.stop(), s.start().wait_ready(240)))
                thread.start()
                restarts.append(thread)
                killed.append(victim)
                continue  # the launch goes on with the other server
            # A random moment once this launch trains.
            while _trained_steps(output, started) < 1 and launch.poll() is None:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            # After a restart the run is shorter (answers cached, released uses re-extracted at once): a shorter
            # window keeps the later kills inside it.
            time.sleep(rng.uniform(0.0, 4.0 if killed == ["server"] else 1.0))
            if launch.poll() is not None:  # it finished before this kill: nothing left to disturb
                break
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank_pids(output)[f"{victim}-0"], signal.SIGKILL)
                killed.append(victim)
            _end(launch, output)
            launch, started = _launch(config, log), time.time()
        try:
            assert launch.wait(timeout=400) == 0, f"seed {seed}, kills {victims}:\n" + log.read_text()[-4000:]
        finally:
            _end(launch, output, timeout=0)
            for thread in restarts:
                thread.join()
    text = log.read_text()
    assert killed == victims, f"seed {seed}: the run ended before every kill ({killed} of {victims})"
    assert text.count("Signal 9 (SIGKILL) received") == 2, text[-3000:]  # the two ranks; the server aside
    assert disk.peak <= BUDGET, (seed, disk.peak)
    assert_exactly_once(output, epochs=2)
    summary = json.loads((output / "summary.json").read_text())
    assert summary["missing_parts"] == [] and summary["steps"] > 0
    assert "out of rotation" in text, f"seed {seed}: the server kill was not noticed"
    # Every kept sample has an answer, and the cache gives each its first one written.
    first: dict[int, dict] = {}
    for record in cache_lines(output):
        if record["sample_id"] not in first or record["t"] < first[record["sample_id"]]["t"]:
            first[record["sample_id"]] = record
    kept = {i for path in (output / "data").glob("report-*.json") for i in json.loads(path.read_text())["sample_ids"]}
    assert kept and kept <= set(first), f"seed {seed}: kept samples without an answer"
    cache = _cache(config)
    assert all(cache.get(i) == record["tokens"] for i, record in first.items()), seed


def _cache(config: Path):
    from dflash_stream.config import load_config
    from dflash_stream.regenerate.cache import ResponseCache, answers_key
    from dflash_stream.target_model.loading import load_tokenizer, target_stop_ids

    cfg = load_config(config)
    tokenizer = load_tokenizer(cfg.target)
    return ResponseCache(cfg.output_dir, answers_key(cfg, tokenizer, target_stop_ids(cfg.target, tokenizer)), "check")
