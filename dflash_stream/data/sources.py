"""Rows of local JSON files (read directly) or of HF `datasets` (hub names, parquet), and the stable, sharded
order of the rows they contribute. `datasets` (and its pyarrow) is imported only where it is needed, so a run on
local JSON data works without it (a GPU image that lacks it, say).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash_stream.config import ConfigError, DataConfig, SourceConfig

LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def stable_hash(*parts: object) -> int:
    """A non-negative int63 that is the same on every machine and Python run (unlike `hash`)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)


def source_name(source: SourceConfig) -> str:
    """The label sample ids hash: `name`, else the file or folder name (not its absolute path, which differs
    between machines), else the hub id with its subset and split."""
    if source.name:
        return source.name
    path = Path(source.path).expanduser()
    if path.exists():
        return path.name
    subset = f"/{source.subset}" if source.subset else ""
    return f"{source.path}{subset}:{source.split}"


def _json_rows(path: Path) -> list[dict] | None:
    """The rows of a JSON Lines file, or of a .json file holding a list of rows (or JSON Lines under that
    name); None for other layouts, which go to the `datasets` loader."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError:
            rows = None  # maybe JSON Lines under a .json name
        else:
            return rows if isinstance(rows, list) and all(isinstance(r, dict) for r in rows) else None
    try:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError:
        return None
    return rows if all(isinstance(r, dict) for r in rows) else None


def _local_json(files: list[Path]) -> list[dict] | None:
    rows: list[dict] = []
    for file in files:
        part = _json_rows(file)
        if part is None:
            return None
        rows += part
    return rows


def load_source(source: SourceConfig, index: int) -> Sequence[dict]:
    """The source's rows: a local json/jsonl file or folder of them (read here), a local parquet file or folder,
    or a hub dataset (a `datasets.Dataset`)."""
    key = f"data.sources[{index}].path"
    path = Path(source.path).expanduser()
    try:
        if path.exists():
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in LOCAL_BUILDERS)
            builders = {LOCAL_BUILDERS.get(p.suffix) for p in files}
            if not files or None in builders or len(builders) > 1:
                raise ConfigError(f"{key}: '{source.path}' must be .json/.jsonl/.parquet file(s) of one kind")
            rows = _local_json(files) if builders == {"json"} else None
            if rows is not None:
                return rows[: source.limit] if source.limit is not None else rows
            import datasets

            datasets.disable_progress_bars()  # one bar per file would bury the extractor's own
            ds = datasets.load_dataset(builders.pop(), data_files=[str(p) for p in files], split="train")
        else:
            import datasets

            datasets.disable_progress_bars()
            ds = datasets.load_dataset(source.path, source.subset, split=source.split)
    except ConfigError:
        raise
    except Exception as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{key}: cannot load '{source.path}': {first_line}") from None
    if source.limit is not None and source.limit < len(ds):
        ds = ds.select(range(source.limit))
    return ds


@dataclass(frozen=True)
class RowRef:
    """One copy of one dataset row: what a sample id stands for."""

    source: int
    row: int
    copy: int
    sample_id: int


def copies(name: str, row: int, weight: float) -> int:
    """`weight` copies of the row on average: the integer part always, the fraction for a stable subset of rows."""
    whole, frac = int(math.floor(weight)), weight - math.floor(weight)
    extra = frac > 0 and stable_hash(name, row, "weight") / 2**63 < frac
    return whole + int(extra)


def plan_rows(data: DataConfig, sizes: list[int]) -> list[RowRef]:
    """Every row copy of every source in one deterministic order (a seeded shuffle that mixes the sources)."""
    names = [source_name(s) for s in data.sources]
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise ConfigError(f"data.sources[{i}].name: '{name}' is used twice; sample ids need distinct names")
    refs = []
    for s, (source, size) in enumerate(zip(data.sources, sizes, strict=True)):
        name = names[s]
        for row in range(size):
            for copy in range(copies(name, row, source.weight)):
                # Copy 0 keeps the plain (name, row) id so adding a weight later does not rename existing samples.
                sid = stable_hash(name, row) if copy == 0 else stable_hash(name, row, copy)
                refs.append(RowRef(s, row, copy, sid))
    if len({r.sample_id for r in refs}) != len(refs):
        raise ConfigError("data.sources: two rows hash to the same sample id; rename a source (data.sources[i].name)")
    refs.sort(key=lambda r: stable_hash(data.seed, r.sample_id))
    return refs


def shard(refs: list[RowRef], index: int, count: int) -> list[RowRef]:
    """Extractor `index` of `count` takes every count-th row copy: the shards partition the rows exactly."""
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} outside 0..{count - 1}")
    return refs[index::count]
