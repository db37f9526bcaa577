"""One segment: many samples packed into one zarr v3 group, written once and then only read.

Group attributes: format, codec, logical_dtype (bfloat16), layout, layer_ids, hidden_size. Arrays:
`input_ids` int32 [T], `loss_mask` bool [T], `offsets` int64 [n+1] (sample i is rows offsets[i]:offsets[i+1]),
`sample_ids` int64 [n], and the codec's state arrays (see `codecs.py`). Every chunk ends in a crc32c and
every chunk file is written, so a missing file is damage, never "all zeros". Metadata and chunks are
written here in zarr's own format (zarr-python reads a segment as it is); the chunks are coded by `WORKERS`
threads. Format 3 stores the lossless high plane layer-major and codes it for speed; format 2 grouped it by 32
channels; format 1 transposed it fully and stored fp8 without channel means and peaks.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_stream.store import codecs
from dflash_stream.store.errors import CorruptChunk, StoreError
from dflash_stream.store.profile import stage
from dflash_stream.store.sizes import segment_specs

FORMAT = 3
WORKERS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
"""Threads for chunk coding and file I/O: zstd, crc32c, numpy copies and writes release the GIL."""
_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def _forget_pool() -> None:
    """In a forked child: the parent's threads are not there."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _run(fn: Callable[[Any], Any], items: Iterable) -> list:
    """fn over items on the process's coding threads, results in order. Every call has finished when this
    returns or raises (the first error in order), so a caller that cleans up after an error finds no write
    still under way. The threads are kept between segments: starting WORKERS threads per call cost more than
    their start (each new thread's malloc arena faulted its buffers in again: ~3 ms of a 40 ms encode)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != WORKERS:  # the bench sets WORKERS between runs
            if _POOL is not None:
                _POOL[1].shutdown(wait=False)
            _POOL = (WORKERS, ThreadPoolExecutor(WORKERS, thread_name_prefix="dflash-segment"))
        pool = _POOL[1]
    futures = [pool.submit(fn, item) for item in items]
    wait(futures)
    return [f.result() for f in futures]


@dataclass
class Sample:
    """What an extractor hands to a writer."""

    sample_id: int
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]
    hidden_states: torch.Tensor  # bfloat16 [T, K*D] on CPU


@dataclass
class StoredSample:
    """What a consumer gets back."""

    sample_id: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    hidden_states: torch.Tensor  # bfloat16 [T, K*D], a view of the segment's decoded buffer


def check_samples(samples: list[Sample], width: int) -> int:
    """Total tokens; raises StoreError naming the first sample that cannot be stored."""
    if not samples:
        raise StoreError("a segment needs at least one sample")
    total = 0
    for s in samples:
        hs, t = s.hidden_states, len(s.input_ids)
        if hs.dtype != torch.bfloat16 or hs.dim() != 2 or hs.shape[1] != width:
            raise StoreError(
                f"sample {s.sample_id}: hidden_states must be bfloat16 [tokens, {width}], got {hs.dtype} {list(hs.shape)}"
            )
        if hs.shape[0] != t or len(s.loss_mask) != t or t == 0:
            raise StoreError(
                f"sample {s.sample_id}: {t} input_ids, {len(s.loss_mask)} loss_mask and {hs.shape[0]} state rows "
                "must be equal and non-zero"
            )
        total += t
    return total


def _words(states: torch.Tensor) -> np.ndarray:
    """bf16 states as little-endian uint16 words, a view."""
    return states.view(torch.int16).numpy().view(np.uint16)


def _non_finite(samples: list[Sample]) -> StoreError:
    """The error naming the first sample with NaN or Inf (the caller found one)."""
    bad = next((s for s in samples if not torch.isfinite(s.hidden_states).all()), samples[0])
    return StoreError(f"sample {bad.sample_id}: hidden_states hold NaN or Inf; refusing to store them")


def _gather(samples: list[Sample]) -> np.ndarray:
    """The samples' bf16 states as one little-endian uint16 array [T, K*D]. Raises StoreError naming the first
    sample with NaN or Inf."""
    ends = np.cumsum([len(s.input_ids) for s in samples]).tolist()
    bits = np.empty((ends[-1], samples[0].hidden_states.shape[1]), dtype="<u2")

    def copy(i: int) -> bool:
        with stage("gather"):
            rows = bits[ends[i] - len(samples[i].input_ids):ends[i]]
            np.copyto(rows, _words(samples[i].hidden_states))
            return codecs.non_finite(rows)

    if any(_run(copy, range(len(samples)))):
        raise _non_finite(samples)
    return bits


def files_bound(files: dict[str, memoryview], block: int) -> int:
    """Most bytes `files` can take once written: whole blocks, one more each for the extent map, and the
    directories that hold them."""
    dirs = {"", *(key.rpartition("/")[0] for key in files)}
    return sum((-(-len(data) // block) + 1) * block for data in files.values()) + len(dirs) * 2 * block


def encode_segment(samples: list[Sample], codec: str, layer_ids: list[int], hidden_size: int) -> dict[str, memoryview]:
    """The segment's files (relative path -> bytes), encoded in memory so that their size is known before
    any disk space is reserved."""
    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    contents = {
        "input_ids": np.concatenate([np.asarray(s.input_ids, dtype=np.int32) for s in samples]),
        "loss_mask": np.concatenate([np.asarray(s.loss_mask, dtype=bool) for s in samples]),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "sample_ids": np.array([s.sample_id for s in samples], dtype=np.int64),
    }
    attributes = {"format": FORMAT, "codec": codec, "logical_dtype": "bfloat16",
                  "layout": "tokens x (layers * hidden)", "layer_ids": list(layer_ids), "hidden_size": hidden_size}
    files = {"zarr.json": _json({"attributes": attributes, "zarr_format": 3, "node_type": "group"})}
    coder = codecs.get(codec)
    if coder.layer_rows:
        bits = codecs.LayerRows.of([_words(s.hidden_states) for s in samples], len(layer_ids))
    else:
        bits = _gather(samples)
    contents.update(coder.encode(bits, len(layer_ids)))
    tokens, width = len(contents["input_ids"]), samples[0].hidden_states.shape[1]
    layout = segment_specs(codec, tokens, len(samples), width, len(layer_ids))
    for name, spec in layout.items():
        files[f"{name}/zarr.json"] = _json(_array_metadata(spec))
    # Job i codes chunk i of every array: the byte planes of the same rows are split from one read of them.
    jobs = [{f"{name}/{_chunk_key(spec, i)}": (contents[name][i * spec.rows:(i + 1) * spec.rows], spec)
             for name, spec in layout.items() if i < spec.num_chunks}
            for i in range(max(spec.num_chunks for spec in layout.values()))]
    try:
        for job, coded in zip(jobs, _run(lambda job: codecs.encode_chunks(list(job.values())), jobs), strict=True):
            files.update(zip(job, coded, strict=True))
    except codecs.NonFinite:
        raise _non_finite(samples) from None
    return files


# ---- zarr v3 metadata, as zarr-python 3 writes it (written and read here: zarr's async machinery costs
# milliseconds per array, more than coding a small segment; zarr itself reads these segments as they are) ----
def _json(obj: dict) -> memoryview:
    return memoryview(json.dumps(obj).encode())


def _chunk_key(spec: codecs.ArraySpec, i: int) -> str:
    """Flat chunk files ("c.3.0"): one directory per array, not one per chunk row."""
    return ".".join(["c", str(i), *["0"] * (len(spec.shape) - 1)])


def _array_metadata(spec: codecs.ArraySpec) -> dict:
    layout = [{"name": "bytes", **({"configuration": {"endian": "little"}} if np.dtype(spec.dtype).itemsize > 1 else {})}]
    compress = [{"name": "zstd", "configuration": {"level": spec.level, "checksum": False}}] if spec.compress else []
    return {
        "shape": list(spec.shape), "data_type": spec.dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(spec.chunks)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": False if spec.dtype == "bool" else 0,
        "codecs": [*layout, *compress, {"name": "crc32c"}],
        "attributes": {}, "zarr_format": 3, "node_type": "array", "storage_transformers": [],
    }


def _spec(segment_id: str, name: str, meta: dict) -> codecs.ArraySpec:
    """The layout of an array as its metadata records it, if this module can decode it."""
    coders = meta["codecs"]
    shape, names = tuple(meta["shape"]), [c["name"] for c in coders]
    chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
    little = coders[0].get("configuration", {}).get("endian", "little") == "little"
    if (names not in (["bytes", "zstd", "crc32c"], ["bytes", "crc32c"]) or chunks[1:] != shape[1:] or not little
            or meta["chunk_key_encoding"] != {"name": "default", "configuration": {"separator": "."}}):
        raise CorruptChunk(f"segment {segment_id}: array '{name}' has codecs {names} and chunks {list(chunks)} for "
                           f"shape {list(shape)}; this store writes zstd + crc32c chunks along the first axis")
    level = coders[1]["configuration"]["level"] if len(names) == 3 else 0
    return codecs.ArraySpec(shape, chunks[0], meta["data_type"], compress=len(names) == 3, level=level)


def write_file(path: Path, data: memoryview) -> None:
    """The one place segment bytes reach the disk (tests inject ENOSPC here)."""
    with stage("write"), open(path, "wb") as f:
        f.write(data)


def write_files(root: Path, files: dict[str, memoryview]) -> None:
    root.mkdir()
    for folder in sorted({(root / key).parent for key in files} - {root}):
        folder.mkdir(parents=True)
    _run(lambda key: write_file(root / key, files[key]), files)


def _chunk_reader(segment_id: str, path: Path, specs: dict[str, codecs.ArraySpec]) -> codecs.ChunkReader:
    """How the arrays of the segment at `path` are read, one chunk at a time (any thread)."""

    def read(name: str, i: int, out: np.ndarray) -> None:
        spec, key = specs[name], _chunk_key(specs[name], i)
        file = path / name / key
        try:
            if not spec.compress and len(out) == spec.rows:
                # Stored as is: read straight into `out`, then check it there.
                with stage("read"):
                    tail = _read_into(file, out)
                if tail is not None:
                    codecs.check_chunk(out.view(np.uint8).reshape(-1), tail)
                    return
            with stage("read"):
                data = np.fromfile(file, dtype=np.uint8)
            codecs.decode_chunk(data, spec, out)
        except FileNotFoundError:
            # zarr would read a missing chunk back as the fill value without a word.
            raise CorruptChunk(f"segment {segment_id}: array '{name}' has chunk files missing ({file})") from None
        except ValueError as err:
            raise CorruptChunk(f"segment {segment_id}: chunk {name}/{key} is corrupt ({err})") from None

    return read


def _read_into(file: Path, out: np.ndarray) -> bytes | None:
    """The checksum after `out`'s bytes in `file`, having read those bytes into `out` (C-contiguous); None
    if the file is not exactly that long (the caller reads it the general way, which names the damage)."""
    with open(file, "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size != out.nbytes + codecs.CHECKSUM_BYTES:
            return None
        if f.readinto(out.view(np.uint8).reshape(-1)) != out.nbytes:
            return None
        tail = f.read(codecs.CHECKSUM_BYTES)
    return tail if len(tail) == codecs.CHECKSUM_BYTES else None


def _read_array(name: str, spec: codecs.ArraySpec, read: codecs.ChunkReader) -> np.ndarray:
    out = np.empty(spec.shape, dtype=np.dtype(spec.dtype).newbyteorder("<"))
    _run(lambda i: read(name, i, out[i * spec.rows:(i + 1) * spec.rows]), range(spec.num_chunks))
    return out


def read_segment(segment_id: str, path: Path) -> list[StoredSample]:
    try:
        attrs = json.loads((path / "zarr.json").read_bytes())["attributes"]
        codec, layer_ids = attrs["codec"], attrs["layer_ids"]
        names = (*codecs.get(codec).arrays(), "input_ids", "loss_mask", "offsets", "sample_ids")
        specs = {name: _spec(segment_id, name, json.loads((path / name / "zarr.json").read_bytes())) for name in names}
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        raise CorruptChunk(f"segment {segment_id}: metadata unreadable at {path} ({err!r})") from None
    coder, read = codecs.get(codec), _chunk_reader(segment_id, path, specs)
    arrays = {name: _read_array(name, spec, read) for name, spec in specs.items() if name not in coder.arrays()}
    with stage("plane merge"):
        states = coder.decode_chunks(read, {name: specs[name] for name in coder.arrays()}, len(layer_ids), _run)
    ids = torch.from_numpy(arrays["input_ids"]).long()
    mask = torch.from_numpy(arrays["loss_mask"])
    bounds = arrays["offsets"].tolist()
    return [
        StoredSample(int(sid), ids[a:b], mask[a:b], states[a:b])
        for sid, a, b in zip(arrays["sample_ids"].tolist(), bounds[:-1], bounds[1:], strict=True)
    ]
