"""A full disk (ENOSPC, or a quota) is a wait, not a crash: writes of checkpoints, ledgers, summaries and store
records retry with a log line while another job frees space, then stop cleanly with one line.

Every write retried here is idempotent (it rewrites the same file, or a private temporary that is renamed into
place), and a stop leaves only what a resume already ignores: a staging folder, a temporary file.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from dflash_stream.errors import DFlashError
from dflash_stream.log import get_logger

log = get_logger("diskfull")
T = TypeVar("T")
FULL = (errno.ENOSPC, errno.EDQUOT)
WAIT_SECONDS = 600.0
"""How long a write waits, in total, for space before the process stops."""
MAX_DELAY = 30.0


class DiskFull(DFlashError):
    """The filesystem stayed full for WAIT_SECONDS."""


def is_full(err: BaseException) -> bool:
    """A full disk or quota, also as libraries report it without an errno (safetensors: "os error 28")."""
    if isinstance(err, OSError) and err.errno is not None:
        return err.errno in FULL
    return isinstance(err, Exception) and any(os.strerror(code) in str(err) for code in FULL)


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged process may still write on the filesystem holding `path` (or its first existing
    parent)."""
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    st = os.statvfs(existing)
    return st.f_bavail * st.f_frsize


def retry_when_full(what: str, where: str | os.PathLike, write: Callable[[], T]) -> T:
    """Run `write` (idempotent); while it fails with a full disk, log and retry with backoff for up to
    WAIT_SECONDS, then raise DiskFull. `what` names the file in messages, `where` the filesystem."""
    waited, delay = 0.0, 1.0
    while True:
        try:
            return write()
        except Exception as err:
            if not is_full(err):
                raise
            if waited >= WAIT_SECONDS:
                raise DiskFull(
                    f"disk full writing {what}: {free_bytes(where):,} bytes free under {where} after waiting "
                    f"{waited:.0f} s; free space there and run the same command again (it resumes)"
                ) from None
            log.warning("disk full writing %s (%s bytes free under %s): retrying in %.0f s; free space on that "
                        "filesystem", what, f"{free_bytes(where):,}", where, delay)
            time.sleep(delay)
            waited += delay
            delay = min(delay * 2, MAX_DELAY, max(WAIT_SECONDS - waited, 0.01))
