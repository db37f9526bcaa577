"""Checks that run before a command writes anything: the paths a config names exist or can be written.

A bad path found after the store was created or the first files written leaves debris that the corrected rerun
trips over, so `run`, `extract` and `train` call `check_run_paths` first; other commands that write one file or
folder call `probe_writable` on it.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from dflash_stream.config import Config, ConfigError
from dflash_stream.errors import DFlashError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
DATA_SUFFIXES = (".json", ".jsonl", ".parquet")


def looks_local(name: str) -> bool:
    """A filesystem path rather than a hub id (`org/name`): absolute, `./`, `../`, `~`, or more than one `/`."""
    return name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name or not _HUB_ID.match(name)


def probe_writable(path: str | Path, what: str) -> None:
    """One line unless `path` (a folder, existing or still to be created) can be written; leaves nothing behind."""
    path = Path(path).expanduser()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise DFlashError(f"{what} {path}: {existing} exists and is not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".dflash-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise DFlashError(f"{what} {path} is not writable: {err.strerror} ({existing})") from None


def check_run_paths(cfg: Config, data: bool = True) -> None:
    """Local data files (unless `data` is False: `train` never reads them, and may run where they are not) and
    the output and store folders, before anything is written. The target is checked by
    `target_model.model_location`, which every command goes through."""
    for i, source in enumerate(cfg.data.sources if data else []):
        path = Path(source.path).expanduser()
        local = looks_local(source.path) or source.path.endswith(DATA_SUFFIXES)
        if local and not path.exists():
            raise ConfigError(f"data.sources[{i}].path: '{source.path}' not found (no such file or folder)")
    probe_writable(cfg.output_dir, "output_dir")
    probe_writable(cfg.store.path, "store.path")
    source = cfg.extract.from_store
    if source is not None:
        if not (Path(source).expanduser() / "store.json").is_file():
            raise ConfigError(f"extract.from_store: no store at '{source}' (store.json is missing)")
        if Path(source).expanduser().resolve() == Path(cfg.store.path).expanduser().resolve():
            raise ConfigError("extract.from_store: must be another store than store.path (it is only read)")
