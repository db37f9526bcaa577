"""Per-rank JSONL metrics in OUTPUT/metrics/<role>-<rank>.jsonl, read back by `status` and `report`."""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from dflash_stream.config import ConfigError
from dflash_stream.log import get_logger
from dflash_stream.rundir import RunDir


class MetricsWriter:
    """Appends one JSON object per line and flushes, so a crashed run keeps everything up to its last event."""

    def __init__(self, output_dir: str | Path, role: str, rank: int) -> None:
        self.path = RunDir(output_dir).metrics_file(role, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.role, self.rank = role, rank
        self._file = self.path.open("a", buffering=1)
        self._dropped = 0
        self._lock = threading.Lock()  # the extractor's sink and regeneration threads log beside its main thread

    def log(self, event: str, **fields: Any) -> None:
        if event == "start":
            # `status` tells a crashed rank from a live one by this pid on this host.
            fields = {"pid": os.getpid(), "host": socket.gethostname(), **fields}
        record = {"time": time.time(), "role": self.role, "rank": self.rank, "event": event, **fields}
        try:
            with self._lock:
                self._file.write(json.dumps(record) + "\n")
        except OSError as err:  # a full disk costs metrics lines, never the run
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            if not self._dropped:
                get_logger("metrics").warning("disk full: metrics lines to %s are dropped until there is room",
                                              self.path)
            self._dropped += 1

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    """All ranks' events in time order; a torn last line (crash mid-write) is skipped."""
    events = []
    for path in RunDir(output_dir).metrics_files():
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    events.sort(key=lambda e: e.get("time", 0))
    return events


class TrainingTracker(MetricsWriter):
    """The trainer's metrics writer: every event to JSONL like MetricsWriter, and `train` events also as
    TensorBoard scalars in OUTPUT/tensorboard/<role>-<rank> when `metrics.tensorboard` is on.

    Only rank 0 writes TensorBoard: the loss and accuracies it logs are already reduced over the data-parallel
    group, so other ranks would only duplicate the curves.
    """

    def __init__(self, output_dir: str | Path, role: str, rank: int, tensorboard: bool = False) -> None:
        super().__init__(output_dir, role, rank)
        self._tb = None
        if tensorboard and rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("metrics.tensorboard needs the tensorboard package: pip install tensorboard") from None
            self._tb = SummaryWriter(str(RunDir(output_dir).tensorboard(role, rank)))

    def log(self, event: str, **fields: Any) -> None:
        super().log(event, **fields)
        if self._tb is not None and event == "train":
            self._train_scalars(fields)

    def _train_scalars(self, fields: dict[str, Any]) -> None:
        step = fields["step"]
        for key in ("loss", "tau", "lr", "tok_s", "data_wait_s", "epoch"):
            if fields.get(key) is not None:
                self._tb.add_scalar(f"train/{key}", fields[key], step)
        # Slot k predicts the token k positions after the anchor; slot 0 is not trained, so slots start at 1.
        for slot, value in enumerate(fields.get("acc") or [], start=1):
            self._tb.add_scalar(f"acc/slot_{slot:02d}", value, step)
        self._tb.flush()

    def close(self) -> None:
        super().close()
        if self._tb is not None:
            self._tb.close()


def peak_store_bytes(output_dir: str | Path) -> int:
    """The most the store held (published + reserved) at any `store` event of the run."""
    return max(
        (e["used_bytes"] + e.get("reserved_bytes", 0) for e in read_metrics(output_dir) if e["event"] == "store"),
        default=0,
    )
