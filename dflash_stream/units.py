"""Human-readable figures for terminal pages; None (not known) prints as '?'."""

from __future__ import annotations

from pydantic import ByteSize


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    sign = "-" if n < 0 else ""
    return sign + ByteSize(int(abs(n))).human_readable(separator=" ")


def fmt_count(n: float | None) -> str:
    return "?" if n is None else f"{n:,.0f}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"
