"""Logging and progress bars that know which role and rank they run in."""

from __future__ import annotations

import logging
import os
import sys

from tqdm.auto import tqdm

_ROLE = {"role": "main", "rank": 0, "bar": True}


def setup_logging(role: str = "main", rank: int = 0, show_bar: bool = True) -> None:
    """Prefix log lines with the role and rank; `show_bar` is true on the one process per role that draws bars."""
    _ROLE.update(role=role, rank=rank, bar=show_bar)
    level = os.environ.get("DFLASH_LOG_LEVEL", "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [{role} {rank}] %(message)s", "%H:%M:%S"))
    root = logging.getLogger("dflash_stream")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name if name.startswith("dflash_stream") else f"dflash_stream.{name}")


def progress(**kwargs) -> tqdm:
    """A tqdm bar drawn only on the process that speaks for its role; elsewhere a silent counter."""
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("desc", _ROLE["role"])
    return tqdm(disable=not _ROLE["bar"] or kwargs.pop("disable", False), **kwargs)
