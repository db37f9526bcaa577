"""The exactly-once audit: the data's sample ids against the ids each epoch trained on.

Expected ids come from the extractors' data reports (the ids that survived filtering). Trained ids come from
the trainers' ledgers, counted only up to the latest complete checkpoint: a ledger file past it belongs to a
checkpoint that never finished, whose training a resume rolled back. Samples trained from a replacement segment
(extracted again: a damaged segment's, or uses released after a checkpoint and rolled back by a crash, with
train.release on_use) are marked in the ledger with the redo tag they answer and counted as `redone`; the store's
records of both are listed. Every path is read through `RunDir`.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from dflash_stream.errors import DFlashError
from dflash_stream.rundir import RunDir, checkpoint_step


def _expected_ids(run: RunDir) -> set[int]:
    ids: set[int] = set()
    for report in run.data_reports():
        ids.update(json.loads(report.read_text())["sample_ids"])
    return ids


def _trained_per_epoch(run: RunDir, upto_step: int) -> tuple[dict[int, Counter[int]], Counter[int]]:
    """(epoch -> trained ids counted, epoch -> sample uses of them trained from replacement segments)."""
    per_epoch: dict[int, Counter[int]] = {}
    redone: Counter[int] = Counter()
    for step, part in run.ledger_files():
        if step > upto_step:
            continue
        for line in part.read_text().splitlines():
            entry = json.loads(line)
            per_epoch.setdefault(entry["epoch"], Counter()).update(entry["sample_ids"])
            if "redo" in entry:
                redone[entry["epoch"]] += len(entry["sample_ids"])
    return per_epoch, redone


def audit_run(output_dir: str | Path) -> dict[str, Any]:
    """Counts per epoch; `ok` means every epoch trained every expected id exactly once."""
    run = RunDir(output_dir)
    if not run.root.is_dir():
        raise DFlashError(f"no run output at {run.root}")
    train = yaml.safe_load(run.config.read_text())["train"] if run.config.exists() else {}
    epochs, max_steps = train.get("epochs", 1), train.get("max_steps")
    expected = _expected_ids(run)
    step = checkpoint_step(run.latest_checkpoint())
    per_epoch, redone = _trained_per_epoch(run, step)
    passes = []
    for epoch in range(max(epochs, max(per_epoch, default=-1) + 1)):
        counts = per_epoch.get(epoch, Counter())
        passes.append(
            {
                "epoch": epoch,
                "expected": len(expected),
                "trained": len(counts),
                "missing": len(expected - counts.keys()),
                "duplicated": sum(1 for n in counts.values() if n > 1),
                "unexpected": len(counts.keys() - expected),
                "redone": redone[epoch],
            }
        )
    finished = run.summary.exists()
    # A run stopped by train.max_steps trained only part of the data on purpose: it must still train nothing
    # twice and nothing unexpected, but samples it never reached are not missing.
    stopped = max_steps is not None and step >= max_steps
    ok = bool(expected) and all(p["duplicated"] == p["unexpected"] == 0 and (stopped or p["missing"] == 0)
                                for p in passes)
    config = yaml.safe_load(run.config.read_text()) if run.config.exists() else {}
    store = config.get("store", {}).get("path")
    return {"output": str(run.root), "finished": finished, "passes": passes, "ok": ok,
            "stopped_by": f"train.max_steps={max_steps}" if stopped else None, "step": step,
            "quarantined": _quarantined(Path(store)) if store else [],
            "rolled_back": _rolled_back(Path(store)) if store else []}


def _quarantined(store: Path) -> list[dict[str, Any]]:
    """Damaged segments the trainers set aside (their samples were extracted and trained again)."""
    found = []
    for path in sorted((store / "quarantine").glob("*.json")):
        record = json.loads(path.read_text())
        found.append({"segment_id": record["segment_id"], "sample_ids": record["sample_ids"]})
    return found


def _rolled_back(store: Path) -> list[dict[str, Any]]:
    """Segment uses released after a checkpoint and undone by a crash (train.release on_use): what was asked
    to be extracted again, and whether its replacement came."""
    from dflash_stream.store import Store

    if not (store / "store.json").is_file():
        return []
    return [{"tag": r["tag"], "uses": r["last_use"] - r["first_use"] + 1, "samples": len(r["sample_ids"]),
             "redone": r["redone"], "reason": r["reason"]} for r in Store.attach(store).rollbacks()]


def format_audit(report: dict[str, Any]) -> str:
    head = f"audit of {report['output']} ({'finished' if report['finished'] else 'not finished'})"
    rows = [f"  epoch {p['epoch']}: expected {p['expected']}, trained {p['trained']}, missing {p['missing']}, "
            f"duplicated {p['duplicated']}, unexpected {p['unexpected']}"
            + (f" ({p['redone']} of them from samples extracted again)" if p.get("redone") else "")
            for p in report["passes"]]
    rows += [f"  quarantined segment {q['segment_id']}: {len(q['sample_ids'])} sample(s), extracted and trained again"
             for q in report.get("quarantined", [])]
    rolled = report.get("rolled_back", [])
    if rolled:
        uses = sum(r["uses"] * r["samples"] for r in rolled)
        waiting = sum(not r["redone"] for r in rolled)
        rows.append(f"  rolled back by crashes: {uses} sample use(s) of {len(rolled)} segment part(s) released after "
                    "the checkpoint resumed from, extracted and trained again"
                    + (f"; {waiting} part(s) not extracted again yet" if waiting else ""))
    if report.get("stopped_by"):
        reached = sum(p["trained"] for p in report["passes"])
        expected = sum(p["expected"] for p in report["passes"])
        verdict = (f"{'OK' if report['ok'] else 'FAILED'}: stopped by {report['stopped_by']} at step "
                   f"{report['step']}, before the end of the data ({reached:,} of {expected:,} sample uses trained); "
                   + ("none trained twice, none unexpected" if report["ok"] else "some trained twice or unexpected"))
    else:
        verdict = "OK: every sample trained exactly once per epoch" if report["ok"] else "FAILED"
    return "\n".join([head, *rows, verdict])


def register(sub: argparse._SubParsersAction) -> None:
    audit = sub.add_parser("audit", help="prove every sample was trained exactly once per epoch")
    audit.add_argument("output", help="the run's output_dir")
    audit.add_argument("--json", action="store_true")
    audit.set_defaults(func=audit_command)


def audit_command(args: argparse.Namespace) -> int:
    report = audit_run(args.output)
    print(json.dumps(report, indent=2) if args.json else format_audit(report))
    return 0 if report["ok"] else 1
