"""How many bytes a segment takes: the one home of the store's size arithmetic (raw and worst case) and of
the smallest workable budget. The store, the extractor, `plan` and `tune` all count with these; the module
needs no torch, so `plan` can use it without loading models.
"""

from __future__ import annotations

import os
from pathlib import Path

from dflash_stream.store import codecs
from dflash_stream.store.budget import SLACK_BLOCKS, block_size

IDS_MASK_BYTES_PER_TOKEN = 5
"""int32 token id + bool loss mask, stored beside each token's states."""
MIN_HIDDEN = 8
"""Hidden sizes of at least this bound the layer count where a caller knows only the width."""
BASE_BLOCKS = 40
"""Blocks the empty store takes: two per directory (up to 16), store.json, the lock and a few markers."""


def raw_bytes_per_token(width: int) -> int:
    """Raw bytes one token adds to a segment: bf16 states of width K*D, its id and its mask byte."""
    return 2 * width + IDS_MASK_BYTES_PER_TOKEN


def raw_bytes(tokens: int, num_samples: int, width: int) -> int:
    """Uncompressed bytes of a segment: per-token bytes plus each sample's id and offset and the closing offset."""
    return tokens * raw_bytes_per_token(width) + (2 * num_samples + 1) * 8


def max_segment_raw_bytes(segment_bytes: int, max_length: int, width: int) -> int:
    """A segment is filled to `segment_bytes`, but one sample of `max_length` tokens may exceed that."""
    return max(int(segment_bytes), raw_bytes(max_length, 1, width))


def segment_specs(codec: str, tokens: int, num_samples: int, width: int, num_layers: int) -> dict[str, codecs.ArraySpec]:
    """Every array of a segment. The states come first: their chunks are coded while the rest is set up."""
    return {
        **codecs.get(codec).specs(tokens, width, num_layers),
        "input_ids": codecs.small_spec((tokens,), "int32"), "loss_mask": codecs.small_spec((tokens,), "bool"),
        "offsets": codecs.small_spec((num_samples + 1,), "int64"),
        "sample_ids": codecs.small_spec((num_samples,), "int64"),
    }


def disk_bound(raw: int, tokens: int, width: int, block: int, codec: str) -> int:
    """Worst-case bytes a segment of `raw` bytes can take on disk, as `du` counts them (before encoding)."""
    # At most one sample per token; hidden sizes of at least MIN_HIDDEN bound the layer count (a divisor).
    layers = max(k for k in range(1, max(1, width // MIN_HIDDEN) + 1) if width % k == 0)
    specs = segment_specs(codec, tokens, tokens, width, layers)
    arrays = len(specs)
    files = sum(spec.num_chunks for spec in specs.values()) + arrays + 1  # chunks, array and group metadata
    # Each file takes whole blocks plus one for its extent map, each directory (arrays and root) two.
    return sum(spec.stored_bound() for spec in specs.values()) + files * 2 * block + (arrays + 1) * 2 * block


def min_budget(max_segment_raw_bytes: int, width: int, block: int, codec: str) -> int:
    """The smallest workable budget: one worst-case segment beside the empty store and the slack. With it a
    writer and a trainer take turns; `plan` advises more (see its buffer section)."""
    tokens = max_segment_raw_bytes // raw_bytes_per_token(width) + 1
    return (disk_bound(max_segment_raw_bytes, tokens, width, block, codec)
            + (BASE_BLOCKS + SLACK_BLOCKS + 4) * block)


def smallest_budget(path: str | os.PathLike, max_segment_raw_bytes: int, width: int, codec: str) -> int:
    """`min_budget` for a store at `path` (which may not exist yet: its nearest existing parent gives the
    block size). `Store.open` refuses less; `plan` reports this figure."""
    path = Path(path)
    existing = next(p for p in (path, *path.parents) if p.exists())
    return min_budget(max_segment_raw_bytes, width, block_size(existing), codec)
