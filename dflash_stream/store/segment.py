"""One segment: many samples packed into one zarr v3 group, written once and then only read.

Group attributes: format, codec, logical_dtype (bfloat16), layout, layer_ids, hidden_size. Arrays:
`input_ids` int32 [T], `loss_mask` bool [T], `offsets` int64 [n+1] (sample i is rows offsets[i]:offsets[i+1]),
`sample_ids` int64 [n], and the codec's state arrays (see `codecs.py`). Every chunk ends in a crc32c and
every chunk file is written, so a missing file is damage, never "all zeros". zarr writes and reads the
metadata; the chunks are coded here, by `WORKERS` threads, in zarr's own byte format (format 2; format 1
stored the lossless high plane fully transposed and fp8 without channel means and peaks).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec
from zarr.storage import LocalStore, MemoryStore

from dflash_stream.store import codecs
from dflash_stream.store.errors import CorruptChunk, StoreError

FORMAT = 2
MIN_HIDDEN = 8
WORKERS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
"""Threads per segment for chunk coding and file I/O: zstd, crc32c, numpy copies and writes release the GIL."""


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


def _gather(samples: list[Sample], pool: ThreadPoolExecutor) -> np.ndarray:
    """The samples' bf16 states as one little-endian uint16 array [T, K*D]. Raises StoreError naming the
    first sample with NaN or Inf."""
    ends = np.cumsum([len(s.input_ids) for s in samples]).tolist()
    bits = np.empty((ends[-1], samples[0].hidden_states.shape[1]), dtype="<u2")

    def copy(i: int) -> bool:
        rows = bits[ends[i] - len(samples[i].input_ids):ends[i]]
        np.copyto(rows, samples[i].hidden_states.view(torch.int16).numpy().view(np.uint16))
        # NaN and Inf are the bf16 values whose exponent bits are all ones: 0x7F80.. as int16, 0xFF80.. unsigned.
        return rows.max() >= 0xFF80 or rows.view(np.int16).max() >= 0x7F80

    for sample, bad in zip(samples, pool.map(copy, range(len(samples))), strict=True):
        if bad:
            raise StoreError(f"sample {sample.sample_id}: hidden_states hold NaN or Inf; refusing to store them")
    return bits


def raw_bytes(tokens: int, num_samples: int, width: int) -> int:
    """Uncompressed bytes of a segment: bf16 states, int32 ids, mask bytes, offsets and ids."""
    return tokens * (width * 2 + 4 + 1) + (2 * num_samples + 1) * 8


def segment_specs(codec: str, tokens: int, num_samples: int, width: int, num_layers: int) -> dict[str, codecs.ArraySpec]:
    # The states first: their chunks are coded while zarr writes the rest of the metadata.
    return {
        **codecs.state_specs(codec, tokens, width, num_layers),
        "input_ids": codecs.small_spec((tokens,), "int32"), "loss_mask": codecs.small_spec((tokens,), "bool"),
        "offsets": codecs.small_spec((num_samples + 1,), "int64"), "sample_ids": codecs.small_spec((num_samples,), "int64"),
    }


def disk_bound(raw: int, tokens: int, width: int, block: int, codec: str) -> int:
    """Worst-case bytes a segment of `raw` bytes can take on disk, as `du` counts them (before encoding)."""
    # The caller knows no layer count: hidden sizes of at least MIN_HIDDEN bound it. At most one sample per token.
    specs = segment_specs(codec, tokens, tokens, width, max(1, width // MIN_HIDDEN))
    arrays = len(specs)
    files = sum(spec.num_chunks for spec in specs.values()) + arrays + 1  # chunks, array and group metadata
    # Each file takes whole blocks plus one for its extent map, each directory (arrays and root) two.
    return sum(spec.stored_bound() for spec in specs.values()) + files * 2 * block + (arrays + 1) * 2 * block


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
    metadata: dict = {}
    group = zarr.create_group(store=MemoryStore(metadata), zarr_format=3, attributes={
        "format": FORMAT, "codec": codec, "logical_dtype": "bfloat16", "layout": "tokens x (layers * hidden)",
        "layer_ids": list(layer_ids), "hidden_size": hidden_size,
    })
    with ThreadPoolExecutor(WORKERS) as pool:
        bits = _gather(samples, pool)
        contents.update(codecs.encode_states(codec, bits, len(layer_ids)))
        chunks = {}
        for name, spec in segment_specs(codec, len(bits), len(samples), bits.shape[1], len(layer_ids)).items():
            arr = group.create_array(
                name, shape=spec.shape, dtype=spec.dtype, chunks=spec.chunks, fill_value=0,
                compressors=[ZstdCodec(level=codecs.ZSTD_LEVEL), Crc32cCodec()] if spec.compress else [Crc32cCodec()],
                # Flat chunk files ("c.3.0"): one directory per array, not one per chunk row.
                chunk_key_encoding={"name": "default", "separator": "."},
            )
            for i in range(spec.num_chunks):
                key = f"{name}/{arr.metadata.encode_chunk_key((i,) + (0,) * (len(spec.shape) - 1))}"
                chunks[key] = pool.submit(codecs.encode_chunk, contents[name][i * spec.rows:(i + 1) * spec.rows], spec)
        files = {key: memoryview(buf.to_bytes()) for key, buf in metadata.items()}
        files.update((key, chunk.result()) for key, chunk in chunks.items())
    return files


def write_file(path: Path, data: memoryview) -> None:
    """The one place segment bytes reach the disk (tests inject ENOSPC here)."""
    with open(path, "wb") as f:
        f.write(data)


def write_files(root: Path, files: dict[str, memoryview]) -> None:
    root.mkdir()
    for folder in sorted({(root / key).parent for key in files} - {root}):
        folder.mkdir(parents=True)
    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(lambda key: write_file(root / key, files[key]), files))


def _spec(segment_id: str, arr: zarr.Array) -> codecs.ArraySpec:
    """The layout of an array as its metadata records it, if this module can decode it."""
    names = [type(c).__name__ for c in arr.compressors]
    if names not in (["ZstdCodec", "Crc32cCodec"], ["Crc32cCodec"]) or tuple(arr.chunks[1:]) != arr.shape[1:]:
        raise CorruptChunk(f"segment {segment_id}: array '{arr.basename}' has codecs {names} and chunks {arr.chunks} "
                           f"for shape {arr.shape}; this store writes zstd + crc32c chunks along the first axis")
    return codecs.ArraySpec(arr.shape, arr.chunks[0], str(arr.dtype), compress=len(names) == 2)


def _read_array(segment_id: str, path: Path, arr: zarr.Array, pool: ThreadPoolExecutor) -> np.ndarray:
    spec = _spec(segment_id, arr)
    out = np.empty(spec.shape, dtype=np.dtype(spec.dtype).newbyteorder("<"))

    def read_chunk(i: int) -> None:
        key = arr.metadata.encode_chunk_key((i,) + (0,) * (len(spec.shape) - 1))
        try:
            data = np.fromfile(path / arr.basename / key, dtype=np.uint8)
        except FileNotFoundError:
            # zarr would read a missing chunk back as the fill value without a word.
            raise CorruptChunk(f"segment {segment_id}: array '{arr.basename}' has chunk files missing "
                               f"({path / arr.basename / key})") from None
        try:
            codecs.decode_chunk(data, spec, out[i * spec.rows:(i + 1) * spec.rows])
        except ValueError as err:
            raise CorruptChunk(f"segment {segment_id}: chunk {arr.basename}/{key} is corrupt ({err})") from None

    list(pool.map(read_chunk, range(spec.num_chunks)))
    return out


def read_segment(segment_id: str, path: Path) -> list[StoredSample]:
    try:
        group = zarr.open_group(LocalStore(path, read_only=True), mode="r", zarr_format=3)
        codec, layer_ids = group.attrs["codec"], group.attrs["layer_ids"]
        names = ("input_ids", "loss_mask", "offsets", "sample_ids", *codecs.state_arrays(codec))
        members = {name: group[name] for name in names}
    except (FileNotFoundError, ValueError, KeyError) as err:
        raise CorruptChunk(f"segment {segment_id}: metadata unreadable at {path} ({err!r})") from None
    with ThreadPoolExecutor(WORKERS) as pool:
        arrays = {name: _read_array(segment_id, path, arr, pool) for name, arr in members.items()}
    states = codecs.decode_states(codec, arrays, len(layer_ids))
    ids = torch.from_numpy(arrays["input_ids"]).long()
    mask = torch.from_numpy(arrays["loss_mask"])
    bounds = arrays["offsets"].tolist()
    return [
        StoredSample(int(sid), ids[a:b], mask[a:b], states[a:b])
        for sid, a, b in zip(arrays["sample_ids"].tolist(), bounds[:-1], bounds[1:], strict=True)
    ]
