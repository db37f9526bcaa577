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
LOST_SHARE = 0.5
"""A shard or a source that loses more than this share of its rows to skips warns: a wrong data.format, a
layout the reader does not know, or a data.max_length too short for the data."""
TINY_SAMPLES = 8
"""A shard with fewer kept samples than this warns even when nothing was skipped: it can hardly train."""


@dataclass
class SourceReport:
    """One data source's share of a shard: its rows, what was kept, and what was skipped and why."""

    name: str
    rows: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    details: dict[str, list[str]] = field(default_factory=dict)
    """A few `source#row: what was wrong` lines per skip reason."""

    def skip(self, reason: str, line: str) -> None:
        self.skipped[reason] += 1
        seen = self.details.setdefault(reason, [])
        if len(seen) < EXAMPLES_PER_REASON:
            seen.append(line)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rows": self.rows, "kept": self.kept,
                "skipped": dict(self.skipped.most_common()), "examples": self.details}


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
    sources: list[SourceReport] = field(default_factory=list)
    """Per data source, in config order (empty for reports that were not made by the data stage)."""
    sample_sources: dict[int, int] = field(default_factory=dict)
    """Kept sample id -> its source's index."""
    special_text: int = 0
    """Kept rows whose text spells a special token (tokenized as text, not as the control token)."""

    @property
    def kept(self) -> int:
        return len(self.sample_ids)

    def _source_of(self, origin: str) -> SourceReport | None:
        name = origin.rsplit("#", 1)[0]
        return next((s for s in self.sources if s.name == name), None)

    def skip(self, reason: str, origin: str, detail: str = "", source: int | None = None) -> None:
        self.skipped[reason] += 1
        seen = self.examples.setdefault(reason, [])
        if len(seen) < EXAMPLES_PER_REASON:
            seen.append(origin)
        entry = self.sources[source] if source is not None else self._source_of(origin)
        if entry is not None:
            entry.skip(reason, f"{origin}: {detail}" if detail else origin)

    def source_kept(self) -> list[int]:
        """Kept samples per source, from the kept ids (which regeneration may still shrink)."""
        counts = [0] * len(self.sources)
        for sample_id in self.sample_ids:
            index = self.sample_sources.get(sample_id)
            if index is not None:
                counts[index] += 1
        return counts

    def count_kept(self) -> None:
        """Bring each source's `kept` up to date with the kept ids."""
        for entry, kept in zip(self.sources, self.source_kept(), strict=True):
            entry.kept = kept

    def source_dicts(self) -> list[dict[str, Any]]:
        self.count_kept()
        return [s.to_dict() for s in self.sources]

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard_index": self.shard_index, "shard_count": self.shard_count, "rows": self.rows,
            "kept": self.kept, "truncated": self.truncated, "special_token_text": self.special_text,
            "skipped": dict(sorted(self.skipped.items())), "examples": self.examples,
            "sources": self.source_dicts(),
            "sample_ids": self.sample_ids,
        }

    def write(self, output_dir: str | Path) -> Path:
        """OUTPUT/data/report-<shard>.json, replaced atomically (the audit reads it)."""
        path = RunDir(output_dir).data_report(self.shard_index)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_atomic(path, json.dumps(self.to_dict()))

    def warn_if_few(self) -> str | None:
        """Log (and return) a warning when this shard lost most of its rows to skips, or keeps a handful of
        samples; a shard that kept all of its few rows is not a data problem and says so only when tiny."""
        if not self.kept:
            return None
        lost = sum(self.skipped.values())
        if lost and self.kept < (1 - LOST_SHARE) * self.rows:
            top = ", ".join(f"{reason} {n}" for reason, n in self.skipped.most_common(3))
            message = (f"data shard {self.shard_index} keeps only {self.kept} of {self.rows} rows (skipped: {top}); "
                       "check data.format and data.max_length, and see "
                       f"data/report-{self.shard_index}.json for which rows were skipped and why")
        elif self.kept < TINY_SAMPLES:
            message = (f"data shard {self.shard_index} has only {self.kept} samples to train on "
                       f"({self.kept} of {self.rows} rows kept"
                       + (f", {lost} skipped" if lost else ", none skipped") + "): the data sources are that small")
        else:
            return None
        log.warning(message)
        return message

    def source_warnings(self, formats: list[str] | None = None) -> list[str]:
        """One warning per source that keeps under half its rows, naming it and its main reason with an
        example of what was wrong; logged here, at the start of the run. With one source the shard's own
        warning (`warn_if_few`) says the same."""
        messages: list[str] = []
        if len(self.sources) < 2:
            return messages
        for index, (entry, kept) in enumerate(zip(self.sources, self.source_kept(), strict=True)):
            if not entry.rows or kept >= (1 - LOST_SHARE) * entry.rows or not entry.skipped:
                continue
            reason, count = entry.skipped.most_common(1)[0]
            example = entry.details.get(reason, [""])[0]
            fmt = f" (format {formats[index]})" if formats else ""
            messages.append(
                f"data source {entry.name}{fmt} keeps {kept} of its {entry.rows} rows in shard {self.shard_index}: "
                f"mostly {reason} ({count}), e.g. {example}; check data.sources[{index}].format and "
                f"data/report-{self.shard_index}.json")
        for message in messages:
            log.warning(message)
        return messages

    def summary(self) -> str:
        skipped = ", ".join(f"{reason} {n} (e.g. {', '.join(self.examples[reason][:3])})"
                            for reason, n in sorted(self.skipped.items()))
        special = f", {self.special_text} with special-token text kept as text" if self.special_text else ""
        return (f"data shard {self.shard_index}/{self.shard_count}: {self.rows} rows, {self.kept} kept "
                f"({self.truncated} truncated{special}), {sum(self.skipped.values())} skipped"
                + (f": {skipped}" if skipped else ""))
