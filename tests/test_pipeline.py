"""The main job end to end: `accelerate launch ... run` with real processes, kills at random moments, resume,
the exactly-once audit, the budget measured from outside, and bad configs refused before any work."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from dflash_stream.cli import main
from dflash_stream.observe.status import collect_status
from dflash_stream.pipeline.audit import audit_run
from dflash_stream.pipeline.rollback import ReleaseJournal
from dflash_stream.rundir import RunDir

REPO = Path(__file__).parent.parent
LAUNCH_2CPU = REPO / "launch" / "cpu-2proc.yaml"
BUDGET = 1_200_000


def _rows(n: int) -> list[dict]:
    """Real text: docstrings of the standard library, as prompt/response pairs."""
    import inspect
    import json as json_mod
    import pathlib
    import textwrap

    texts = []
    for module in (json_mod, pathlib, textwrap, inspect, random, threading, subprocess):
        for name in sorted(dir(module)):
            doc = inspect.getdoc(getattr(module, name, None)) or ""
            if 120 < len(doc) < 600:
                texts.append((name, doc))
    rows = [{"prompt": f"What does `{name}` do?", "response": doc} for name, doc in texts]
    return rows[:n]


def write_run_config(tmp: Path, target_dir: Path, rows: int = 48, **overrides) -> Path:
    data = tmp / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(rows)))
    cfg = {
        "output_dir": str(tmp / "out"),
        "target": {"model": str(target_dir), "dtype": "float32", "device": "cpu", "num_capture_layers": 3},
        "data": {"sources": [{"path": str(data), "format": "prompt_response"}], "max_length": 96},
        "extract": {"batch_tokens": 512},
        "store": {"path": str(tmp / "out" / "store"), "budget": BUDGET, "segment_bytes": 100_000},
        "drafter": {"num_layers": 1, "block_size": 4},
        "train": {"epochs": 2, "batch_tokens": 256, "num_anchors": 8, "checkpoint_every": 4, "log_every": 2},
        "roles": {"trainers": 1},
    }
    for dotted, value in overrides.items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class DiskSampler:
    """Measures the store directory from outside, as `du` would, while a run goes on."""

    def __init__(self, path: Path) -> None:
        self.path, self.peak, self._stop = path, 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _size(self) -> int:
        total = 0
        for root, dirs, files in os.walk(self.path):
            for name in dirs + files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._size())
            time.sleep(0.02)

    def __enter__(self) -> DiskSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def launch(config: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(LAUNCH_2CPU),
           "-m", "dflash_stream", "run", "--config", str(config)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 400) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def events(output: Path) -> list[dict]:
    found = []
    for path in (output / "metrics").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line being written right now
                found.append(json.loads(line))
    return found


def rank_pids(output: Path) -> dict[str, int]:
    return {f"{e['role']}-{e['rank']}": e["pid"] for e in events(output) if e["event"] == "start"}


def assert_exactly_once(output: Path, epochs: int) -> None:
    report = audit_run(output)
    assert report["ok"], report
    assert len(report["passes"]) == epochs
    for p in report["passes"]:
        assert p["expected"] > 0 and p["missing"] == 0 and p["duplicated"] == 0


@pytest.mark.slow
def test_combined_run_under_accelerate(tiny_target_dir, tmp_path):
    config = write_run_config(tmp_path, tiny_target_dir, rows=120)
    with DiskSampler(tmp_path / "out" / "store") as disk:
        out = finish(launch(config))
    output = tmp_path / "out"
    summary = json.loads((output / "summary.json").read_text())
    for key in ("samples_extracted", "tokens_extracted", "samples_trained", "budget_bytes", "peak_store_bytes",
                "wall_seconds", "extract_seconds", "train_seconds", "trainer_data_wait_seconds",
                "extractor_backpressure_seconds", "final_loss", "checkpoint"):
        assert key in summary, key
    assert summary["samples_trained"] == 2 * summary["samples_extracted"] > 0
    # The extractor leaves after trainer 0's part: its figures are merged all the same (issue 26, item 5).
    extractor = json.loads((output / "summary-parts" / "extractor-0.json").read_text())
    assert summary["missing_parts"] == [] and summary["extract_seconds"] == round(extractor["extract_seconds"], 2) > 0
    # Each rank's own CPU time (its threads' too), as its part gave it; a process's start before the run's clock
    # (imports, loading) is in it, hence the slack.
    cores = len(os.sched_getaffinity(0))
    assert summary["process_cpu_seconds"]["extractor-0"] == extractor["cpu_seconds"]
    assert set(summary["process_cpu_seconds"]) == {"extractor-0", "trainer-0"}
    assert all(0 < s < (summary["wall_seconds"] + 60) * cores for s in summary["process_cpu_seconds"].values())
    assert "process_cpu_seconds.trainer-0" in out
    # What checkpoints cost: each one's stall and write time in the metrics, their totals in the summary.
    timed = [e for e in events(output) if e["event"] == "checkpoint" and e["rank"] == 0]
    assert summary["checkpoints"] == len(timed) > 1
    assert all(e["write_s"] > 0 and e["bytes"] > 0 and e["stall_s"] > 0 for e in timed)
    # Written synchronously, training stands still for the whole write; in the background (the default) only
    # for the snapshot and the publish, or while a starved or stopping trainer waits for the write.
    assert all(e["stall_s"] >= e["write_s"] for e in timed if not e["background"])
    assert any(e["background"] for e in timed)
    assert summary["checkpoint_stall_seconds"] == pytest.approx(sum(e["stall_s"] for e in timed), abs=0.02)
    assert disk.peak <= BUDGET, f"store reached {disk.peak} bytes on disk, budget {BUDGET}"
    # The budget forced the buffer to wrap: far more data passed through than it can hold at once.
    assert summary["tokens_extracted"] * 3 * 64 * 2 > 2 * BUDGET
    assert (Path(summary["checkpoint"]) / "model.safetensors").is_file()
    assert_exactly_once(output, epochs=2)
    assert "run summary" in out
    # Watching agrees with the summary: the same backpressure, 100 % done, one line per backpressure spell.
    status = collect_status(output)
    assert status["extraction"]["backpressure_s"] == summary["extractor_backpressure_seconds"]
    assert status["extraction"]["progress"] == 1.0 and status["training"]["progress"] == 1.0
    assert status["checkpoints"]["written"] == summary["checkpoints"]
    held = [line for line in out.splitlines() if "held back by the full buffer (" in line]
    assert summary["extractor_backpressure_seconds"] == 0 or 1 <= len(held) <= 3, held


def kill(proc: subprocess.Popen, output: Path, victim: str) -> None:
    """kill -9 of one rank, or of the whole job at once as a node failure would: launcher and every rank. A launch
    that failed before the kill fails the test with its output."""
    ended = proc.poll()
    if victim == "launch":
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in rank_pids(output).values():  # torchrun starts its workers in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    else:
        with contextlib.suppress(ProcessLookupError):  # it may have ended already: the run finished, or failed
            os.kill(rank_pids(output)[victim], signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert ended is None or (output / "summary.json").exists(), f"the launch failed before the kill:\n{out[-4000:]}"


def released_since_checkpoint(output: Path) -> bool:
    """Whether trainer 0's journal holds uses released after its latest complete checkpoint: a crash now must have
    them extracted again."""
    latest = RunDir(output).latest_checkpoint()
    step = int(latest.name.removeprefix("step-")) if latest is not None else 0
    return bool(ReleaseJournal(output, 0).released_after(step))


def running(proc: subprocess.Popen, deadline: float) -> bool:
    return proc.poll() is None and time.time() < deadline


def kill_rounds(config: Path, output: Path, victims: tuple[str, str]) -> bool:
    """Each of `victims` in turn killed at a random moment once training is under way in a launch and segment uses
    were released since the latest checkpoint. False if a launch finished the run before its kill (a tiny run on
    a fast machine): nothing was tested."""
    journal = output / "ledger" / "released-trainer-0.jsonl"
    rng = random.Random()
    for killed in victims:
        for _ in range(3):  # again, should a checkpoint land between the last look and the kill
            started = time.time()
            proc = launch(config)
            deadline = started + 180
            # Training under way in this launch, with the extractor held back by the small budget, and uses
            # released since the latest checkpoint: the kill lands mid-stream on both sides.
            while running(proc, deadline) and not (
                    any(e["event"] == "train" and e["time"] > started for e in events(output))
                    and journal.is_file() and journal.stat().st_size > 0):
                time.sleep(0.1)
            time.sleep(rng.uniform(0.0, 1.0))
            # A checkpoint may have emptied the journal meanwhile: kill at the next moment it holds a release.
            while running(proc, deadline) and not (journal.is_file() and journal.stat().st_size > 0):
                time.sleep(0.01)
            kill(proc, output, killed)
            if (output / "summary.json").exists():
                return False
            # An extractor's kill stops the trainer by SIGTERM, which checkpoints: nothing to extract again.
            if killed == "extractor-0" or released_since_checkpoint(output):
                break
    return True


# Each victim is killed first in one test and second in another; the epochs come by reuse and by re-extraction.
KILL_ROUNDS = {"extractor-0": ("trainer-0", "reuse"), "trainer-0": ("launch", "reextract"),
               "launch": ("extractor-0", "reuse")}


@pytest.mark.slow
@pytest.mark.parametrize("victim", list(KILL_ROUNDS))
def test_kill_at_random_moment_then_resume(tiny_target_dir, tmp_path, victim):
    """train.release on_use (the default): two rounds, `victim` then another rank or the whole launch, each
    killed at a random moment once training is under way and segment uses were released since the latest
    checkpoint, so that a resume must have them extracted again; then a run to the end. The audit is exact, the
    rolled-back uses were all extracted and trained again, and the store stayed within its budget throughout,
    as measured from outside."""
    second, epoch_source = KILL_ROUNDS[victim]
    config = write_run_config(tmp_path, tiny_target_dir, rows=64, **{"train.epoch_source": epoch_source})
    output = tmp_path / "out"
    for _ in range(3):  # again from the start, should a launch finish the run before its kill could land
        with DiskSampler(output / "store") as disk:
            if kill_rounds(config, output, (victim, second)):
                finish(launch(config))
                break
        shutil.rmtree(output)
    else:
        pytest.fail("every time, a launch finished the run before its kill")
    assert disk.peak <= BUDGET
    assert_exactly_once(output, epochs=2)
    report = audit_run(output)
    rolled_back = report["rolled_back"]
    assert rolled_back and all(r["redone"] for r in rolled_back), rolled_back
    # Each rolled-back sample is trained again under its request's tag, or its replacement's training was undone
    # by a later crash in turn and a later request holds it; the ledger's redone ones belong to their request.
    requests = {r["tag"]: r for r in (json.loads(p.read_text()) for p in (output / "store" / "redo").glob("*.json"))}
    redone = {(e["redo"], i) for _, f in RunDir(output).ledger_files() for line in f.read_text().splitlines()
              if "redo" in (e := json.loads(line)) for i in e["sample_ids"]}
    assert all(i in requests[tag]["sample_ids"] for tag, i in redone if tag in requests), redone
    for tag, r in requests.items():
        for i in r["sample_ids"]:
            assert (tag, i) in redone or any(i in later["sample_ids"] for later in requests.values()
                                             if later["time"] > r["time"]), (tag, i)
    assert not report["quarantined"], report  # a second resume reads no released segment


@pytest.mark.slow
def test_single_process_mode(tiny_target_dir, tmp_path):
    config = write_run_config(tmp_path, tiny_target_dir, **{"train.epochs": 1})
    assert main(["run", "--config", str(config)]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["samples_trained"] == summary["samples_extracted"] > 0
    assert_exactly_once(tmp_path / "out", epochs=1)


def _refused(config: Path, capsys, *args: str, env: dict[str, str] | None = None, monkeypatch=None) -> str:
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    assert main(["run", "--config", str(config), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dflash-stream: error:")
    return err


@pytest.mark.parametrize(
    "args, env, words",
    [
        (["--roles.trainers=2"], {"WORLD_SIZE": "2", "RANK": "0"}, ["roles.trainers=2", "no extractor"]),
        (["--roles.trainers=1"], {"WORLD_SIZE": "1", "RANK": "0", "_MODE": "split"}, ["roles.trainers=1"]),
        (["--target.layer_ids=[1,2,9]"], {}, ["target.layer_ids", "6 decoder layers"]),
        (["--store.budget=10kB"], {}, ["budget"]),
    ],
)
def test_bad_config_refused_before_any_work(tiny_target_dir, tmp_path, capsys, monkeypatch, args, env, words):
    config = write_run_config(tmp_path, tiny_target_dir)
    if env.pop("_MODE", None):
        args = [*args, "--roles.mode=split"]
    err = _refused(config, capsys, *args, env=env, monkeypatch=monkeypatch)
    for word in words:
        assert word in err
    assert not (tmp_path / "out" / "metrics").exists(), "work started before the config was refused"


def test_store_from_another_config_refused(tiny_target_dir, tmp_path, capsys):
    config = write_run_config(tmp_path, tiny_target_dir, **{"train.epochs": 1})
    assert main(["run", "--config", str(config), "--data.sources.0.limit=4"]) == 0
    err = _refused(config, capsys, "--data.sources.0.limit=4", "--data.max_length=64")
    assert "max_length" in err


def test_a_finished_run_reads_100_percent_and_a_max_steps_stop_is_named(tiny_target_dir, tmp_path, capsys):
    """What a user watches agrees with the run: status at 100 % with the trainer's final step count, the
    training bar at 100 %, backpressure as summary.json has it, the summary as a table; `audit` of a run that
    train.max_steps stopped says so."""
    config = write_run_config(tmp_path, tiny_target_dir, rows=24, **{"train.epochs": 1})
    assert main(["run", "--config", str(config)]) == 0
    captured = capsys.readouterr()
    bars = re.findall(r"train: +(\d+)%\|[^|]*\| (\d+)/(\d+) ", captured.err)
    assert bars and bars[-1][0] == "100" and bars[-1][1] == bars[-1][2]
    assert "run summary" in captured.out and "{" not in captured.out.split("run summary")[1]
    output = tmp_path / "out"
    assert main(["status", str(output), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    summary = json.loads((output / "summary.json").read_text())
    assert status["state"] == "finished"
    assert status["extraction"]["progress"] == 1.0
    assert status["extraction"]["backpressure_s"] == summary["extractor_backpressure_seconds"]
    assert status["training"]["step"] == status["training"]["total_steps"] == summary["steps"]
    assert status["training"]["progress"] == 1.0

    (tmp_path / "short").mkdir()
    config = write_run_config(tmp_path / "short", tiny_target_dir, rows=24, **{"train.max_steps": 2})
    assert main(["run", "--config", str(config)]) == 0
    capsys.readouterr()
    assert main(["audit", str(tmp_path / "short" / "out")]) == 0
    page = capsys.readouterr().out
    assert "OK: stopped by train.max_steps=2 at step 2, before the end of the data" in page
    assert "none trained twice, none unexpected" in page
