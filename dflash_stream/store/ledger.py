"""The ledgers of released segments: append-only JSON-lines files that keep the records of fully released
segments, so that info/ and done/ hold only the segments still alive.

One file per consumer (`released/consumer-<id>.jsonl`, appended only by the process holding that consumer id)
and one for recovery (`released/recovery.jsonl`, appended only while no process uses the store): one writer
per file, so plain appends hold on NFS. Each line is one segment's record, written and fsynced before the
record file and the release marker are unlinked; a crash mid-append leaves a torn last line, which readers
skip (they read up to the last newline) and the file's next writer cuts off before appending.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dflash_stream.log import get_logger
from dflash_stream.rundir import fsync

log = get_logger("store")
FOLDER = "released"
RECOVERY = "recovery.jsonl"


def consumer_ledger(consumer_id: str) -> str:
    return f"consumer-{consumer_id}.jsonl"


def _complete_end(fd: int, size: int) -> int:
    """Where the complete lines of an open ledger end: past its last newline."""
    end, step = size, 1 << 16
    while end > 0:  # backwards, a block at a time: a torn tail is short, the file may not be
        start = max(0, end - step)
        at = os.pread(fd, end - start, start).rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


def _cut_torn_tail(fd: int, path: Path) -> int:
    """Cut what follows the last newline (an append a crash or a full disk interrupted); the size after.
    Complete lines are never cut, whoever appended them."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    end = _complete_end(fd, size)
    log.warning("ledger %s: cut a torn last line of %d bytes (an append was interrupted)", path, size - end)
    os.ftruncate(fd, end)
    return end


def repair(path: Path) -> None:
    """Cut a torn last line; only while no process appends to `path` (recovery)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        size = os.fstat(fd).st_size
        if _cut_torn_tail(fd, path) != size:
            os.fsync(fd)
    finally:
        os.close(fd)


def append(path: Path, records: list[dict[str, Any]]) -> None:
    """Append records to the ledger at `path` and fsync: durable when this returns. Only the file's one writer
    calls this (see the module docstring). An append a full disk interrupted may leave a partial line, which
    readers skip and the next append cuts first (one read of the file's last byte tells)."""
    data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        view, at = memoryview(data), _cut_torn_tail(fd, path)
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        fsync(path.parent)  # the new file's name, too, must survive a machine crash


class LedgerReader:
    """Reads every ledger of a store incrementally: each call returns only the records appended since the
    previous one, so a store polled for its status reads each line once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._offsets: dict[str, int] = {}

    def read_new(self) -> list[dict[str, Any]]:
        try:
            names = sorted(n for n in os.listdir(self.folder) if n.endswith(".jsonl"))
        except FileNotFoundError:
            return []
        out: list[dict[str, Any]] = []
        for name in names:
            offset = self._offsets.get(name, 0)
            try:
                if os.stat(self.folder / name).st_size <= offset:  # nothing new: a status poll stays cheap
                    continue
                with open(self.folder / name, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1  # a line still being appended, or torn, is read once it is complete
            for line in data[:end].splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:  # no append here writes one; skipped rather than stopping an inspection
                    log.warning("ledger %s: skipped an unreadable line %r", self.folder / name, line[:80])
            self._offsets[name] = offset + end
        return out
