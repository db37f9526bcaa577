"""One launch per output directory, and no orphans.

`hold_output` takes the output directory's lease for the sides a launch runs (`run` takes both, `extract` and
`train` one each, so the two separate launches of a shared store may run side by side): a second launch on a
live output_dir refuses with one line naming the holder. The store's writer and consumer ids carry leases of
their own (store/lease.py), so every rank of a launch is covered, not only the one holding the directory.

`stop_with_launcher`: torch's launcher starts its workers in sessions of their own, so a `kill -9` of the
`accelerate launch` process alone would leave them running beside the next launch. Each worker asks the kernel
for SIGTERM when its parent dies (Linux `PR_SET_PDEATHSIG`; elsewhere a thread watches the parent pid), and
SIGTERM makes a trainer finish its step, write a durable checkpoint and exit; an extractor just stops (its
partial segment is removed by the next run's recovery).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

from dflash_stream.config import Config
from dflash_stream.log import get_logger
from dflash_stream.store import lease

log = get_logger("guard")
PR_SET_PDEATHSIG = 1


def lock_path(output_dir: str | Path, side: str) -> Path:
    return Path(output_dir) / "locks" / side


def hold_output(cfg: Config, sides: tuple[str, ...]) -> None:
    """Hold OUTPUT/locks/<side> for each side ("extract", "train") until this process ends."""
    for side in sides:
        path = lock_path(cfg.output_dir, side)
        path.parent.mkdir(parents=True, exist_ok=True)
        lease.acquire(path, f"output_dir {cfg.output_dir} ({side})")


def stop_with_launcher() -> None:
    """Get SIGTERM when the launcher that started this worker dies (only under a launcher: a plain process
    would otherwise die with its shell)."""
    if "LOCAL_RANK" not in os.environ:
        return
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0:
            if os.getppid() != parent:  # it died before the request took effect
                os.kill(os.getpid(), signal.SIGTERM)
            return
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    log.warning("the launcher (pid %d) is gone: stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)
