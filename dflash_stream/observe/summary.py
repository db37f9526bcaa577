"""The run summary (OUTPUT/summary.json) as a two-column table, printed at the end of `run` and by `status`."""

from __future__ import annotations

from typing import Any

from dflash_stream.observe.units import fmt_bytes, fmt_duration


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, dict):
            rows += _flatten(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", value))
    return rows


def _value(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if key.endswith("_bytes"):
        return f"{value:,} ({fmt_bytes(value)})"
    if key.endswith("_seconds"):
        return f"{value:,.2f} ({fmt_duration(value)})" if value >= 60 else f"{value:,.2f}"
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


def summary_table(summary: dict[str, Any], indent: str = "  ") -> list[str]:
    """One line per figure; nested sections (eval) as dotted keys; bytes and seconds also in human units."""
    rows = _flatten(summary)
    width = max((len(key) for key, _ in rows), default=0)
    return [f"{indent}{key.ljust(width)}  {_value(key, value)}" for key, value in rows]
