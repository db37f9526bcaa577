"""`dflash-stream status`: one view of a run across all ranks, from its output folder alone.

States: `finished` (summary.json present), `running` (a rank's process is alive, or it logged recently when it
runs on another host), `crashed` (no live process behind the ranks' `start` events, or silent for too long),
`ended` (every rank logged its `end`, as after a plain `extract` or `train`), `starting` (no metrics yet).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import yaml

from dflash_stream.observe.metrics import read_metrics
from dflash_stream.observe.summary import read_summary, summary_table
from dflash_stream.rundir import RunDir, checkpoint_step
from dflash_stream.units import fmt_bytes, fmt_count, fmt_duration

STALE_AFTER_S = 120.0  # a rank silent this long, whose process cannot be checked, is presumed stopped



def _ranks(events: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    ranks: dict[tuple[str, int], dict[str, Any]] = {}
    for e in events:
        r = ranks.setdefault((e["role"], e["rank"]), {"role": e["role"], "rank": e["rank"], "pid": None,
                                                       "host": None, "ended": False})
        r["last_time"] = e["time"]
        if e["event"] == "start":
            r.update(pid=e.get("pid"), host=e.get("host"), ended=False)
        elif e["event"] == "end":
            r["ended"] = True
    here = socket.gethostname()
    for r in ranks.values():
        r["silent_s"] = now - r["last_time"]
        # A pid can only be checked on its own host; elsewhere, silence is the only evidence.
        r["alive"] = psutil.pid_exists(r["pid"]) if r["pid"] and r["host"] == here and not r["ended"] else None
    return sorted(ranks.values(), key=lambda r: (r["role"], r["rank"]))


def _run_state(out: Path, ranks: list[dict[str, Any]]) -> tuple[str, str]:
    if RunDir(out).summary.is_file():
        return "finished", "summary.json written"
    if not ranks:
        return "starting", "no metrics yet"
    if all(r["ended"] for r in ranks):
        return "ended", "every rank logged its end; only `run` writes summary.json"
    if any(r["alive"] for r in ranks):
        gone = [f"{r['role']} {r['rank']}" for r in ranks if r["alive"] is False]
        return "running", "live process(es) on this host" + (f"; {', '.join(gone)} died" if gone else "")
    quiet = min(r["silent_s"] for r in ranks)
    if any(r["alive"] is False for r in ranks):
        return "crashed", f"no live process behind the ranks; last metrics {fmt_duration(quiet)} ago"
    if quiet > STALE_AFTER_S:
        return "crashed", f"no metrics for {fmt_duration(quiet)} (ranks on other hosts cannot be checked)"
    return "running", f"last metrics {fmt_duration(quiet)} ago"


def _latest(events: list[dict[str, Any]], name: str) -> dict[tuple[str, int], dict[str, Any]]:
    """The last event of a kind per (role, rank)."""
    last: dict[tuple[str, int], dict[str, Any]] = {}
    for e in events:
        if e["event"] == name:
            last[(e["role"], e["rank"])] = e
    return last


def _started(events: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """When each rank's current process began: its latest `start` event, else its first event."""
    first: dict[tuple[str, int], float] = {}
    for e in events:
        key = (e["role"], e["rank"])
        if key not in first or e["event"] == "start":
            first[key] = e["time"]
    return first


def _sample_rate(events: list[dict[str, Any]], key: tuple[str, int], since: float) -> float:
    """Samples/s of one extractor since its process started (a resumed rank's counter starts above 0)."""
    mine = [e for e in events if e["event"] == "extract" and (e["role"], e["rank"]) == key and e["time"] >= since]
    if len(mine) >= 2:
        first, last = mine[0], mine[-1]
        return (last["samples"] - first["samples"]) / max(last["time"] - first["time"], 1e-9)
    return mine[-1]["samples"] / max(mine[-1]["time"] - since, 1e-9) if mine else 0.0


def _extraction(events: list[dict[str, Any]], running: bool, summary: dict[str, Any] | None
                ) -> dict[str, Any] | None:
    last = _latest(events, "extract")
    if not last:
        return None
    started = _started(events)
    done = sum(e["samples"] for e in last.values())
    total = sum(e.get("samples_total") or 0 for e in last.values()) or None
    # Mean rate since each rank started: robust to the bursty per-segment cadence of extract events.
    rate = sum(_sample_rate(events, k, started[k]) for k in last)
    remaining = (total - done) if total else None
    return {
        "ranks": len(last), "samples": done, "samples_total": total,
        "progress": done / total if total else None,
        "tokens": sum(e["tokens"] for e in last.values()),
        "tok_s": sum(e.get("tok_s") or 0 for e in last.values()),
        "samples_per_s": rate,
        "eta_s": remaining / rate if running and remaining is not None and rate > 0 else None,
        # Time writes waited for room in the full buffer, of the longest-blocked extractor (as summary.json).
        "backpressure_s": summary["extractor_backpressure_seconds"] if summary and
        "extractor_backpressure_seconds" in summary else max(e.get("backpressure_s") or 0 for e in last.values()),
        "stall_s": max(e.get("stall_s") or 0 for e in last.values()),
    }


def _regeneration(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """engine openai: the servers' answers for every extractor's shard, from their latest `regenerate` events."""
    last = _latest(events, "regenerate")
    if not last:
        return None
    asked = sum(e["asked"] for e in last.values())
    answered = sum(e["answered"] for e in last.values())
    return {"ranks": len(last), "asked": asked, "answered": answered, "progress": answered / asked if asked else None,
            "tokens": sum(e["tokens"] for e in last.values()), "errors": sum(e["errors"] for e in last.values()),
            "tok_s": sum(e["tok_s"] for e in last.values())}


def _health(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The states' health per layer in the latest segment of each extractor (`health` events), and the worst
    figures over them: the lowest RMS, the highest share of zeros, the non-finite values in all."""
    last = _latest(events, "health")
    if not last:
        return None
    latest = list(last.values())
    layers = latest[0]["layers"]
    same = [e for e in latest if e["layers"] == layers]
    return {"engine": ", ".join(sorted({e.get("engine", "?") for e in latest})), "layers": layers,
            "rms": [min(e["rms"][k] for e in same) for k in range(len(layers))],
            "zero_share": [max(e["zero_share"][k] for e in same) for k in range(len(layers))],
            "non_finite": sum(sum(e["non_finite"]) for e in latest), "ranks": len(latest)}


def _live_store(out: Path) -> dict[str, Any] | None:
    """The store's own status when its folder is reachable from here (the run's config.yaml names it)."""
    from dflash_stream.store import Store, StoreError

    config = RunDir(out).config
    if not config.is_file():
        return None
    path = (yaml.safe_load(config.read_text()) or {}).get("store", {}).get("path")
    if not path or not (Path(path) / "store.json").is_file():
        return None
    try:
        return Store.attach(path).status()  # read-only inspection of an existing store
    except (StoreError, OSError):
        return None  # deleted or half-written while we looked: the metrics still tell the story


def _buffer(out: Path, events: list[dict[str, Any]], now: float) -> dict[str, Any] | None:
    stores = [e for e in events if e["event"] == "store"]
    last = stores[-1] if stores else {}
    live = _live_store(out)
    if live is None and not last:
        return None
    if live is not None:
        segs = live["segments"]
        b = {"used_bytes": live["used_bytes"], "reserved_bytes": live["reserved_bytes"],
             "budget_bytes": live["budget_bytes"], "ready": segs["ready"], "claimed": segs["claimed"],
             "segments_written": last.get("segments_written"), "segments_released": segs["released"],
             "writers_waiting": live["writers_waiting"], "source": f"live store status of {live['path']}"}
    else:
        b = {"used_bytes": last["used_bytes"], "reserved_bytes": last.get("reserved_bytes", 0),
             "budget_bytes": last["budget_bytes"], "ready": last.get("ready"), "claimed": last.get("claimed"),
             "segments_written": last.get("segments_written"), "segments_released": last.get("segments_released"),
             "writers_waiting": None, "source": f"last store metrics event, {fmt_duration(now - last['time'])} ago"}
    b["fill"] = (b["used_bytes"] + b["reserved_bytes"]) / b["budget_bytes"] if b["budget_bytes"] else None
    return b


def _step_rate(events: list[dict[str, Any]], key: tuple[str, int], since: float) -> float:
    """Steps/s of one trainer since its process started (a resumed rank starts above step 0)."""
    mine = [e for e in events if e["event"] == "train" and (e["role"], e["rank"]) == key and e["time"] >= since]
    if len(mine) < 2:
        return 0.0
    return (mine[-1]["step"] - mine[0]["step"]) / max(mine[-1]["time"] - mine[0]["time"], 1e-9)


def _training(events: list[dict[str, Any]], running: bool) -> dict[str, Any] | None:
    last = _latest(events, "train")
    if not last:
        return None
    key, lead = min(last.items(), key=lambda kv: kv[1]["rank"])  # reduced loss and accuracies: on every rank
    acc = lead.get("acc") or []
    done = _latest(events, "train_done").get(key)  # the trainer finished: its steps are the total
    total = done["total_steps"] if done else lead.get("total_steps")
    rate = _step_rate(events, key, _started(events)[key])
    left = total - lead["step"] if total else None
    return {
        "total_steps": total, "progress": min(1.0, lead["step"] / total) if total else None,
        "steps_per_s": rate, "eta_s": left / rate if running and left and rate > 0 else None,
        "ranks": len(last), "step": lead["step"], "epoch": lead.get("epoch"), "loss": lead.get("loss"),
        "tau": lead.get("tau"), "lr": lead.get("lr"), "acc_slot1": acc[0] if acc else None,
        "acc_mean": sum(acc) / len(acc) if acc else None,
        "tokens": sum(e.get("tokens") or 0 for e in last.values()),
        "tok_s": sum(e.get("tok_s") or 0 for e in last.values()),
        "data_wait_s": sum(e.get("data_wait_s") or 0 for e in last.values()),
    }


def _checkpoints(out: Path, events: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The complete checkpoints on disk, and what writing them cost: from the lead trainer's `checkpoint` events
    of every launch (all trainers stand still together, so one rank's figures are the run's)."""
    complete = RunDir(out).complete_checkpoints()
    latest = complete[-1] if complete else None
    written = [e for e in events if e["event"] == "checkpoint" and e["role"] in ("trainer", "single")]
    lead = min((e["rank"] for e in written), default=0)
    timed = [e for e in written if e["rank"] == lead and "stall_s" in e]
    return {"count": len(complete), "latest_step": checkpoint_step(latest) if latest else None,
            "latest": str(latest) if latest else None,
            "written": len(timed), "stall_s": sum(e["stall_s"] for e in timed),
            "write_s": sum(e.get("write_s") or 0.0 for e in timed),
            "last_bytes": timed[-1].get("bytes") if timed else None}


def collect_status(output_dir: str | Path, now: float | None = None) -> dict[str, Any]:
    """Everything `status` shows, as plain data."""
    out = Path(output_dir)
    run = RunDir(out)
    if not out.is_dir():
        raise FileNotFoundError(f"output folder not found: {out}")
    if not run.metrics.is_dir() and not run.summary.is_file():
        raise FileNotFoundError(f"{out} has no metrics/ folder: not a dflash-stream output folder (yet)")
    now = time.time() if now is None else now
    events = read_metrics(out)
    ranks = _ranks(events, now)
    state, reason = _run_state(out, ranks)
    summary = read_summary(run) if state == "finished" else None
    if summary and summary.get("missing_parts"):
        reason += f"; without the figures of {', '.join(summary['missing_parts'])} (no summary part from it)"
    return {
        "output": str(out), "state": state, "state_reason": reason, "time": now,
        "ranks": ranks,
        "regeneration": _regeneration(events),
        "extraction": _extraction(events, state == "running", summary),
        "health": _health(events),
        "buffer": _buffer(out, events, now),
        "training": _training(events, state == "running"),
        "checkpoints": _checkpoints(out, events),
        "summary": summary,
    }


def render_status(s: dict[str, Any]) -> str:
    """`collect_status` as a terminal page."""
    out = [f"{s['output']}: {s['state'].upper()} ({s['state_reason']})"]
    roles: dict[str, int] = {}
    for r in s["ranks"]:
        roles[r["role"]] = roles.get(r["role"], 0) + 1
    out.append("ranks: " + (", ".join(f"{n} {role}" for role, n in roles.items()) or "none"))
    g = s.get("regeneration")
    if g:
        pct = f" ({g['progress']:.1%})" if g["progress"] is not None else ""
        errors = f", {g['errors']} errors" if g["errors"] else ""
        out.append(f"regen     {fmt_count(g['answered'])} / {fmt_count(g['asked'])} answers{pct} from the servers, "
                   f"{g['tok_s']:,.0f} tok/s over {g['ranks']} extractor(s){errors}")
    x = s["extraction"]
    if x:
        pct = f" ({x['progress']:.1%})" if x["progress"] is not None else ""
        eta = f", ETA {fmt_duration(x['eta_s'])}" if x["eta_s"] and x["progress"] != 1 else ""
        out.append(f"extract   {fmt_count(x['samples'])} / {fmt_count(x['samples_total'])} samples{pct}{eta}")
        out.append(f"          {x['tok_s']:,.0f} tok/s over {x['ranks']} rank(s); blocked on a full buffer "
                   f"{_seconds(x['backpressure_s'])} (forward loop stalled {_seconds(x['stall_s'])})")
    h = s.get("health")
    if h:
        rms = " ".join(f"{v:.3g}" for v in h["rms"])
        zeros = " ".join(f"{v:.2%}" for v in h["zero_share"])
        out.append(f"health    layers {h['layers']} (engine {h['engine']}, latest segment of {h['ranks']} "
                   f"extractor(s)): RMS {rms}; zeros {zeros}; {h['non_finite']} non-finite")
    b = s["buffer"]
    if b:
        fill = f"{b['fill']:.0%}" if b["fill"] is not None else "?"
        out.append(f"buffer    {fmt_bytes(b['used_bytes'] + b['reserved_bytes'])} / {fmt_bytes(b['budget_bytes'])} "
                   f"({fill}; {fmt_bytes(b['reserved_bytes'])} reserved by writers)")
        waiting = f"; {b['writers_waiting']} writer(s) waiting for space" if b["writers_waiting"] else ""
        written = f"{b['segments_written']} written, " if b["segments_written"] is not None else ""
        out.append(f"          {b['ready']} ready, {b['claimed']} claimed; {written}{b['segments_released']} released"
                   f"{waiting}  [{b['source']}]")
    t = s["training"]
    if t:
        of = f" / {t['total_steps']:,} ({t['progress']:.1%})" if t["total_steps"] else ""
        eta = f", ETA {fmt_duration(t['eta_s'])}" if t["eta_s"] else ""
        out.append(f"train     step {t['step']:,}{of}{eta}, epoch {t['epoch']}: loss {_num(t['loss'], '.4f')}, "
                   f"tau (estimate) {_num(t['tau'], '.2f')}, acc slot 1 {_num(t['acc_slot1'], '.1%')}, lr {_num(t['lr'], '.2e')}")
        out.append(f"          {t['tok_s']:,.0f} tok/s over {t['ranks']} rank(s); "
                   f"waited for data {fmt_duration(t['data_wait_s'])}")
    c = s["checkpoints"]
    out.append(f"ckpt      {c['count']} complete" + (f", latest {c['latest']}" if c["latest"] else ""))
    if c["written"]:
        size = f" of {fmt_bytes(c['last_bytes'])}" if c["last_bytes"] is not None else ""
        out.append(f"          {c['written']} written{size}: training stood still {_seconds(c['stall_s'])} "
                   f"(mean {_seconds(c['stall_s'] / c['written'])} each; writing {_seconds(c['write_s'])})")
    if s["summary"] is not None:
        out += ["summary", *summary_table(s["summary"], indent="          ")]
    return "\n".join(out)


def _seconds(value: float) -> str:
    """Short waits in seconds with a decimal (two below a second: checkpoints of a small drafter take
    hundredths), long ones as a duration."""
    if value < 1:
        return f"{value:.2f}s"
    return f"{value:.1f}s" if value < 60 else fmt_duration(value)


def _num(value: float | None, spec: str) -> str:
    return "?" if value is None else format(value, spec)


def watch(output_dir: str | Path, interval: float) -> int:
    """Redraw the status page until the run is no longer running."""
    while True:
        status = collect_status(output_dir)
        print("\033[2J\033[H" + render_status(status), flush=True)
        if status["state"] not in ("running", "starting"):
            return 0
        time.sleep(interval)
