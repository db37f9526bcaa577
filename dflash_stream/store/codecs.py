"""How hidden states become a segment's zarr v3 arrays, one `Codec` per `store.codec`, and how one chunk
becomes bytes.

A codec is one object in `REGISTRY`: the arrays it stores (`specs`), `encode`, `decode`, its worst-case size
(`stored_bound`) and its design ratio (what `plan` assumes until `tune` measures this target). Adding a codec
is one class here and one `register` call: the config, the store, `plan` and `bench store` take it from the
registry.

Every array is chunked along its first axis only, so each chunk is a contiguous slab of the array, and each
chunk is stored as zarr's `zstd` then `crc32c` codecs would store it (or `crc32c` alone): zarr-python reads a
segment as it is, while the store encodes and decodes the chunks itself, in parallel, straight between the
states and the chunk files (zarr's codec pipeline costs more than the compression).

- `lossless`: bf16 split into its two byte planes, both layer-major [K*T, D], so that one Huffman table per
  zstd block sees one layer's narrow range of exponents (measured 1.46x against 1.42x token-major). Each chunk
  coder takes its slab of a plane straight from the samples' token-major states (`LayerRows`): the segment is
  never gathered into one buffer first. The high plane (sign, exponent, top mantissa bit) is
  zstd-coded with Huffman literals and almost no match search (see `zstd.py`); the low plane (low mantissa
  bits) is near-random, so it is stored as is. Bit-exact.
- `fp8`: from each channel the segment's mean is subtracted (hidden states carry large per-channel offsets);
  of what is left, each token and layer keeps its largest value exactly ("peak": channel and bf16 bits) and
  the rest becomes e4m3 scaled by its own maximum, stored channel-major and zstd-coded. Measured on SmolLM2:
  0.60 % relative error at 2.48x, where one plain scale per token and layer gives 0.80 % at 2.51x.
- `none`: the raw uint16 view, for comparison.

torch is imported only where a codec runs, so that `config` and `plan` can name the codecs without it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import google_crc32c
import numpy as np

from dflash_stream.store import zstd
from dflash_stream.store.profile import stage

if TYPE_CHECKING:
    import torch

PLANE_CHUNK_BYTES = 2 << 20
"""Bytes per chunk: zstd gains nothing from more, and a segment gives each core several chunks to code."""
FP8_MAX = 448.0  # largest finite float8_e4m3fn
CHECKSUM_BYTES = 4
MERGE_ROWS = 1024
"""Plane rows the lossless decode merges at a time: their uint16 words (1.2 MB at D = 576) stay in cache
between the merge's passes."""

Mapper = Callable[[Callable, Iterable], Iterable]
"""`map`, or a thread pool's `map`: how a codec runs its independent pieces."""
ChunkReader = Callable[[str, int, np.ndarray], None]
"""read(array, i, out): check and decode chunk i of `array` into `out`, a C-contiguous array shaped as that
chunk's rows of the array (fewer for the last chunk)."""


@dataclass(frozen=True)
class ArraySpec:
    """One array of a segment, chunked along its first axis `rows` at a time."""

    shape: tuple[int, ...]
    rows: int
    dtype: str
    compress: bool = True
    level: int = zstd.LEVEL

    @property
    def chunks(self) -> tuple[int, ...]:
        return (self.rows, *self.shape[1:])

    @property
    def num_chunks(self) -> int:
        return -(-self.shape[0] // self.rows)

    def stored_bound(self) -> int:
        """Most bytes its chunk files hold: zarr pads the last chunk to full size, zstd's worst case adds a
        little, every chunk carries a checksum."""
        padded = self.num_chunks * math.prod(self.chunks) * np.dtype(self.dtype).itemsize
        coded = padded + padded // 128 + 64 * self.num_chunks if self.compress else padded
        return coded + CHECKSUM_BYTES * self.num_chunks


def small_spec(shape: tuple[int, ...], dtype: str) -> ArraySpec:
    """A per-token, per-sample or per-channel array kept as one chunk."""
    return ArraySpec(shape, max(1, shape[0]), dtype)


def plane_rows(length: int, row_bytes: int) -> int:
    """Rows per chunk: near PLANE_CHUNK_BYTES and as even as possible, as the last chunk is stored padded."""
    pieces = max(1, -(-length * row_bytes // PLANE_CHUNK_BYTES))
    return max(1, -(-length // pieces))


class Codec:
    """How the bf16 states [T, K*D] of a segment are stored. Subclasses set `name`, `design_ratio`, `exact`."""

    name: str
    design_ratio: float
    """On-disk size of raw bf16 states over stored size, measured on SmolLM2-135M states: what `plan`
    assumes until `tune` measures this target."""
    exact: bool
    design_encode_bytes_per_core_s: float
    design_decode_bytes_per_core_s: float
    """Raw bytes per CPU-second (all threads) to encode + checksum + write a segment, and to read + check +
    decode one, measured on SmolLM2 states (see `design_rate_note`): what `plan` sizes the store's cores by
    until `tune` measures this target."""
    design_rate_note = "bench store per-core figure (median of 4 runs), SmolLM2 states on a 2-core AMD EPYC VM"

    layer_rows = False
    """`encode` takes the states as `LayerRows` (not gathered) rather than one gathered array [T, K*D]."""

    def specs(self, tokens: int, width: int, num_layers: int) -> dict[str, ArraySpec]:
        raise NotImplementedError

    def encode(self, bits: np.ndarray | LayerRows, num_layers: int) -> dict[str, np.ndarray | BytePlane]:
        """The arrays' contents, shaped as in `specs` and cast to their dtype as C casts (or `BytePlane`s).
        Views where possible: the chunk coders copy each slab out in their own threads. `bits`: the bf16 states
        as little-endian uint16, C-contiguous [T, K*D], or `LayerRows` where `layer_rows`."""
        raise NotImplementedError

    def decode(self, arrays: dict[str, np.ndarray], num_layers: int, map_fn: Mapper = map) -> torch.Tensor:
        """bf16 [T, K*D], a view of one freshly decoded buffer. `map_fn` may run independent pieces in
        parallel (codecs that have none ignore it)."""
        raise NotImplementedError

    def decode_chunks(self, read: ChunkReader, specs: dict[str, ArraySpec], num_layers: int,
                      map_fn: Mapper = map) -> torch.Tensor:
        """`decode` of the arrays whose layouts are `specs`, read chunk by chunk with `read`. Here: each
        array whole, then `decode`; a codec may decode each chunk as it is read, while it is in cache."""
        arrays = {name: np.empty(spec.shape, dtype=np.dtype(spec.dtype).newbyteorder("<"))
                  for name, spec in specs.items()}

        def chunk(job: tuple[str, int]) -> None:
            name, i = job
            rows = specs[name].rows
            read(name, i, arrays[name][i * rows:(i + 1) * rows])

        list(map_fn(chunk, [(name, i) for name, spec in specs.items() for i in range(spec.num_chunks)]))
        return self.decode(arrays, num_layers, map_fn)

    def arrays(self) -> tuple[str, ...]:
        return tuple(self.specs(1, 1, 1))

    def stored_bound(self, tokens: int, width: int, num_layers: int) -> int:
        """Most bytes the state arrays' chunk files can hold."""
        return sum(spec.stored_bound() for spec in self.specs(tokens, width, num_layers).values())


REGISTRY: dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    REGISTRY[codec.name] = codec
    return codec


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def get(name: str) -> Codec:
    """The codec called `name`; KeyError names the allowed ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown store codec '{name}'; allowed: {', '.join(REGISTRY)}") from None


def _as_bf16(bits: np.ndarray) -> torch.Tensor:
    import torch

    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


class Lossless(Codec):
    name, design_ratio, exact, layer_rows = "lossless", 1.44, True, True
    # Below `bench store`'s per-core median (0.66 / 1.31 GB/s): what one writer and one reader sustained side
    # by side on two cores, `bench store --rate 0.45` (threads of both processes sharing the cores and caches).
    design_encode_bytes_per_core_s, design_decode_bytes_per_core_s = 0.49e9, 1.18e9
    design_rate_note = "bench store --rate: a writer beside a reader, SmolLM2 states on a 2-core AMD EPYC VM"

    def specs(self, tokens: int, width: int, num_layers: int) -> dict[str, ArraySpec]:
        rows, hidden = num_layers * tokens, width // num_layers
        return {"hidden_hi": ArraySpec((rows, hidden), plane_rows(rows, hidden), "uint8", level=zstd.FAST),
                "hidden_lo": ArraySpec((rows, hidden), plane_rows(rows, hidden), "uint8", compress=False)}

    def encode(self, bits: LayerRows, num_layers: int) -> dict[str, np.ndarray | BytePlane]:
        return {"hidden_hi": bits.plane(high=True), "hidden_lo": bits.plane(high=False)}

    def decode(self, arrays: dict[str, np.ndarray], num_layers: int, map_fn: Mapper = map) -> torch.Tensor:
        hi, lo = arrays["hidden_hi"], arrays["hidden_lo"]
        tokens = len(lo) // num_layers
        bits = np.empty((tokens, num_layers, lo.shape[1]), dtype="<u2")
        list(map_fn(lambda first: _merge(bits, hi[first:first + MERGE_ROWS], lo[first:first + MERGE_ROWS], first),
                    range(0, len(lo), MERGE_ROWS)))
        return _as_bf16(bits.reshape(tokens, -1))

    def decode_chunks(self, read: ChunkReader, specs: dict[str, ArraySpec], num_layers: int,
                      map_fn: Mapper = map) -> torch.Tensor:
        # Both planes of a chunk are read and merged in one task, while they are in cache (the planes of a
        # whole segment are not), into buffers the size of a chunk rather than of the segment.
        hi_spec, lo_spec = specs["hidden_hi"], specs["hidden_lo"]
        if hi_spec.rows != lo_spec.rows:  # not a layout this store writes, but a readable one
            return super().decode_chunks(read, specs, num_layers, map_fn)
        (length, hidden), rows = hi_spec.shape, hi_spec.rows
        bits = np.empty((length // num_layers, num_layers, hidden), dtype="<u2")

        def chunk(i: int) -> None:
            n = min(rows, length - i * rows)
            hi, lo = np.empty((n, hidden), dtype=np.uint8), np.empty((n, hidden), dtype=np.uint8)
            read("hidden_hi", i, hi)
            read("hidden_lo", i, lo)
            for first in range(0, n, MERGE_ROWS):
                _merge(bits, hi[first:first + MERGE_ROWS], lo[first:first + MERGE_ROWS], i * rows + first)

        list(map_fn(chunk, range(hi_spec.num_chunks)))
        return _as_bf16(bits.reshape(len(bits), -1))


def _merge(bits: np.ndarray, hi: np.ndarray, lo: np.ndarray, first: int) -> None:
    """Rows first.. of the layer-major planes (uint8 [n, D] each) into `bits`, uint16 [T, K, D] token-major.

    The words (hi * 256 | lo) are built in a contiguous buffer and then copied to their tokens' rows (runs of
    D values, a cheap copy): over a whole buffer numpy's widening multiply and or run vectorised, while its
    strided byte writes into the interleaved output, or any step straight on the strided rows, cost about
    twice as much (and its uint16 shift 1.5 times the multiply)."""
    tokens = len(bits)
    with stage("plane merge"):
        words = np.empty(hi.shape, dtype="<u2")
        np.multiply(hi, 256, out=words, dtype=words.dtype)
        np.bitwise_or(words, lo, out=words)
        done = 0
        while done < len(words):  # the rows of each layer these rows hold
            layer, start = divmod(first + done, tokens)
            n = min(len(words) - done, tokens - start)
            bits[start:start + n, layer] = words[done:done + n]
            done += n


def _fp8_values() -> np.ndarray:
    """float32 value of every e4m3fn byte (bias 7, no infinities, 0x7F/0xFF NaN): a table lookup decodes
    several times faster than torch's conversion."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    value = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7))
    value[(b & 0x7F) == 0x7F] = np.nan
    return (sign * value).astype(np.float32)


class Fp8(Codec):
    name, design_ratio, exact = "fp8", 2.4, False
    design_encode_bytes_per_core_s, design_decode_bytes_per_core_s = 0.22e9, 0.39e9
    VALUES = _fp8_values()

    def specs(self, tokens: int, width: int, num_layers: int) -> dict[str, ArraySpec]:
        return {
            "hidden_fp8": ArraySpec((width, tokens), plane_rows(width, tokens), "uint8"),
            "scales": small_spec((tokens, num_layers), "float32"),
            "peaks": small_spec((tokens, num_layers, 2), "uint16"),
            "channel_mean": small_spec((width,), "float32"),
        }

    def encode(self, bits: np.ndarray, num_layers: int) -> dict[str, np.ndarray]:
        import torch

        # numpy, not torch: its reductions over the last axis are several times faster on CPU.
        tokens, width = bits.shape
        x = (bits.astype(np.uint32) << 16).view(np.float32).reshape(tokens, num_layers, -1)  # bf16 = top of f32
        mean = x.mean(0)
        rest = np.subtract(x, mean, out=x)
        size = np.abs(rest)
        peak = size.argmax(-1)[..., None]
        np.put_along_axis(rest, peak, 0.0, -1)
        np.put_along_axis(size, peak, 0.0, -1)
        scales = np.maximum(size.max(-1, keepdims=True), np.finfo(np.float32).tiny) / np.float32(FP8_MAX)
        q = torch.from_numpy(rest / scales).to(torch.float8_e4m3fn).view(torch.uint8).view(tokens, width)
        peak_bits = np.take_along_axis(bits.reshape(tokens, num_layers, -1), peak, -1)
        return {
            "hidden_fp8": q.t().contiguous().numpy(),  # torch transposes bytes several times faster than numpy
            "scales": scales.reshape(tokens, num_layers),
            "peaks": np.concatenate([peak.astype(np.uint16), peak_bits], -1),
            "channel_mean": mean.reshape(width),
        }

    def decode(self, arrays: dict[str, np.ndarray], num_layers: int, map_fn: Mapper = map) -> torch.Tensor:
        import torch

        width, tokens = arrays["hidden_fp8"].shape
        q = torch.from_numpy(arrays["hidden_fp8"]).t().contiguous().numpy()
        x = self.VALUES[q].reshape(tokens, num_layers, -1)
        x *= arrays["scales"][..., None]
        x += arrays["channel_mean"].reshape(num_layers, -1)
        states = torch.from_numpy(x).to(torch.bfloat16)
        channel, value = np.split(arrays["peaks"], 2, axis=-1)
        states.view(torch.int16).scatter_(-1, torch.from_numpy(channel.astype(np.int64)),
                                          torch.from_numpy(np.ascontiguousarray(value).view(np.int16)))
        return states.view(tokens, width)


class Raw(Codec):
    name, design_ratio, exact = "none", 1.0, True
    # bench store's `none` row: CPU milliseconds per MB of a whole write (0.85) and read (0.25), both threads.
    design_encode_bytes_per_core_s, design_decode_bytes_per_core_s = 1.2e9, 3.9e9
    design_rate_note = "bench store CPU time of the `none` codec, SmolLM2 states on a 2-core AMD EPYC VM"

    def specs(self, tokens: int, width: int, num_layers: int) -> dict[str, ArraySpec]:
        return {"hidden": ArraySpec((tokens, width), plane_rows(tokens, 2 * width), "uint16", compress=False)}

    def encode(self, bits: np.ndarray, num_layers: int) -> dict[str, np.ndarray]:
        return {"hidden": bits}

    def decode(self, arrays: dict[str, np.ndarray], num_layers: int, map_fn: Mapper = map) -> torch.Tensor:
        return _as_bf16(arrays["hidden"])


register(Lossless())
register(Fp8())
register(Raw())


# ---- chunks ---------------------------------------------------------------------------------------------------
SPLIT_BLOCK_BYTES = 256 << 10
"""Words the plane split copies at a time: they stay in a core's cache for both planes' passes."""


class NonFinite(ValueError):
    """The states hold NaN or Inf."""


def non_finite(words: np.ndarray) -> bool:
    """Whether bf16 values given as uint16 words hold NaN or Inf: the words whose exponent bits are all ones,
    0x7F80.. as int16 and 0xFF80.. unsigned (two max reductions, no temporary)."""
    return bool(words.max() >= 0xFF80 or words.view(np.int16).max() >= 0x7F80)


@dataclass(frozen=True)
class LayerRows:
    """The states of a segment's samples as layer-major rows [K*T, D] (row k*T + t: layer k of token t) of
    uint16 words, without gathering them: slicing is lazy, and `split_to` fills a chunk's planes straight from
    the samples' token-major states."""

    samples: tuple[np.ndarray, ...]
    """Per sample its states as uint16 [T_i, K, D] (any strides)."""
    starts: tuple[int, ...]
    """The first token of each sample in the segment, and the segment's token count last."""
    rows: range

    @classmethod
    def of(cls, samples: list[np.ndarray], num_layers: int) -> LayerRows:
        starts = tuple(np.concatenate([[0], np.cumsum([len(s) for s in samples])]).tolist())
        parts = tuple(s.reshape(len(s), num_layers, -1) for s in samples)
        return cls(parts, starts, range(num_layers * starts[-1]))

    def plane(self, high: bool) -> BytePlane:
        return BytePlane(self, high)

    def __getitem__(self, rows: slice) -> LayerRows:
        return LayerRows(self.samples, self.starts, self.rows[rows])

    def __len__(self) -> int:
        return len(self.rows)

    def split_to(self, high: np.ndarray | None, low: np.ndarray | None) -> None:
        """The high and the low bytes of these rows into `high` and `low` (uint8 [n, D], either may be None),
        reading each block of rows from the samples once: a copy into a buffer that stays in cache, then a
        shift and a cast from there (either straight from the strided states costs twice as much). Raises
        NonFinite if the rows hold NaN or Inf."""
        tokens, done, row = self.starts[-1], 0, self.rows.start
        width = self.samples[0].shape[-1]
        block = np.empty((max(1, SPLIT_BLOCK_BYTES // (2 * width)), width), dtype=np.uint16)
        while row < self.rows.stop:
            layer, token = divmod(row, tokens)
            i = bisect.bisect_right(self.starts, token) - 1
            n = min(self.rows.stop - row, self.starts[i + 1] - token)
            source = self.samples[i][token - self.starts[i]:token - self.starts[i] + n, layer]
            for first in range(0, n, len(block)):
                words = block[:min(len(block), n - first)]
                out = slice(done + first, done + first + len(words))
                np.copyto(words, source[first:first + len(words)])
                if non_finite(words):
                    raise NonFinite("NaN or Inf")
                if low is not None:
                    np.copyto(low[out], words, casting="unsafe")
                np.right_shift(words, 8, out=words)
                if high is not None:
                    np.copyto(high[out], words, casting="unsafe")
            done, row = done + n, row + n


@dataclass(frozen=True)
class BytePlane:
    """The high or the low bytes of some `LayerRows`, as an array's content: sliced as the array is."""

    rows: LayerRows
    high: bool

    def __getitem__(self, rows: slice) -> BytePlane:
        return BytePlane(self.rows[rows], self.high)

    def __len__(self) -> int:
        return len(self.rows)


def encode_chunks(parts: list[tuple[np.ndarray | BytePlane, ArraySpec]]) -> list[memoryview]:
    """Chunk files' bytes, each from its chunk's slab of an array's content (any strides and integer type; a
    last slab may be short and is padded with zarr's fill value, zero). Byte planes of the same rows are split
    in one pass. The checksum is written into the coded buffer's tail, so the file is written from that buffer
    without another copy. Raises NonFinite where the states hold NaN or Inf."""
    chunks, planes = [], {}
    with stage("plane split"):  # the codec's views become each chunk's contiguous bytes
        for part, spec in parts:
            dtype = np.dtype(spec.dtype).newbyteorder("<")
            if (spec.compress and isinstance(part, np.ndarray) and part.dtype == dtype and len(part) == spec.rows
                    and part.flags.c_contiguous):
                chunks.append((part, None))
                continue
            # Stored as is, the chunk is copied straight into the buffer the file is written from.
            size = math.prod(spec.chunks) * dtype.itemsize
            buf = np.empty(size + (0 if spec.compress else CHECKSUM_BYTES), dtype=np.uint8)
            chunk = buf[:size].view(dtype).reshape(spec.chunks)
            if isinstance(part, BytePlane):
                planes.setdefault(part.rows.rows, [part.rows, None, None])[1 if part.high else 2] = chunk[:len(part)]
            else:
                np.copyto(chunk[: len(part)], part, casting="unsafe")
            chunk[len(part):] = 0
            chunks.append((chunk, buf))
        for rows, high, low in planes.values():
            rows.split_to(high, low)
    return [_code(chunk, buf, spec) for (chunk, buf), (_, spec) in zip(chunks, parts, strict=True)]


def _code(chunk: np.ndarray, buf: np.ndarray | None, spec: ArraySpec) -> memoryview:
    if spec.compress:
        with stage("zstd"):
            buf, n = zstd.compress(chunk, CHECKSUM_BYTES, spec.level)
    else:
        n = chunk.nbytes
    with stage("checksum"):
        buf[n:n + CHECKSUM_BYTES] = np.frombuffer(_checksum(buf[:n]), dtype=np.uint8)
    return memoryview(buf[:n + CHECKSUM_BYTES])


def _checksum(data) -> bytes:
    return google_crc32c.value(data).to_bytes(CHECKSUM_BYTES, "little")


def check_chunk(payload: np.ndarray, stored: bytes) -> None:
    """Raises ValueError unless `stored` is the checksum of `payload` (uint8)."""
    with stage("checksum"):
        if len(stored) != CHECKSUM_BYTES or _checksum(payload) != stored:
            raise ValueError("checksum mismatch")


def decode_chunk(data: np.ndarray, spec: ArraySpec, out: np.ndarray) -> None:
    """Check and decode a chunk file's bytes (uint8) into `out`, the chunk's contiguous slab of the array.
    Raises ValueError on any damage."""
    payload = data[:-CHECKSUM_BYTES]
    check_chunk(payload, data[-CHECKSUM_BYTES:].tobytes())
    dtype = np.dtype(spec.dtype).newbyteorder("<")
    size = math.prod(spec.chunks) * dtype.itemsize
    if len(out) == spec.rows and spec.compress:  # a full chunk decodes in place
        _decompress(payload, out.view(np.uint8).reshape(-1))
        return
    if spec.compress:
        chunk = np.empty(size, dtype=np.uint8)
        _decompress(payload, chunk)
    elif len(payload) == size:
        chunk = payload
    else:
        raise ValueError(f"{len(payload)} bytes where {size} were expected")
    out[...] = chunk.view(dtype).reshape(spec.chunks)[: len(out)]


def _decompress(payload: np.ndarray, out: np.ndarray) -> None:
    try:
        with stage("zstd"):
            zstd.DECODER.decode(payload, out=out)
    except RuntimeError as err:  # numcodecs reports damaged frames as RuntimeError
        raise ValueError(str(err)) from None
