"""SIGTERM/SIGINT as a request to stop: the trainer finishes its step, checkpoints and returns."""

from __future__ import annotations

import signal
import threading
from types import TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """`with stop:` catches STOP_SIGNALS for its duration and restores the previous handlers after; the
    signal that came is remembered across uses. Outside the main thread Python cannot install handlers, so
    there it catches nothing."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        """SIGTERM, SIGINT, or None while no signal came."""
        return None if self.signum is None else signal.Signals(self.signum).name

    def _catch(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._catch) for s in STOP_SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
