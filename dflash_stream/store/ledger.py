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


def _cut_torn_tail(path: Path) -> int:
    """Cut what follows the last newline (an append a crash interrupted); the file's size afterwards. Opened
    for writing only to cut, so that a consumer of a read-only store still starts (and fails on what it writes)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        size = os.fstat(fd).st_size
        end, step = size, 1 << 16
        while end > 0:  # backwards, a block at a time: the tail is short, the file may not be
            start = max(0, end - step)
            at = os.pread(fd, end - start, start).rfind(b"\n")
            if at >= 0:
                end = start + at + 1
                break
            end = start
    finally:
        os.close(fd)
    if end != size:
        log.warning("ledger %s: cut a torn last line of %d bytes (a crash interrupted its append)", path, size - end)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, end)
            os.fsync(fd)
        finally:
            os.close(fd)
    return end


class LedgerAppender:
    """Appends records to one ledger file; only its one writer may hold one (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._size = _cut_torn_tail(path)
        """Bytes of complete lines: a failed append past them is cut before the next one."""

    def append(self, records: list[dict[str, Any]]) -> None:
        """Append and fsync; durable when this returns. On an error (a full disk) the file may hold a partial
        line, which readers skip and the next append cuts."""
        data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
        created = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != self._size:
                os.ftruncate(fd, self._size)
            view, at = memoryview(data), self._size
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            fsync(self.path.parent)  # the new file's name, too, must survive a machine crash
        self._size += len(data)


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
