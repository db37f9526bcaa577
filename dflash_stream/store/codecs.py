"""How hidden states become zarr arrays, per `store.codec`.

Every codec writes arrays chunked along tokens with a crc32c checksum as the last codec, so any flipped byte
is caught when the chunk is read.

- `lossless`: bf16 split into its two byte planes. The high plane (sign, exponent, top mantissa bit) is stored
  transposed, channel-major, so zstd sees each channel's slowly varying exponent as one run; the low plane
  (low mantissa bits) is near-random, so it is stored as is: zstd gains under 1 % on it at a large cost in
  speed. Bit-exact.
- `fp8`: e4m3 with one float32 scale per token per layer (massive activations live in a few channels of deep
  layers, so one scale per token would crush the other layers), then zstd over the channel-major bytes.
- `none`: the raw uint16 view, for comparison.
"""

from __future__ import annotations

import numpy as np
import torch
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

CODECS = ("lossless", "fp8", "none")
PLANE_CHUNK_BYTES = 2 << 20
"""Bytes of one byte plane per chunk: zstd gains little beyond this and chunks stay a unit of parallel work."""
SLAB_BYTES = 2 << 20
"""Rows transposed at a time: a slab that fits in cache transposes several times faster than the whole."""
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def chunk_shapes(tokens: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(channel-major [channels, tokens], token-major [tokens, width]) chunk shapes of one byte plane.
    Channel-major chunks split channels and keep every token, so each channel's run spans the segment."""
    return (max(1, min(width, PLANE_CHUNK_BYTES // tokens)), tokens), (max(1, min(tokens, PLANE_CHUNK_BYTES // width)), width)


def _array(group: zarr.Group, name: str, data: np.ndarray, chunks: tuple[int, ...], compress: bool = True) -> None:
    arr = group.create_array(
        name, shape=data.shape, dtype=data.dtype, chunks=chunks, fill_value=0,
        compressors=[ZstdCodec(level=1), Crc32cCodec()] if compress else [Crc32cCodec()],
        # Flat chunk files ("c.3.0"): one directory per array, not one per chunk row.
        chunk_key_encoding={"name": "default", "separator": "."},
        # Every chunk is written, even all zeros: a missing chunk file then always means damage.
        config={"write_empty_chunks": True},
    )
    arr[...] = data


def write_small(group: zarr.Group, name: str, data: np.ndarray) -> None:
    """A per-token or per-sample array kept as one chunk."""
    _array(group, name, data, data.shape or (1,))


def _transpose(a: np.ndarray) -> np.ndarray:
    out = np.empty(a.shape[::-1], dtype=a.dtype)
    rows = max(1, SLAB_BYTES // (a.shape[1] * a.itemsize))
    for start in range(0, a.shape[0], rows):
        out[:, start:start + rows] = a[start:start + rows].T
    return out


def write_states(group: zarr.Group, codec: str, bits: np.ndarray, num_layers: int) -> None:
    """`bits`: the bf16 states [T, K*D] as uint16."""
    tokens, width = bits.shape
    channel_major, token_major = chunk_shapes(tokens, width)
    if codec == "lossless":
        _array(group, "hidden_hi", _transpose((bits >> 8).astype(np.uint8)), channel_major)
        _array(group, "hidden_lo", bits.astype(np.uint8), token_major, compress=False)
    elif codec == "fp8":
        per_layer = torch.from_numpy((bits.astype(np.uint32) << 16).view(np.float32)).view(tokens, num_layers, -1)
        amax = per_layer.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        q = (per_layer * (FP8_MAX / amax)).to(torch.float8_e4m3fn).view(torch.uint8).view(tokens, width)
        scales = amax / FP8_MAX
        _array(group, "hidden_fp8", _transpose(q.numpy()), channel_major)
        _array(group, "scales", scales.view(tokens, num_layers).numpy(), (tokens, num_layers))
    else:
        _array(group, "hidden", bits, token_major, compress=False)


def state_arrays(codec: str) -> tuple[str, ...]:
    return {"lossless": ("hidden_hi", "hidden_lo"), "fp8": ("hidden_fp8", "scales"), "none": ("hidden",)}[codec]


def read_states(arrays: dict[str, np.ndarray], codec: str, num_layers: int) -> torch.Tensor:
    """bf16 [T, K*D], a view of one freshly decoded buffer."""
    if codec == "lossless":
        lo = arrays["hidden_lo"]
        bits = _transpose(arrays["hidden_hi"]).astype(np.uint16) << 8
        bits |= lo
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    if codec == "fp8":
        q = torch.from_numpy(_transpose(arrays["hidden_fp8"]))
        q = q.view(torch.float8_e4m3fn)
        scales = torch.from_numpy(arrays["scales"])
        tokens, width = q.shape
        deq = q.float().view(tokens, num_layers, -1) * scales.unsqueeze(-1)
        return deq.to(torch.bfloat16).view(tokens, width)
    return torch.from_numpy(arrays["hidden"]).view(torch.bfloat16)


UNCOMPRESSED_BYTES_PER_VALUE = {"lossless": 1, "fp8": 0, "none": 2}
"""Bytes per state value kept without compression, so zarr's zero padding of the last chunk is real."""


def encoded_bound(raw_bytes: int, chunks: int) -> int:
    """Largest on-disk payload for `raw_bytes` of arrays in `chunks` chunks (zstd's bound plus the checksum)."""
    return raw_bytes + raw_bytes // 128 + chunks * (64 + 4)
