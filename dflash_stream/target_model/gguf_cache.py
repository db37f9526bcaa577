"""A GGUF target converted once into a folder of safetensors, which later loads read instead of the GGUF file.

transformers dequantizes a GGUF file on every load and parses its whole header (the vocabulary too) for the
tokenizer and again for the config: ~20 s per process for the demo's 135M target, paid by every extractor, trainer,
evaluation and server start. The first full load saves what it loaded (the dequantized weights in the dtype it
loaded them in, the tokenizer, the config) as a plain folder; later loads read that, the same tensors and tokens,
in well under a second. vLLM and `transformers serve`, which cannot load GGUF, are given the same folder.

The folders live under $DFLASH_STREAM_CACHE (default ~/.cache/dflash-stream), in `gguf/`. One is current while its
GGUF file has the size and modification time it was converted from, under the same transformers version; a newer
conversion replaces it, and removes those whose GGUF file is gone or changed (a deleted checkout's). A conversion
is written only where it takes at most a tenth of the free space, so a large GGUF target never fills the disk a
run's store budget counts on; without one, loads read the GGUF file as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from dflash_stream.config import ConfigError
from dflash_stream.log import get_logger

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

STAMP = "converted-from.json"
ROOM_SHARE = 0.1
"""The most of the cache's free space one conversion may take."""

log = get_logger(__name__)


def cache_root() -> Path:
    """Where the conversions live: $DFLASH_STREAM_CACHE/gguf, by default ~/.cache/dflash-stream/gguf."""
    return Path(os.environ.get("DFLASH_STREAM_CACHE") or Path.home() / ".cache" / "dflash-stream") / "gguf"


def _stamp(source: Path) -> dict[str, Any]:
    import transformers

    stat = source.stat()
    return {"gguf": str(source), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "transformers": transformers.__version__}


def _prefix(source: Path) -> str:
    """The folder name up to the dtype: one GGUF file's conversions."""
    return f"{source.stem}-{hashlib.sha1(str(source).encode()).hexdigest()[:10]}-"


def _folder(source: Path, dtype: torch.dtype) -> Path:
    return cache_root() / (_prefix(source) + str(dtype).removeprefix("torch."))


def _current(folder: Path, stamp: dict[str, Any]) -> bool:
    try:
        return json.loads((folder / STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def converted(source: Path, dtype: torch.dtype | None = None) -> Path | None:
    """The current conversion of the GGUF file `source` in `dtype` (any dtype when None: the tokenizer and the
    config are the same in all), or None."""
    stamp = _stamp(source)
    if dtype is not None:
        folder = _folder(source, dtype)
        return folder if _current(folder, stamp) else None
    prefix = _prefix(source)
    folders = sorted(cache_root().iterdir()) if cache_root().is_dir() else []
    # A dtype's name has no dot: an unfinished conversion's (`.partial-…`) does.
    return next((f for f in folders if f.name.startswith(prefix) and "." not in f.name.removeprefix(prefix)
                 and _current(f, stamp)), None)


def save_converted(source: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                   required: bool = False) -> Path | None:
    """Save `model` and `tokenizer`, just loaded from the GGUF file `source`, as its conversion in the model's
    dtype; the folder, or None when there is no room for it or it cannot be written (ConfigError instead when
    `required`: servers need it)."""
    folder = _folder(source, model.dtype)
    stamp = _stamp(source)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(folder.parent)
        free = shutil.disk_usage(folder.parent).free
    except OSError as err:
        return _without(f"cannot write the conversion of {source.name} to {folder.parent}: {err}", required)
    need = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    if not _has_room(need, free):
        return _without(f"the conversion of {source.name} to safetensors needs {need / 2**30:.1f} GiB, more than a "
                        f"tenth of the {free / 2**30:.1f} GiB free at {folder.parent}", required)
    log.info("converting the GGUF target %s to safetensors in %s: later loads and servers read that", source.name,
             folder)
    # transformers refuses to save a model it loaded from GGUF ("not serializable") although its weights are
    # already dequantized tensors: without the quantizer's mark they save as plain ones.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = folder.with_name(f"{folder.name}.partial-{socket.gethostname()}-{os.getpid()}")
    try:
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        (partial / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        if not _current(folder, stamp):  # else another process converted it meanwhile, as well
            shutil.rmtree(folder, ignore_errors=True)  # a stale conversion
            partial.rename(folder)  # a conversion cut short is never taken for a finished one
    except (OSError, RuntimeError, ValueError) as err:  # a cache: its failure costs the next load its speed only
        if not _current(folder, stamp):  # else another process's rename won the race: its folder is as good
            return _without(f"cannot write the conversion of {source.name} to {folder}: {err}", required)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def _has_room(need: int, free: int) -> bool:
    return need <= ROOM_SHARE * free


def planned(source: Path, dtype: torch.dtype, weight_bytes: int, free: int) -> dict[str, Any]:
    """What the run's first load of `source` in `dtype` leaves in the cache (`free` bytes free there), for `plan`:
    the folder, its size (on disk when it is there, else the weights' `weight_bytes`) and `state`: `present`,
    `written` or `skipped` (no room: loads read the GGUF file)."""
    folder = _folder(source, dtype)
    if _current(folder, _stamp(source)):
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        return {"path": str(folder), "bytes": size, "state": "present"}
    return {"path": str(folder), "bytes": weight_bytes, "free_bytes": free,
            "state": "written" if _has_room(weight_bytes, free) else "skipped"}


def _without(why: str, required: bool) -> None:
    """No conversion: a server cannot do without one (ConfigError); a load reads the GGUF file instead."""
    if required:
        raise ConfigError(f"target.gguf_file: {why}; set DFLASH_STREAM_CACHE to a folder with room")
    log.warning("%s: loads read the GGUF file (~20 s for the demo's), DFLASH_STREAM_CACHE elsewhere spares it", why)
    return None


def _remove_stale(root: Path) -> None:
    """Conversions no load will take again (their GGUF file is gone or changed: a deleted checkout's, an older
    download's), and the unfinished ones a killed process of this host left (a shared cache may hold other hosts')."""
    mine = f".partial-{socket.gethostname()}-"
    for folder in root.iterdir():
        if mine in folder.name:
            pid = folder.name.rsplit("-", 1)[1]
            if pid.isdigit() and not psutil.pid_exists(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)
        elif ".partial-" not in folder.name:
            try:
                stamp = json.loads((folder / STAMP).read_text())
                source = Path(stamp["gguf"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not a conversion of ours
            try:
                stat = source.stat()
                stale = (stamp.get("bytes"), stamp.get("mtime_ns")) != (stat.st_size, stat.st_mtime_ns)
            except FileNotFoundError:
                stale = True
            if stale:
                shutil.rmtree(folder, ignore_errors=True)

