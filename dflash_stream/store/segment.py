"""One segment: many samples packed into one zarr v3 group, written once and then only read.

Group attributes: format, codec, logical_dtype (bfloat16), layout, layer_ids, hidden_size. Arrays:
`input_ids` int32 [T], `loss_mask` bool [T], `offsets` int64 [n+1] (sample i is rows offsets[i]:offsets[i+1]),
`sample_ids` int64 [n], and the codec's state arrays (see `codecs.py`). Every chunk ends in a crc32c and
every chunk file is written, so a missing file is damage, never "all zeros".
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zarr
from zarr.storage import LocalStore, MemoryStore

from dflash_stream.store import codecs
from dflash_stream.store.errors import CorruptChunk, StoreError

FORMAT = 1
ARRAYS_PER_SEGMENT = 6  # input_ids, loss_mask, offsets, sample_ids and up to two state arrays


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


def _check_finite(bits: np.ndarray, samples: list[Sample]) -> None:
    """NaN and Inf are the bf16 values whose exponent bits are all ones."""
    bad = (bits & 0x7F80) == 0x7F80
    if bad.any():
        row = int(np.argmax(bad.any(axis=1)))
        ends = np.cumsum([len(s.input_ids) for s in samples])
        culprit = samples[int(np.searchsorted(ends, row, side="right"))]
        raise StoreError(f"sample {culprit.sample_id}: hidden_states hold NaN or Inf; refusing to store them")


def raw_bytes(tokens: int, num_samples: int, width: int) -> int:
    """Uncompressed bytes of a segment: bf16 states, int32 ids, mask bytes, offsets and ids."""
    return tokens * (width * 2 + 4 + 1) + (2 * num_samples + 1) * 8


def disk_bound(raw: int, tokens: int, width: int, block: int, codec: str) -> int:
    """Worst-case bytes a segment of `raw` bytes can take on disk, as `du` counts them (before encoding)."""
    (channels, _), (rows, _) = codecs.chunk_shapes(tokens, width)
    by_channel, by_token = math.ceil(width / channels), math.ceil(tokens / rows)
    state_chunks = by_channel + by_token
    # zarr stores edge chunks whole, zero-padded: real bytes where a plane is stored as is (token-major),
    # while zstd squeezes zeros by far more than 128:1.
    pad_token_major = (by_token * rows - tokens) * width
    pad_channel_major = (by_channel * channels - width) * tokens
    padding = pad_token_major * codecs.UNCOMPRESSED_BYTES_PER_VALUE[codec] + (pad_token_major + pad_channel_major) * 2 // 128
    files = state_chunks + 2 * ARRAYS_PER_SEGMENT + 2  # chunks, per-array and group metadata
    return codecs.encoded_bound(raw + padding, files) + files * 2 * block + (ARRAYS_PER_SEGMENT + 1) * 2 * block


def files_bound(files: dict[str, bytes], block: int) -> int:
    """Most bytes `files` can take once written: whole blocks, one more each for the extent map, and the
    directories that hold them."""
    dirs = {"", *(key.rpartition("/")[0] for key in files)}
    return sum((-(-len(data) // block) + 1) * block for data in files.values()) + len(dirs) * 2 * block


def encode_segment(samples: list[Sample], codec: str, layer_ids: list[int], hidden_size: int) -> dict[str, bytes]:
    """The segment's files (relative path -> bytes), encoded in memory so that their size is known before
    any disk space is reserved, and a failed write never races zarr's own concurrent writers."""
    # bf16 kernels on CPU are slow; everything below works on the raw bits.
    bits = np.concatenate([s.hidden_states.view(torch.int16).numpy().view(np.uint16) for s in samples])
    _check_finite(bits, samples)
    files: dict = {}
    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    group = zarr.create_group(store=MemoryStore(files), zarr_format=3, attributes={
        "format": FORMAT, "codec": codec, "logical_dtype": "bfloat16", "layout": "tokens x (layers * hidden)",
        "layer_ids": list(layer_ids), "hidden_size": hidden_size,
    })
    codecs.write_small(group, "input_ids", np.concatenate([np.asarray(s.input_ids, dtype=np.int32) for s in samples]))
    codecs.write_small(group, "loss_mask", np.concatenate([np.asarray(s.loss_mask, dtype=bool) for s in samples]))
    codecs.write_small(group, "offsets", offsets)
    codecs.write_small(group, "sample_ids", np.array([s.sample_id for s in samples], dtype=np.int64))
    codecs.write_states(group, codec, bits, len(layer_ids))
    return {key: buf.to_bytes() for key, buf in files.items()}


def write_file(path: Path, data: bytes) -> None:
    """The one place segment bytes reach the disk (tests inject ENOSPC here)."""
    with open(path, "wb") as f:
        f.write(data)


def write_files(root: Path, files: dict[str, bytes]) -> None:
    root.mkdir()
    for key, data in files.items():
        target = root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        write_file(target, data)


def _chunk_files(array_dir: Path) -> int:
    return sum(1 for e in os.scandir(array_dir) if e.name.startswith("c."))


def _read_array(segment_id: str, path: Path, group: zarr.Group, name: str) -> np.ndarray:
    arr = group[name]
    # zarr reads a missing chunk back as the fill value without a word, so count the files first.
    if _chunk_files(path / name) != arr.nchunks:
        raise CorruptChunk(f"segment {segment_id}: array '{name}' has chunk files missing ({path / name})")
    try:
        return arr[...]
    except ValueError:
        pass  # zarr's checksum error does not say which chunk: find it chunk by chunk
    for index in np.ndindex(*arr.cdata_shape):
        try:
            arr.blocks[index]
        except ValueError as err:
            key = ".".join(map(str, index))
            raise CorruptChunk(f"segment {segment_id}: chunk {name}/c.{key} is corrupt ({err})") from None
    raise CorruptChunk(f"segment {segment_id}: array '{name}' failed to decode")


def read_segment(segment_id: str, path: Path) -> list[StoredSample]:
    try:
        group = zarr.open_group(LocalStore(path, read_only=True), mode="r", zarr_format=3)
    except (FileNotFoundError, ValueError) as err:
        raise CorruptChunk(f"segment {segment_id}: metadata unreadable at {path} ({err})") from None
    codec, layer_ids = group.attrs["codec"], group.attrs["layer_ids"]
    arrays = {name: _read_array(segment_id, path, group, name)
              for name in ("input_ids", "loss_mask", "offsets", "sample_ids", *codecs.state_arrays(codec))}
    states = codecs.read_states(arrays, codec, len(layer_ids))
    ids = torch.from_numpy(arrays["input_ids"]).long()
    mask = torch.from_numpy(arrays["loss_mask"])
    bounds = arrays["offsets"].tolist()
    return [
        StoredSample(int(sid), ids[a:b], mask[a:b], states[a:b])
        for sid, a, b in zip(arrays["sample_ids"].tolist(), bounds[:-1], bounds[1:], strict=True)
    ]
