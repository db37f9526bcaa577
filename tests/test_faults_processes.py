"""Faults with real launches: the launcher killed alone (orphaned workers, a rerun at once), a disk smaller than
the budget, and two separate launches (`extract` and `train`) sharing one store, with kills."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_pipeline import LAUNCH_2CPU, REPO, assert_exactly_once, events, rank_pids, write_run_config

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its dead parent's reaper) counts as gone.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _launch(config: Path, log: Path, *command: str) -> subprocess.Popen:
    """A launch whose output goes to a file: orphans keep their inherited output open long after a kill."""
    cmd = [sys.executable, "-m", *command, "--config", str(config)]
    with open(log, "a") as out:
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _accelerate_run(config: Path, log: Path) -> subprocess.Popen:
    return _launch(config, log, "accelerate.commands.launch", "--config_file", str(LAUNCH_2CPU), "-m",
                   "dflash_stream", "run")


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_kill_9_of_the_launcher_alone_then_rerun_at_once(tiny_target_dir, tmp_path):
    config = write_run_config(tmp_path, tiny_target_dir, rows=240)
    output = tmp_path / "out"
    first = _accelerate_run(config, tmp_path / "first.log")
    _wait_for(lambda: any(e["event"] == "train" for e in events(output)), 240, "training to start")
    workers = rank_pids(output)
    # A second launch typed by hand on the live output_dir is refused in one line naming the holder.
    second = subprocess.run([sys.executable, "-m", "dflash_stream", "run", "--config", str(config)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 2, second.stderr[-3000:]
    refusal = second.stderr.strip().splitlines()[-1]
    assert refusal.startswith("dflash-stream: error: output_dir") and "is in use by a live process" in refusal
    assert f"pid {workers['extractor-0']}," in refusal and "host " in refusal and "since 20" in refusal
    os.kill(first.pid, signal.SIGKILL)  # the launcher alone: its workers run in sessions of their own
    first.wait()
    assert not (output / "summary.json").exists(), "the kill came too late to test anything"
    # Rerun at once, and again while it is refused, until it finishes.
    refusals = []
    for attempt in range(6):
        log = tmp_path / f"rerun-{attempt}.log"
        rerun = _accelerate_run(config, log)
        if attempt == 0:
            # Meanwhile the orphans notice their launcher die and stop (a trainer after its checkpoint).
            _wait_for(lambda: not any(_alive(pid) for pid in workers.values()), 60, "the orphaned workers to stop")
        assert rerun.wait(timeout=400) in (0, 1, 2), log.read_text()[-3000:]
        if rerun.returncode == 0:
            break
        refusals += [line for line in log.read_text().splitlines() if "in use" in line]
        assert refusals, log.read_text()[-3000:]
        time.sleep(1)
    assert rerun.returncode == 0, (tmp_path / f"rerun-{attempt}.log").read_text()[-3000:]
    for line in refusals:  # one line, naming the holder
        assert "pid " in line and "since " in line and "host " in line
    first_log = (tmp_path / "first.log").read_text()
    assert "checkpoint step-" in first_log and "(stop requested by SIGTERM)" in first_log, first_log[-3000:]
    assert_exactly_once(output, epochs=2)
