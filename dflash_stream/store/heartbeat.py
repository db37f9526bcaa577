"""Writer heartbeats: a waiting trainer can tell a live extractor (still loading its target, say) from none.

Each extractor rewrites `writers/<id>.alive` every HEARTBEAT_SECONDS from a daemon thread, from the moment it
starts (before it loads the target). The file holds the writer's own clock time, so readers on other nodes of a
shared filesystem judge it without trusting file modification times.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from dflash_stream.rundir import write_atomic

HEARTBEAT_SECONDS = 5.0
STALE_SECONDS = 30.0
"""A heartbeat older than this belongs to a writer that stopped (or lost the filesystem)."""
SUFFIX = ".alive"


class Heartbeat:
    """Keeps `writers/<writer_id>.alive` fresh until `stop()`, the end of its `with` block, or the process."""

    def __init__(self, writers_dir: Path, writer_id: str, every: float = HEARTBEAT_SECONDS) -> None:
        self.path = writers_dir / f"{writer_id}{SUFFIX}"
        self.every = every
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{writer_id}", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # a process that ends by an exception is not alive either

    def _beat(self) -> None:
        write_atomic(self.path, json.dumps({"time": time.time(), "pid": os.getpid(), "host": socket.gethostname()}))

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self._beat()
            except OSError:
                continue  # a filesystem hiccup; the next beat retries

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.path.unlink(missing_ok=True)



def read_heartbeats(writers_dir: Path, now: float | None = None) -> dict[str, dict[str, Any]]:
    """writer id -> {age_s, alive, finished, host, pid} for every writer that ever beat here."""
    now = time.time() if now is None else now
    out: dict[str, dict[str, Any]] = {}
    try:
        names = os.listdir(writers_dir)
    except FileNotFoundError:
        return out
    for name in names:
        if not name.endswith(SUFFIX) or name.startswith("."):
            continue
        writer = name.removesuffix(SUFFIX)
        try:
            beat = json.loads((writers_dir / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue  # replaced while we read it
        age = max(0.0, now - beat["time"])
        finished = (writers_dir / f"{writer}.finished").exists()
        # On this host a dead pid settles it at once (a kill -9 leaves a fresh-looking file behind).
        gone = beat.get("host") == socket.gethostname() and not (beat.get("pid") and psutil.pid_exists(beat["pid"]))
        out[writer] = {"age_s": age, "alive": age < STALE_SECONDS and not finished and not gone,
                       "finished": finished, "host": beat.get("host"), "pid": beat.get("pid")}
    return out


def describe_writers(beats: dict[str, dict[str, Any]]) -> str:
    """The extractors' state in one phrase, for a waiting trainer's log line."""
    if not beats:
        return ("no extractor has started on this store: start `dflash-stream extract --config FILE` "
                "with the same config")
    parts = []
    for writer, b in sorted(beats.items()):
        if b["finished"]:
            parts.append(f"{writer} finished")
        elif b["alive"]:
            parts.append(f"{writer} alive (heartbeat {b['age_s']:.0f} s ago)")
        else:
            parts.append(f"{writer} silent for {b['age_s']:.0f} s (stopped?)")
    return "extractors: " + ", ".join(parts)
