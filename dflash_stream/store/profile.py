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
_OPEN = threading.local()
"""Per thread: the innermost open stage's name, and the thread time since it was last charged."""


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Charge this thread's CPU time to `name`; a stage opened inside another (a codec's step that may run on
    the caller's thread or on a pool's) takes its time from the outer one, so no time is counted twice."""
    profile = ACTIVE
    if profile is None:
        yield
        return
    outer = getattr(_OPEN, "stage", None)
    start = time.thread_time()
    if outer is not None:
        profile.add(outer[0], start - outer[1])
    _OPEN.stage = (name, start)
    try:
        yield
    finally:
        now = time.thread_time()
        profile.add(name, now - _OPEN.stage[1])
        _OPEN.stage = None if outer is None else (outer[0], now)
