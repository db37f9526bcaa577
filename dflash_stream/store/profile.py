"""Where the store's CPU time goes, stage by stage: `bench store` turns this on and reports it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Profile:
    """CPU seconds per stage, summed over every thread that ran it (so: core-seconds)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds


ACTIVE: Profile | None = None
"""The profile stages are added to; None (the default) costs one check per stage."""


@contextmanager
def stage(name: str) -> Iterator[None]:
    profile = ACTIVE
    if profile is None:
        yield
        return
    start = time.thread_time()
    try:
        yield
    finally:
        profile.add(name, time.thread_time() - start)
