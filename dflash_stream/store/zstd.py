"""zstd frames for the store's chunks, coded with libzstd's advanced parameters.

numcodecs (what zarr uses) exposes only the compression level, and every level it offers spends most of its
time searching for matches in byte planes that hold few: on hidden-state planes the gain is in the entropy
stage (Huffman-coded literals). A negative level with literal compression forced on keeps that stage and drops
most of the match search: measured on SmolLM2 states, the high byte plane codes ~2.5x faster than at level 1
for ~12 % more bytes on that plane (~3.5 % on the whole segment). The frames are plain zstd frames: numcodecs,
zarr and any zstd decoder read them. Where no libzstd with the advanced API can be found, numcodecs' level 1
writes the frames instead (same format, slower).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import numpy as np
from numcodecs import Zstd

FAST = -1000
"""zstd's fastest match search: the ratio on the byte planes comes from the Huffman stage."""
LEVEL = 1
"""The usual fast level, for arrays whose matches are worth their search (fp8 codes, token ids)."""
_C_COMPRESSION_LEVEL = 100  # ZSTD_c_compressionLevel
_C_LITERAL_COMPRESSION_MODE = 1002  # ZSTD_c_literalCompressionMode (experimental parameter 5 of zstd 1.4-1.5)
_PS_ENABLE = 1  # ZSTD_ps_enable: Huffman-code literals even at negative levels, which turn it off by default
_FALLBACK = Zstd(level=1)
DECODER = Zstd()
"""numcodecs' decoder: it releases the GIL and decodes into a given buffer."""


def _load() -> ctypes.CDLL | None:
    """libzstd with its advanced API: the copy numcodecs links in (already loaded), else the system's."""
    import numcodecs.zstd

    for path in (numcodecs.zstd.__file__, ctypes.util.find_library("zstd")):
        if not path:
            continue
        try:
            lib = ctypes.CDLL(path)
            lib.ZSTD_compress2.restype = ctypes.c_size_t
        except (OSError, AttributeError):
            continue
        lib.ZSTD_compress2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                       ctypes.c_size_t]
        lib.ZSTD_createCCtx.restype = ctypes.c_void_p
        lib.ZSTD_CCtx_setParameter.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.ZSTD_CCtx_setParameter.restype = ctypes.c_size_t
        lib.ZSTD_compressBound.argtypes = [ctypes.c_size_t]
        lib.ZSTD_compressBound.restype = ctypes.c_size_t
        lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
        lib.ZSTD_isError.restype = ctypes.c_uint
        lib.ZSTD_getErrorName.argtypes = [ctypes.c_size_t]
        lib.ZSTD_getErrorName.restype = ctypes.c_char_p
        return lib
    return None


class _Contexts:
    """Compression contexts shared by all threads, per level: a context serves one call at a time, and the
    store's thread pools come and go, so contexts are handed out and returned rather than kept per thread."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib, self._free, self._lock = lib, {}, threading.Lock()

    def new(self, level: int) -> int:
        cctx = self.lib.ZSTD_createCCtx()
        for param, value in ((_C_COMPRESSION_LEVEL, level), (_C_LITERAL_COMPRESSION_MODE, _PS_ENABLE)):
            err = self.lib.ZSTD_CCtx_setParameter(cctx, param, value)
            if self.lib.ZSTD_isError(err):
                raise OSError(self.lib.ZSTD_getErrorName(err).decode())
        return cctx

    def take(self, level: int) -> int:
        with self._lock:
            free = self._free.setdefault(level, [])
            return free.pop() if free else self.new(level)

    def give(self, level: int, cctx: int) -> None:
        with self._lock:
            self._free.setdefault(level, []).append(cctx)


def _contexts() -> _Contexts | None:
    lib = _load()
    if lib is None:
        return None
    contexts = _Contexts(lib)
    try:
        contexts.give(FAST, contexts.new(FAST))  # a libzstd without the parameter refuses it here
    except OSError:
        return None
    return contexts


_CONTEXTS = _contexts()
ENGINE = "libzstd advanced API" if _CONTEXTS else "numcodecs (level 1 for every array)"


def compress(data: np.ndarray, tail: int, level: int) -> tuple[np.ndarray, int]:
    """(buffer, n): the zstd frame of `data` (C-contiguous) at `level` (negative ones with Huffman-coded
    literals) in buffer[:n], with `tail` spare bytes after it (for the checksum, so the chunk file is written
    straight from this buffer)."""
    if _CONTEXTS is None:
        frame = _FALLBACK.encode(data)
        out = np.empty(len(frame) + tail, dtype=np.uint8)
        out[:len(frame)] = np.frombuffer(frame, dtype=np.uint8)
        return out, len(frame)
    lib = _CONTEXTS.lib
    bound = lib.ZSTD_compressBound(data.nbytes)
    out = np.empty(bound + tail, dtype=np.uint8)
    cctx = _CONTEXTS.take(level)
    try:
        n = lib.ZSTD_compress2(cctx, out.ctypes.data, bound, data.ctypes.data, data.nbytes)  # releases the GIL
    finally:
        _CONTEXTS.give(level, cctx)
    if lib.ZSTD_isError(n):
        raise RuntimeError(f"zstd: {lib.ZSTD_getErrorName(n).decode()}")
    return out, n
