"""What the data stage kept and skipped, by reason, so that no row disappears silently."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_stream.log import get_logger
from dflash_stream.rundir import RunDir, write_atomic

log = get_logger(__name__)

EXAMPLES_PER_REASON = 5
FEW_SAMPLES = 100
"""Fewer kept samples than this train little: the run warns."""
FEW_KEPT_SHARE = 0.1
"""Keeping under this share of the rows hints at a wrong data.format or data.max_length: the run warns."""


@dataclass
class DataReport:
    shard_index: int
    shard_count: int
    rows: int = 0
    """Row copies this shard considered."""
    truncated: int = 0
    """Kept samples cut to data.max_length."""
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    """A few `source#row` labels per skip reason, to find the offending rows."""
    sample_ids: list[int] = field(default_factory=list)
    """Kept sample ids in extraction order."""

    @property
    def kept(self) -> int:
        return len(self.sample_ids)

    def skip(self, reason: str, origin: str) -> None:
        self.skipped[reason] += 1
        seen = self.examples.setdefault(reason, [])
        if len(seen) < EXAMPLES_PER_REASON:
            seen.append(origin)

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard_index": self.shard_index, "shard_count": self.shard_count, "rows": self.rows,
            "kept": self.kept, "truncated": self.truncated,
            "skipped": dict(sorted(self.skipped.items())), "examples": self.examples,
            "sample_ids": self.sample_ids,
        }

    def write(self, output_dir: str | Path) -> Path:
        """OUTPUT/data/report-<shard>.json, replaced atomically (the audit reads it)."""
        path = RunDir(output_dir).data_report(self.shard_index)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_atomic(path, json.dumps(self.to_dict()))

    def warn_if_few(self) -> str | None:
        """Log (and return) a warning when this shard keeps very few samples, absolutely or of its rows."""
        if not self.kept or (self.kept >= FEW_SAMPLES and self.kept >= FEW_KEPT_SHARE * self.rows):
            return None
        top = ", ".join(f"{reason} {n}" for reason, n in self.skipped.most_common(3))
        message = (f"data shard {self.shard_index} keeps only {self.kept} of {self.rows} rows"
                   + (f" (skipped: {top})" if top else "") + "; check data.format and data.max_length, and "
                   f"see data/report-{self.shard_index}.json for which rows were skipped and why")
        log.warning(message)
        return message

    def summary(self) -> str:
        skipped = ", ".join(f"{reason} {n} (e.g. {', '.join(self.examples[reason][:3])})"
                            for reason, n in sorted(self.skipped.items()))
        return (f"data shard {self.shard_index}/{self.shard_count}: {self.rows} rows, {self.kept} kept "
                f"({self.truncated} truncated), {sum(self.skipped.values())} skipped"
                + (f": {skipped}" if skipped else ""))
