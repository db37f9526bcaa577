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
    config = write_run_config(tmp_path, tiny_target_dir, rows=160)
    output = tmp_path / "out"
    first = _accelerate_run(config, tmp_path / "first.log")
    _wait_for(lambda: any(e["event"] == "train" for e in events(output)), 240, "training to start")
    workers = rank_pids(output)
    os.kill(first.pid, signal.SIGKILL)  # the launcher alone: its workers run in sessions of their own
    first.wait()
    # Rerun at once, and again while it is refused, until it finishes.
    refusals = []
    for attempt in range(6):
        log = tmp_path / f"rerun-{attempt}.log"
        rerun = _accelerate_run(config, log)
        assert rerun.wait(timeout=400) in (0, 1, 2), log.read_text()[-3000:]
        if rerun.returncode == 0:
            break
        refusals += [line for line in log.read_text().splitlines() if "in use" in line]
        assert refusals, log.read_text()[-3000:]
        time.sleep(1)
    assert rerun.returncode == 0, (tmp_path / f"rerun-{attempt}.log").read_text()[-3000:]
    # The orphans noticed their launcher die and stopped, instead of running beside the rerun.
    assert not [pid for pid in workers.values() if _alive(pid)]
    for line in refusals:  # one line, naming the holder
        assert "pid " in line and "since " in line and "host " in line
    first_log = (tmp_path / "first.log").read_text()
    assert "stop requested by SIGTERM" in first_log, first_log[-3000:]
    assert_exactly_once(output, epochs=2)
