"""The run summary (OUTPUT/summary.json): the roles' figures merged from their parts, and the summary as a
two-column table, printed at the end of `run` and by `status`.

Every rank of a `run` writes its own part (summary-parts/<role>-<index>.json) when it finishes; trainer 0 merges
them. The roles do not finish together: an extractor lingers to re-extract damaged segments until trainer 0 says
training is over (OUTPUT/training-over.json, naming its launch), so it finishes after the trainer. The merge therefore waits for every expected part, and a part that never
came is named in `missing_parts`, never silently counted as zero.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_stream.rundir import RunDir
from dflash_stream.units import fmt_bytes, fmt_duration

EXTRACTING = ("extractor", "single")
TRAINING = ("trainer", "single")


def part_name(role: str, index: int) -> str:
    """A part's name, as in summary-parts/<name>.json and in `missing_parts`."""
    return f"{role}-{index}"


def read_parts(files: list[Path], since: float | None = None) -> list[dict[str, Any]]:
    """The parts in `files`; with `since`, only those written at or after it (a part left by an earlier launch of
    the same output folder is not this launch's figures)."""
    parts = []
    for path in files:
        try:
            part = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # removed or replaced while we looked: treated as not there yet
        if since is None or part.get("written", since) >= since:
            parts.append(part)
    return parts


def missing_parts(parts: list[dict[str, Any]], expected: list[str]) -> list[str]:
    have = {part_name(p["role"], p["index"]) for p in parts}
    return [name for name in expected if name not in have]


def _longest(parts: list[dict[str, Any]], key: str) -> float:
    """The role's figure of its slowest rank: the ranks run side by side, so the run took the longest of them."""
    return round(max((p.get(key) or 0.0 for p in parts), default=0.0), 2)


def role_figures(parts: list[dict[str, Any]], expected: list[str]) -> dict[str, Any]:
    """The summary's figures that come from the roles' parts, and the names of the expected parts not among them."""
    extractors = [p for p in parts if p["role"] in EXTRACTING]
    trainers = [p for p in parts if p["role"] in TRAINING]
    lead = next((p for p in trainers if p["index"] == 0), {})
    regenerated = regeneration_figures(extractors)
    return {
        "samples_trained": sum(p.get("samples_trained", 0) for p in trainers),
        "steps": lead.get("steps", 0),
        "extract_seconds": _longest(extractors, "extract_seconds"),
        "train_seconds": _longest(trainers, "train_seconds"),
        "trainer_data_wait_seconds": _longest(trainers, "data_wait_seconds"),
        # Every checkpoint stops all trainers together (a collective), so the slowest rank's stall is the run's.
        "checkpoints": lead.get("checkpoints", 0),
        "checkpoint_stall_seconds": _longest(trainers, "checkpoint_stall_seconds"),
        "checkpoint_write_seconds": _longest(trainers, "checkpoint_write_seconds"),
        # Writes held back by the full buffer, and how much of that reached the target's forward loop.
        "extractor_backpressure_seconds": _longest(extractors, "backpressure_seconds"),
        "extractor_forward_stall_seconds": _longest(extractors, "stall_seconds"),
        # In-process regeneration, and the part of it done while the full buffer held the forward loop back.
        "extractor_generate_seconds": _longest(extractors, "generate_seconds"),
        "extractor_generate_ahead_seconds": _longest(extractors, "generate_ahead_seconds"),
        "final_loss": lead.get("final_loss"),
        "checkpoint": lead.get("export"),
        "eval": lead.get("eval"),
        **({"regenerate": regenerated} if regenerated else {}),
        # Each rank's CPU time, threads included: on a CPU-only host, which role the shared cores went to.
        "process_cpu_seconds": {part_name(p["role"], p["index"]): p["cpu_seconds"] for p in parts
                                if "cpu_seconds" in p},
        "missing_parts": missing_parts(parts, expected),
    }


def regeneration_figures(extractors: list[dict[str, Any]]) -> dict[str, Any] | None:
    """engine openai: the servers' answers over every extractor's shard (None with in-process generation)."""
    parts = [p["regenerate"] for p in extractors if p.get("regenerate")]
    if not parts:
        return None
    total = {key: sum(p.get(key, 0) for p in parts)
             for key in ("asked", "answers", "tokens", "truncated", "errors", "from_text", "retokenize_differs")}
    total["seconds"] = round(max(p.get("seconds", 0.0) for p in parts), 2)
    total["tokens_per_s"] = round(total["tokens"] / max(total["seconds"], 1e-9), 1)
    return total


def complete_from_parts(summary: dict[str, Any], files: list[Path], since: float | None) -> dict[str, Any]:
    """`summary` with the figures of the parts it lists as missing that have been written since the merge (a rank
    that finished after the merge gave up waiting for it); the summary itself when none has come. `since`: when
    the merged launch started (older parts are an earlier launch's)."""
    missing = summary.get("missing_parts") or []
    parts = read_parts(files, since)
    if not missing or missing_parts(parts, missing) == missing:
        return summary
    # Only the missing ones are still expected: the others were present at the merge, so they are among `parts`.
    return {**summary, **role_figures(parts, missing)}


def read_summary(run: RunDir) -> dict[str, Any] | None:
    """summary.json (None before it exists), with the figures of any rank whose part came after the merge."""
    try:
        summary = json.loads(run.summary.read_text())
        # When the merged launch began; a second of slack for the rounding of wall_seconds and of file times.
        since = run.summary.stat().st_mtime - (summary.get("wall_seconds") or 0.0) - 1.0
    except FileNotFoundError:
        return None
    return complete_from_parts(summary, run.summary_part_files(), since)


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, dict):
            rows += _flatten(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", value))
    return rows


def _value(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if key.endswith("_bytes"):
        return f"{value:,} ({fmt_bytes(value)})"
    if key.endswith("_seconds"):
        return f"{value:,.2f} ({fmt_duration(value)})" if value >= 60 else f"{value:,.2f}"
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


def summary_table(summary: dict[str, Any], indent: str = "  ") -> list[str]:
    """One line per figure; nested sections (eval) as dotted keys; bytes and seconds also in human units."""
    rows = _flatten(summary)
    width = max((len(key) for key, _ in rows), default=0)
    return [f"{indent}{key.ljust(width)}  {_value(key, value)}" for key, value in rows]
