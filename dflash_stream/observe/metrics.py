"""Per-rank JSONL metrics in OUTPUT/metrics/<role>-<rank>.jsonl, read back by `status` and `report`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends one JSON object per line and flushes, so a crashed run keeps everything up to its last event."""

    def __init__(self, output_dir: str | Path, role: str, rank: int) -> None:
        self.path = Path(output_dir) / "metrics" / f"{role}-{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.role, self.rank = role, rank
        self._file = self.path.open("a", buffering=1)

    def log(self, event: str, **fields: Any) -> None:
        record = {"time": time.time(), "role": self.role, "rank": self.rank, "event": event, **fields}
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    """All ranks' events in time order; a torn last line (crash mid-write) is skipped."""
    events = []
    for path in sorted((Path(output_dir) / "metrics").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    events.sort(key=lambda e: e.get("time", 0))
    return events
