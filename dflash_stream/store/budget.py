"""Disk accounting as `du` sees it, and the lock that makes reserving space one step at a time.

Only writers take the lock, and only to reserve: everything else a process does to the store either frees
space or is covered by a reservation or by `SLACK`, so the sum below never undercounts what is on disk.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from pathlib import Path

import psutil

SLACK_BLOCKS = 32
"""Blocks kept free for metadata that appears between two measurements (marker files, directory growth)."""
STALE_LOCK_SECONDS = 60.0


def block_size(path: Path) -> int:
    return max(4096, os.statvfs(path).f_frsize)


def du(path: Path, skip_below: frozenset[str] = frozenset(), only_itself: frozenset[str] = frozenset()) -> int:
    """Allocated bytes of `path` and everything under it; for directories of `path` named in `skip_below`, only
    the directory itself and its direct subdirectories, for those named in `only_itself` only the directory
    (their contents are accounted elsewhere)."""
    total = 0
    stack = [(path, False)]
    while stack:
        current, shallow = stack.pop()
        try:
            with os.scandir(current) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False) and not shallow and not (
                            current == path and entry.name in only_itself):
                        stack.append((Path(entry.path), entry.name in skip_below and current == path))
        except FileNotFoundError:
            continue
    with contextlib.suppress(FileNotFoundError):
        total += os.stat(path).st_blocks * 512
    return total


class DirLock:
    """An mkdir lock that holds on NFS. The holder is named by an empty file inside it, so a lock left by a
    dead process on this host (or, from another host, older than `STALE_LOCK_SECONDS`) is broken."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._me = f"{socket.gethostname()}.{os.getpid()}"

    def __enter__(self) -> DirLock:
        delay = 0.001
        while True:
            try:
                os.mkdir(self.path)
                (self.path / self._me).touch()
                return self
            except FileExistsError:
                if self._is_stale():
                    self.break_stale()
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def _is_stale(self) -> bool:
        try:
            holders = os.listdir(self.path)
            age = time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return False
        for holder in holders:
            host, _, pid = holder.rpartition(".")
            if host == socket.gethostname() and pid.isdigit():
                # Judged by its pid alone, so that a jump of this host's clock cannot break a live lock.
                return not psutil.pid_exists(int(pid))
        if age > STALE_LOCK_SECONDS:
            return True
        # A holder that died between mkdir and naming itself leaves an empty lock.
        return not holders and age > 1.0

    def break_stale(self) -> None:
        # Rename first so two processes breaking the same stale lock cannot remove a fresh one.
        aside = self.path.with_name(f"{self.path.name}.stale.{self._me}")
        try:
            os.rename(self.path, aside)
        except OSError:
            return
        shutil.rmtree(aside, ignore_errors=True)

