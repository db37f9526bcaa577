"""`status` and `report` on realistic metrics folders: a finished, a running and a crashed run."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from dflash_stream.cli import main
from dflash_stream.observe.metrics import read_metrics
from dflash_stream.observe.report import build_figures, write_report
from dflash_stream.observe.status import collect_status, render_status

BUDGET = 4 * 2**30
SEGMENT = 2**28
SLOTS = 15
STEP_S = 10.0  # one segment per extractor and five trainer steps every STEP_S seconds


FINISHED_SUMMARY = {"steps": 100, "samples": 320, "peak_store_bytes": 3 * 2**30, "extract_seconds": 201.5,
                    "extractor_backpressure_seconds": 20.0,
                    "eval": {"acceptance_length": 2.5, "matches_target": True}}


def write_run(out: Path, pid: int, t0: float, segments: int = 20, total: int = 400, finished: bool = False) -> None:
    """Metrics of two extractors and one trainer, line for line as the pipeline's MetricsWriter writes them."""
    lines: dict[str, list[dict]] = defaultdict(list)

    def log(role: str, rank: int, t: float, event: str, **fields) -> None:
        lines[f"{role}-{rank}"].append({"time": t, "role": role, "rank": rank, "event": event, **fields})

    for role, rank in (("extractor", 0), ("extractor", 1), ("trainer", 0)):
        log(role, rank, t0, "start", pid=pid, host=socket.gethostname(), config={})
    used = written = released = 0
    for i in range(1, segments + 1):
        t = t0 + STEP_S * i
        for rank in (0, 1):
            log("extractor", rank, t, "extract", samples=8 * i, tokens=2400 * i, samples_total=total // 2,
                tok_s=240.0 + rank, backpressure_s=max(0.0, 2.0 * (i - 10)))
        written += 2
        used = min(BUDGET, used + 2 * SEGMENT)
        if i % 4 == 0:
            released += 4
            used -= 4 * SEGMENT // 2
        log("extractor", 0, t + 0.1, "store", used_bytes=used, reserved_bytes=SEGMENT // 2, budget_bytes=BUDGET,
            ready=written - released - 1, claimed=1, segments_written=written, segments_released=released)
        log("trainer", 0, t + 0.2, "train", step=5 * i, total_steps=10 * segments, loss=6.0 * math.exp(-i / 8),
            acc=[0.8 * 0.9**k * i / segments for k in range(SLOTS)], tau=1.0 + 3.0 * i / segments, lr=6e-4,
            tokens=4000 * i, tok_s=400.0, data_wait_s=0.5 * i, epoch=0)
        if i % 4 == 0:
            ckpt = out / "checkpoints" / f"step-{5 * i}"
            ckpt.mkdir(parents=True)
            (ckpt / "COMPLETE").touch()
            log("trainer", 0, t + 0.3, "checkpoint", step=5 * i, path=str(ckpt), released=4, stall_s=0.5 * i,
                write_s=0.4 * i, bytes=3 * 2**20)
    if finished:
        for key in list(lines):
            role, rank = key.rsplit("-", 1)
            log(role, int(rank), t0 + STEP_S * segments + 1, "end", summary={})
        (out / "summary.json").write_text(json.dumps(FINISHED_SUMMARY))
    (out / "metrics").mkdir(parents=True, exist_ok=True)
    for key, records in lines.items():
        (out / "metrics" / f"{key}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_status_running_run_has_progress_eta_and_rates(tmp_path: Path) -> None:
    now = time.time()
    write_run(tmp_path, pid=os.getpid(), t0=now - 20 * STEP_S - 5)
    s = collect_status(tmp_path, now=now)
    assert s["state"] == "running"
    x = s["extraction"]
    assert (x["samples"], x["samples_total"]) == (320, 400)
    assert x["progress"] == pytest.approx(0.8)
    # Each extractor makes 8 samples per STEP_S: 2 x 0.8 samples/s, 80 left -> 50 s.
    assert x["samples_per_s"] == pytest.approx(1.6)
    assert x["eta_s"] == pytest.approx(50.0)
    assert x["tok_s"] == pytest.approx(481.0)
    assert x["backpressure_s"] == pytest.approx(20.0)  # the longest-blocked extractor, as summary.json counts it
    b = s["buffer"]
    assert b["budget_bytes"] == BUDGET
    assert b["fill"] == pytest.approx((b["used_bytes"] + SEGMENT // 2) / BUDGET)
    t = s["training"]
    assert (t["step"], t["tau"], t["data_wait_s"]) == (100, pytest.approx(4.0), pytest.approx(10.0))
    # 5 steps per STEP_S: 100 of 200 steps left at 0.5 steps/s.
    assert (t["total_steps"], t["progress"], t["eta_s"]) == (200, 0.5, pytest.approx(200.0))
    page = render_status(s)
    assert "step 100 / 200 (50.0%), ETA 3m 20s" in page and "blocked on a full buffer 20.0s" in page
    assert t["loss"] == pytest.approx(6.0 * math.exp(-20 / 8))
    assert s["checkpoints"] == {"count": 5, "latest_step": 100, "latest": str(tmp_path / "checkpoints" / "step-100"),
                                "written": 5, "stall_s": pytest.approx(30.0), "write_s": pytest.approx(24.0),
                                "last_bytes": 3 * 2**20}
    assert "5 written of 3.0 MiB: training stood still 30.0s (mean 6.0s each; writing 24.0s)" in page


def test_status_names_a_dead_rank_of_a_running_run(tmp_path: Path) -> None:
    now = time.time()
    write_run(tmp_path, pid=os.getpid(), t0=now - 20 * STEP_S - 5)
    path = tmp_path / "metrics" / "extractor-1.jsonl"
    path.write_text(path.read_text().replace(f'"pid": {os.getpid()}', f'"pid": {_dead_pid()}'))
    s = collect_status(tmp_path, now=now)
    assert s["state"] == "running" and s["state_reason"].endswith("extractor 1 died")


def test_status_finished_run_reads_summary(tmp_path: Path, capsys) -> None:
    write_run(tmp_path, pid=_dead_pid(), t0=time.time() - 3600, finished=True)
    s = collect_status(tmp_path)
    assert s["state"] == "finished"
    assert s["summary"] == FINISHED_SUMMARY
    assert s["extraction"]["eta_s"] is None
    assert main(["status", str(tmp_path), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["state"] == "finished"
    assert status["extraction"]["backpressure_s"] == FINISHED_SUMMARY["extractor_backpressure_seconds"]
    assert main(["status", str(tmp_path)]) == 0
    page = capsys.readouterr().out
    # The summary as a table of every figure, not a cut line of JSON.
    assert "{" not in page and "  eval.acceptance_length  " in page.replace("   ", "  ")
    assert "peak_store_bytes" in page and "3,221,225,472 (3.0 GiB)" in page and "201.50 (3m 22s)" in page


def test_status_crashed_run_dead_pid(tmp_path: Path, capsys) -> None:
    now = time.time()
    write_run(tmp_path, pid=_dead_pid(), t0=now - 20 * STEP_S - 5)
    s = collect_status(tmp_path, now=now)
    assert s["state"] == "crashed"
    assert all(r["alive"] is False for r in s["ranks"])
    assert s["extraction"]["eta_s"] is None
    assert s["checkpoints"]["latest_step"] == 100
    assert main(["status", str(tmp_path)]) == 0
    page = capsys.readouterr().out
    assert "CRASHED" in page and "step 100" in page and "320 / 400 samples" in page


def test_status_other_host_goes_stale(tmp_path: Path) -> None:
    """Ranks on other hosts cannot be probed: silence beyond the stale limit means crashed."""
    now = time.time()
    write_run(tmp_path, pid=1, t0=now - 20 * STEP_S - 5)
    for path in (tmp_path / "metrics").glob("*.jsonl"):
        path.write_text(path.read_text().replace(socket.gethostname(), "elsewhere"))
    assert collect_status(tmp_path, now=now)["state"] == "running"
    assert collect_status(tmp_path, now=now + 3600)["state"] == "crashed"


def test_status_rejects_a_folder_without_metrics(tmp_path: Path, capsys) -> None:
    assert main(["status", str(tmp_path)]) == 2
    assert "no metrics/ folder" in capsys.readouterr().err


def test_report_pngs_match_metrics(tmp_path: Path) -> None:
    write_run(tmp_path, pid=_dead_pid(), t0=1_000_000.0, finished=True)
    events = read_metrics(tmp_path)
    figs = build_figures(events)
    assert set(figs) == {"buffer", "rates", "loss", "accuracy", "checkpoints"}

    stores = [e for e in events if e["event"] == "store"]
    used_line, budget_line = figs["buffer"].axes[0].lines
    assert list(used_line.get_ydata()) == pytest.approx([e["used_bytes"] / 2**30 for e in stores])
    assert list(budget_line.get_ydata()) == pytest.approx([4.0] * len(stores))

    ext1 = [e for e in events if e["event"] == "extract" and e["rank"] == 1]
    train = [e for e in events if e["event"] == "train"]
    rates = {line.get_label(): line for line in figs["rates"].axes[0].lines}
    # Rates are binned (at least three report periods wide; minutes on the axis): over the bins they must add up
    # to every token each rank reported.
    extractor_rates = rates["extractor 1 tok/s"].get_ydata()
    width = 60 * float(np.diff(rates["extractor 1 tok/s"].get_xdata())[0])
    assert width >= 3 * STEP_S
    assert np.nansum(extractor_rates) * width == pytest.approx(ext1[-1]["tokens"])
    assert extractor_rates[:-1] == pytest.approx([2400 / STEP_S] * (len(extractor_rates) - 1))
    trainer_rates = rates["trainer 0 tok/s"].get_ydata()
    assert np.nansum(trainer_rates) * width == pytest.approx(train[-1]["tokens"])
    blocked = {line.get_label(): line for line in figs["rates"].axes[1].lines}
    assert list(blocked["extractor 1: blocked on full buffer"].get_ydata()) == [e["backpressure_s"] / 60 for e in ext1]

    loss_line = figs["loss"].axes[0].lines[0]
    assert list(loss_line.get_xdata()) == [e["step"] for e in train]
    assert list(loss_line.get_ydata()) == [e["loss"] for e in train]
    slots = figs["accuracy"].axes[0].lines
    assert len(slots) == SLOTS
    assert list(slots[2].get_ydata()) == [e["acc"][2] for e in train]

    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    stall_line, write_line = figs["checkpoints"].axes[0].lines
    assert list(stall_line.get_ydata()) == [e["stall_s"] for e in checkpoints]
    assert list(write_line.get_ydata()) == [e["write_s"] for e in checkpoints]
    assert "Checkpoints: 5, 3.0 MiB each; training stood still 30.0 s in all" in figs["checkpoints"].axes[0].get_title()

    paths = write_report(tmp_path)
    assert sorted(p.name for p in paths) == ["accuracy.png", "buffer.png", "checkpoints.png", "loss.png", "rates.png"]
    for path in paths:
        image = imread(path)
        assert image.shape[0] > 300 and image.shape[1] > 600
        assert image.std() > 0.05  # not a blank canvas


def test_status_prefers_the_live_store(tmp_path: Path, capsys) -> None:
    """With the store reachable, its own status (not the last metrics line) gives the buffer figures."""
    import numpy as np
    import torch
    import yaml

    from dflash_stream.store import Sample, Store

    now = time.time()
    write_run(tmp_path, pid=os.getpid(), t0=now - 20 * STEP_S - 5)
    store_path = tmp_path / "store"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"store": {"path": str(store_path)}}))
    store = Store.open(store_path, budget=64 * 2**20, codec="lossless", reuse=1,
                       fingerprint={"layer_ids": [1, 2], "hidden_size": 8}, max_segment_raw_bytes=2**20)
    samples = [Sample(i, np.arange(10, dtype=np.int32), np.ones(10, dtype=bool),
                      torch.randn(10, 16).to(torch.bfloat16)) for i in range(3)]
    store.writer("extractor-0").write(samples)
    live = store.status()

    b = collect_status(tmp_path, now=now)["buffer"]
    assert b["source"].startswith("live store status")
    assert (b["used_bytes"], b["budget_bytes"], b["ready"], b["claimed"]) == (live["used_bytes"], 64 * 2**20, 1, 0)
    assert b["segments_written"] == 40  # only the metrics count segments ever written
    assert main(["status", str(tmp_path)]) == 0
    assert "live store status" in capsys.readouterr().out


def test_status_watch_returns_once_the_run_is_over(tmp_path: Path, capsys) -> None:
    write_run(tmp_path, pid=_dead_pid(), t0=time.time() - 3600, finished=True)
    assert main(["status", str(tmp_path), "--watch", "--interval", "0.01"]) == 0
    assert "FINISHED" in capsys.readouterr().out


def test_plots_scale_to_their_data_and_legend_only_drawn_series() -> None:
    """An untrained first loss far above the rest, accuracies of a few percent, and a second trainer with one
    report (no rate to draw): the axes follow the data and the legends name only what is drawn."""
    t0, events = 1_000_000.0, []
    for i in range(40):
        t = t0 + 10.0 * i
        events.append({"time": t, "role": "extractor", "rank": 0, "event": "extract", "samples": 4 * i,
                       "tokens": 1000 * i, "backpressure_s": 0.5 * i})
        events.append({"time": t + 1, "role": "trainer", "rank": 0, "event": "train", "step": 5 * i,
                       "loss": 10.8 if i == 0 else 3.0 - 0.01 * i, "tau": 1.0 + 0.002 * i,
                       "acc": [0.05 * i / 40, 0.01], "tokens": 900 * i})
    events.append({"time": t0 + 50, "role": "trainer", "rank": 1, "event": "train", "step": 25, "loss": 3.0,
                   "tau": 1.0, "acc": [0.0, 0.0], "tokens": 500})
    figs = build_figures(sorted(events, key=lambda e: e["time"]))

    loss_ax = figs["loss"].axes[0]
    low, high = loss_ax.get_ylim()
    assert low > 2.5 and high < 3.2  # the curve after the first point fills the axis
    assert any("off the axis: step 0 loss 10.80" in text.get_text() for text in loss_ax.texts)
    assert figs["accuracy"].axes[0].get_ylim()[1] == pytest.approx(0.05 * 39 / 40 * 1.35)

    top, bottom = figs["rates"].axes
    assert [t.get_text() for t in top.get_legend().get_texts()] == ["extractor 0 tok/s", "trainer 0 tok/s"]
    assert len(bottom.get_legend().get_texts()) == 3  # extractor 0 blocked, trainers 0 and 1 waited
    assert bottom.get_ylim()[1] == pytest.approx(0.5 * 39 / 60 * 1.3)  # minutes blocked, scaled to the data
