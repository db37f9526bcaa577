"""What a writer says about backpressure: one line when the full buffer starts holding it back, a reminder
while that lasts, one line when writes go through without waiting again (not two lines per segment)."""

from __future__ import annotations

import logging
import time

REMIND_SECONDS = 300.0
"""How often a writer that stays held back says so again."""
QUIET_SECONDS = 60.0
"""A spell of backpressure ends at a write that needs no wait this long after the last wait ended: a buffer
that is full every other segment is still holding the writer back."""


class BackpressureLog:
    def __init__(self, log: logging.Logger, writer_id: str, remind_seconds: float = REMIND_SECONDS) -> None:
        self.log, self.id, self.remind_seconds = log, writer_id, remind_seconds
        self.since: float | None = None  # when the current spell of backpressure began
        self._said = 0.0
        self._waited = 0.0
        self._writes = 0
        self._last_wait = 0.0

    def blocked(self, detail: str) -> None:
        """A write found the buffer full and waits."""
        now = time.monotonic()
        if self.since is None:
            self.since, self._said, self._waited, self._writes = now, now, 0.0, 0
            self.log.info("writer %s is held back by the full buffer (%s); it waits for the trainer to free "
                          "space and says so again every %.0f s while this lasts", self.id, detail,
                          self.remind_seconds)
        else:
            self.remind()

    def remind(self) -> None:
        """Called while waiting: a reminder line every `remind_seconds`."""
        now = time.monotonic()
        if self.since is not None and now - self._said >= self.remind_seconds:
            self._said = now
            self.log.info("writer %s still held back by the full buffer: waited %.0f s over %d write(s) in the "
                          "last %.0f s", self.id, self._waited, self._writes, now - self.since)

    def resumed(self, waited: float) -> None:
        """The waiting write got its space (the spell goes on until a write needs no wait)."""
        self._waited += waited
        self._writes += 1
        self._last_wait = time.monotonic()
        self.remind()

    def flowing(self, final: bool = False) -> None:
        """A write found room at once (or the writer is done, `final`): the spell may be over."""
        if self.since is None or (not final and time.monotonic() - self._last_wait < QUIET_SECONDS):
            return
        self.log.info("writer %s no longer held back: it waited %.1f s over %d write(s) in %.0f s",
                      self.id, self._waited, self._writes, time.monotonic() - self.since)
        self.since = None
