"""The exactly-once audit: the data's sample ids against the ids each epoch trained on.

Expected ids come from the extractors' data reports (`OUTPUT/data/report-*.json`, the ids that survived
filtering). Trained ids come from the trainers' ledgers (`OUTPUT/ledger/trainer-R/<step>.jsonl`), counted only up
to each trainer's latest complete checkpoint: a ledger file past it belongs to a checkpoint that never finished.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from dflash_stream.errors import DFlashError


def _expected_ids(output: Path) -> set[int]:
    ids: set[int] = set()
    for report in sorted((output / "data").glob("report-*.json")):
        ids.update(json.loads(report.read_text())["sample_ids"])
    return ids


def latest_complete_step(output: Path) -> int:
    """The step of the newest checkpoint whose COMPLETE marker exists (-1 when none)."""
    steps = [
        int(d.name.removeprefix("step-"))
        for d in (output / "checkpoints").glob("step-*")
        if (d / "COMPLETE").exists()
    ]
    return max(steps, default=-1)


def _trained_per_epoch(output: Path, upto_step: int) -> dict[int, Counter[int]]:
    per_epoch: dict[int, Counter[int]] = {}
    for part in sorted((output / "ledger").glob("trainer-*/*.jsonl")):
        if int(part.stem) > upto_step:
            continue
        for line in part.read_text().splitlines():
            entry = json.loads(line)
            per_epoch.setdefault(entry["epoch"], Counter()).update(entry["sample_ids"])
    return per_epoch


def audit_run(output_dir: str | Path) -> dict[str, Any]:
    """Counts per epoch; `ok` means every epoch trained every expected id exactly once."""
    output = Path(output_dir)
    if not output.is_dir():
        raise DFlashError(f"no run output at {output}")
    config_path = output / "config.yaml"
    epochs = yaml.safe_load(config_path.read_text())["train"]["epochs"] if config_path.exists() else 1
    expected = _expected_ids(output)
    per_epoch = _trained_per_epoch(output, latest_complete_step(output))
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
            }
        )
    finished = (output / "summary.json").exists()
    ok = bool(expected) and all(p["missing"] == p["duplicated"] == p["unexpected"] == 0 for p in passes)
    return {"output": str(output), "finished": finished, "passes": passes, "ok": ok}


def format_audit(report: dict[str, Any]) -> str:
    head = f"audit of {report['output']} ({'finished' if report['finished'] else 'not finished'})"
    rows = [f"  epoch {p['epoch']}: expected {p['expected']}, trained {p['trained']}, missing {p['missing']}, "
            f"duplicated {p['duplicated']}, unexpected {p['unexpected']}" for p in report["passes"]]
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
