"""Faults with real launches: the launcher killed alone (orphaned workers, a rerun at once), a disk smaller than
the budget, and two separate launches (`extract` and `train`) sharing one store, with kills."""

from __future__ import annotations

import contextlib
import json
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


def _launch(config: Path, log: Path, *command: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A launch whose output goes to a file: orphans keep their inherited output open long after a kill."""
    cmd = [sys.executable, "-m", *command, "--config", str(config)]
    with open(log, "a") as out:
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})


def _accelerate_run(config: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return _launch(config, log, "accelerate.commands.launch", "--config_file", str(LAUNCH_2CPU), "-m",
                   "dflash_stream", "run", env=env)


def test_kill_9_during_a_background_checkpoint_write_then_resume(tiny_target_dir, tmp_path):
    """train.async_checkpoint (the default): the whole job is killed while a checkpoint is being written in the
    background (held half-way by the test hook: the trainer's own file written, the drafter and optimizer not).
    The folder has no COMPLETE; the rerun resumes from the previous complete checkpoint (or from scratch), redoes
    what followed it, and the audit is exact, with the store within its budget throughout."""
    from test_pipeline import BUDGET, DiskSampler

    from dflash_stream.pipeline.checkpoint import WRITE_DELAY_ENV
    from dflash_stream.rundir import RunDir

    config = write_run_config(tmp_path, tiny_target_dir, rows=80)
    output = tmp_path / "out"
    run = RunDir(output)
    half_written = lambda: [p for p in run.checkpoints.glob(".step-*.tmp") if (p / "trainer-0.pt").is_file()]  # noqa: E731
    with DiskSampler(output / "store") as disk:
        first = _accelerate_run(config, tmp_path / "first.log", env={WRITE_DELAY_ENV: "60"})
        _wait_for(lambda: bool(half_written()) or first.poll() is not None, 240, "a checkpoint being written")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        staging = half_written()[0]
        os.killpg(first.pid, signal.SIGKILL)  # the whole job, as a node failure would
        for pid in rank_pids(output).values():  # torchrun starts its workers in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        first.wait()
        assert staging.is_dir() and not (staging / "COMPLETE").exists()
        step = int(staging.name.removeprefix(".step-").removesuffix(".tmp"))
        assert (run.latest_checkpoint() is None or int(run.latest_checkpoint().name.removeprefix("step-")) < step)
        assert not run.summary.exists(), "the kill came too late to test anything"
        rerun = _accelerate_run(config, tmp_path / "rerun.log")
        assert rerun.wait(timeout=400) == 0, (tmp_path / "rerun.log").read_text()[-3000:]
    assert disk.peak <= BUDGET
    assert_exactly_once(output, epochs=2)
    assert not list(run.checkpoints.glob(".step-*.tmp"))  # the interrupted attempt was cleared


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_kill_9_of_the_launcher_alone_then_rerun_at_once(tiny_target_dir, tmp_path):
    config = write_run_config(tmp_path, tiny_target_dir, rows=120)
    output = tmp_path / "out"
    first = _accelerate_run(config, tmp_path / "first.log")
    _wait_for(lambda: any(e["event"] == "train" for e in events(output)), 240, "training to start")
    workers = rank_pids(output)
    # A second launch typed by hand on the live output_dir is refused in one line naming the holder. The workers
    # are paused meanwhile (a paused holder is as live as a running one), so that the run cannot end before the
    # launcher is killed, however slowly the second launch starts on a busy machine.
    for pid in workers.values():
        os.kill(pid, signal.SIGSTOP)
    try:
        second = subprocess.run([sys.executable, "-m", "dflash_stream", "run", "--config", str(config)], cwd=REPO,
                                capture_output=True, text=True, timeout=300)
    finally:
        for pid in workers.values():
            os.kill(pid, signal.SIGCONT)
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
    # The orphaned trainer stopped on the SIGTERM its launcher's death sent, after a durable checkpoint (a new
    # one, or none when it had trained nothing since its last).
    assert "checkpoint step-" in first_log and "stopped by a signal after a durable checkpoint" in first_log, \
        first_log[-3000:]
    assert_exactly_once(output, epochs=2)


def test_separate_extract_and_train_launches_share_a_store_through_kills_and_damage(tiny_target_dir, tmp_path):
    from test_faults import _corrupt_first_state_chunk

    from dflash_stream.pipeline.audit import audit_run

    config = write_run_config(tmp_path, tiny_target_dir, rows=100)
    output, store = tmp_path / "out", tmp_path / "out" / "store"
    extract = _launch(config, tmp_path / "extract.log", "dflash_stream", "extract")
    _wait_for(lambda: (store / "store.json").exists(), 120, "the store")
    train = _launch(config, tmp_path / "train.log", "dflash_stream", "train")
    _wait_for(lambda: any(e["event"] == "train" for e in events(output)), 240, "training to start")
    # A second extraction on the same store is refused in one line naming the live one.
    second = subprocess.run([sys.executable, "-m", "dflash_stream", "extract", "--config", str(config)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 2 and f"pid {extract.pid}," in second.stderr.strip().splitlines()[-1], second.stderr
    os.kill(train.pid, signal.SIGKILL)
    train.wait()
    # While no trainer runs, the segments in the store are damaged (a bad disk): those the dead trainer had
    # not finished are found on resume (claimed ones returned to READY, a half-trained one re-read).
    damaged = sorted(os.listdir(store / "segments"))
    for seg in damaged:
        _corrupt_first_state_chunk(store / "segments" / seg)
    train = _launch(config, tmp_path / "train.log", "dflash_stream", "train")
    time.sleep(5)
    if extract.poll() is None:  # and the extraction dies too, then comes back
        os.kill(extract.pid, signal.SIGKILL)
        extract.wait()
        extract = _launch(config, tmp_path / "extract.log", "dflash_stream", "extract")
    assert train.wait(timeout=400) == 0, (tmp_path / "train.log").read_text()[-3000:]
    assert extract.wait(timeout=120) == 0, (tmp_path / "extract.log").read_text()[-3000:]
    report = audit_run(output)
    assert report["ok"], report
    quarantined = [q["segment_id"] for q in report["quarantined"]]
    assert quarantined and set(quarantined) <= set(damaged), (quarantined, damaged)
    assert f"quarantined damaged segment {quarantined[0]}" in (tmp_path / "train.log").read_text()


DAMAGING_RUN = """
import sys
from dflash_stream.store import segment
real_write = segment.write_file
def damaging_write(path, data):
    # A bad sector under the second segment's first chunk of states, found by the trainer's crc32c check.
    if path.parent.parent.name == "extractor-0.000001" and path.name == "c.0.0" and "hidden" in path.parent.name:
        data = bytes(data[:-8]) + b"\\0" * 8
    real_write(path, data)
segment.write_file = damaging_write
from dflash_stream.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _finish(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    """The launch's exit status checked, its log; killed as a whole (workers in their own sessions too) when it
    runs past `timeout`."""
    try:
        assert proc.wait(timeout=timeout) == 0, log.read_text()[-4000:]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in rank_pids(log.parent / "out").values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"the launch did not end within {timeout:.0f} s:\n{log.read_text()[-4000:]}") from None
    return log.read_text()


def test_a_summary_part_of_an_earlier_launch_does_not_end_re_extraction(tiny_target_dir, tmp_path):
    """Case 8: a launch on a folder an earlier launch finished (its summary parts are there, as when a user runs
    it again to fetch unanswered samples); a segment this launch writes is damaged. The extractor stays until
    this launch's trainer 0 says training is over, re-extracts the quarantined samples, and the run ends with
    every sample trained once."""
    from dflash_stream.pipeline.audit import audit_run

    config = write_run_config(tmp_path, tiny_target_dir, rows=48, **{"train.epochs": 1})
    parts = tmp_path / "out" / "summary-parts"
    parts.mkdir(parents=True)
    for role in ("trainer", "extractor"):
        (parts / f"{role}-0.json").write_text(json.dumps({"role": role, "index": 0, "written": time.time() - 3600}))
    script = tmp_path / "damaging_run.py"
    script.write_text(DAMAGING_RUN)
    log = tmp_path / "run.log"
    proc = _launch(config, log, "accelerate.commands.launch", "--config_file", str(LAUNCH_2CPU), str(script), "run")
    text = _finish(proc, log, 240)
    report = audit_run(tmp_path / "out")
    assert report["ok"] and [p["missing"] + p["duplicated"] for p in report["passes"]] == [0], report
    assert [q["segment_id"] for q in report["quarantined"]] == ["extractor-0.000001"]
    assert "extracted the" in text and "of quarantined part extractor-0.000001" in text


def test_max_steps_ends_the_launch_while_the_extractor_waits_for_room(tiny_target_dir, tmp_path):
    """Case 9: train.max_steps stops training while the extractor is held back by the full buffer (far more data
    than the budget): it leaves within a moment of trainer 0's word, and the launch ends without trainer 0
    waiting SUMMARY_WAIT_S for its summary part."""
    from dflash_stream.pipeline.run import SUMMARY_WAIT_S

    config = write_run_config(tmp_path, tiny_target_dir, rows=200, **{"train.max_steps": 2})
    log = tmp_path / "run.log"
    started = time.monotonic()
    text = _finish(_accelerate_run(config, log), log, SUMMARY_WAIT_S - 60)
    assert time.monotonic() - started < SUMMARY_WAIT_S - 60
    assert "held back by the full buffer" in text
    assert "training is over: extractor 0 leaves with part of its data not extracted" in text
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["missing_parts"] == []
