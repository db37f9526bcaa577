"""Local JSON files (read directly) and datasets through HF `datasets` (hub names, parquet), and the stable,
sharded order of their rows. `datasets` (and its pyarrow) is imported only where it is needed, so a run on local
JSON data works without it (a GPU image that lacks it, say)."""

from __future__ import annotations

import hashlib
import json
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from dflash_stream.config import ConfigError, DataConfig, SourceConfig
from dflash_stream.log import get_logger

log = get_logger(__name__)

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


class JsonRows(Sequence):
    """The well-formed object rows of local JSON / JSON Lines files, in file order. Lines are parsed when read
    (only their byte offsets are held, so a large file costs little memory in every extractor); the items of a
    JSON array file are held as parsed."""

    def __init__(self) -> None:
        self.files: list[Path] = []
        self.items: list[dict] = []
        self._file, self._start, self._end = array("q"), array("q"), array("q")
        self._handles: dict[int, BinaryIO] = {}

    def _add(self, file_index: int, start: int, end: int) -> None:
        self._file.append(file_index)
        self._start.append(start)
        self._end.append(end)

    def __len__(self) -> int:
        return len(self._start)

    def __getitem__(self, row: int) -> dict:  # type: ignore[override]
        index = self._file[row]
        if index < 0:
            return self.items[self._start[row]]
        handle = self._handles.get(index)
        if handle is None:
            handle = self._handles[index] = self.files[index].open("rb")
        handle.seek(self._start[row])
        return json.loads(handle.read(self._end[row] - self._start[row]))

    def scan(self, path: Path, malformed: list[str]) -> int:
        """Add a file's rows; entries that are not JSON, or not an object, go to `malformed` as `file#line`
        (items of a JSON array as `file[i]`). Returns how many entries the file had, good or bad."""
        data = path.read_bytes()
        if path.suffix == ".json":
            try:
                whole = json.loads(data)
            except ValueError:
                whole = None  # JSON Lines under a .json name, as the datasets loader also accepts
            if isinstance(whole, list):
                for i, item in enumerate(whole):
                    if isinstance(item, dict):
                        self._add(-1, len(self.items), 0)
                        self.items.append(item)
                    else:
                        malformed.append(f"{path.name}[{i}]")
                return len(whole)
        self.files.append(path)
        file_index, entries, start = len(self.files) - 1, 0, 0
        for lineno, line in enumerate(data.splitlines(keepends=True), 1):
            end = start + len(line)
            if line.strip():
                entries += 1
                try:
                    item = json.loads(line)
                except ValueError:  # not JSON, or not UTF-8
                    item = None
                if isinstance(item, dict):
                    self._add(file_index, start, end)
                else:
                    malformed.append(f"{path.name}#{lineno}")
            start = end
        return entries


def _load_json_files(files: list[Path]) -> tuple[JsonRows, list[str]]:
    rows, malformed = JsonRows(), []
    for path in files:
        if not rows.scan(path, malformed) and len(files) > 1:
            log.warning("no rows in %s", path)
    return rows, malformed


def _datasets():
    import datasets

    datasets.disable_progress_bars()  # one bar per file would bury the extractor's own
    return datasets


def load_source(source: SourceConfig, index: int) -> tuple[Sequence, list[str]]:
    """The source's rows (dicts), from a local json/jsonl/parquet file or folder, or a hub dataset; and the
    labels (`file#line`) of malformed lines in local JSON files, which are skipped, not fatal."""
    key = f"data.sources[{index}].path"
    path = Path(source.path).expanduser()
    malformed: list[str] = []
    try:
        if path.exists():
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in LOCAL_BUILDERS)
            builders = {LOCAL_BUILDERS.get(p.suffix) for p in files}
            if not files or None in builders or len(builders) > 1:
                raise ConfigError(f"{key}: '{source.path}' must be .json/.jsonl/.parquet file(s) of one kind")
            if builders == {"json"}:
                ds, malformed = _load_json_files(files)
            else:
                ds = _datasets().load_dataset("parquet", data_files=[str(p) for p in files], split="train")
        else:
            ds = _datasets().load_dataset(source.path, source.subset, split=source.split)
    except ConfigError:
        raise
    except Exception as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{key}: cannot load '{source.path}': {first_line}") from None
    if len(ds) == 0 and not malformed:
        raise ConfigError(f"{key}: no rows in {source.path}")
    if source.limit is not None and source.limit < len(ds):
        ds = _Head(ds, source.limit) if isinstance(ds, JsonRows) else ds.select(range(source.limit))
    return ds, malformed


class _Head(Sequence):
    """The first `limit` rows of a row sequence (source.limit)."""

    def __init__(self, rows: Sequence, limit: int) -> None:
        self.rows, self.limit = rows, limit

    def __len__(self) -> int:
        return self.limit

    def __getitem__(self, row: int) -> dict:  # type: ignore[override]
        if not 0 <= row < self.limit:
            raise IndexError(row)
        return self.rows[row]


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


def _distinct_names(data: DataConfig) -> list[str]:
    names = [source_name(s) for s in data.sources]
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise ConfigError(f"data.sources[{i}].name: '{name}' is used twice; sample ids need distinct names")
    return names


def count_row_copies(data: DataConfig, sizes: list[int]) -> int:
    """len(plan_rows(data, sizes)) without hashing and sorting every row: a whole weight repeats each row
    alike, so only a fractional weight's rows are looked at (plan counts a 900k-row headline in milliseconds)."""
    names = _distinct_names(data)
    total = 0
    for name, source, size in zip(names, data.sources, sizes, strict=True):
        if source.weight == math.floor(source.weight):
            total += size * int(source.weight)
        else:
            total += sum(copies(name, row, source.weight) for row in range(size))
    return total


def plan_rows(data: DataConfig, sizes: list[int]) -> list[RowRef]:
    """Every row copy of every source in one deterministic order (a seeded shuffle that mixes the sources)."""
    names = _distinct_names(data)
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
