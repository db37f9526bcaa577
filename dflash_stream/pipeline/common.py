"""What every role needs to agree on before touching the store: its fingerprint, its worst-case segment, and the
order in which an extraction pass (the target's or a kept store's replay) writes the samples; and how either pass
stays, after its data, for the work a trainer sends back."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from dflash_stream.config import Config, dump_config
from dflash_stream.data.spec import data_spec, data_spec_digest
from dflash_stream.log import get_logger
from dflash_stream.rundir import RunDir, write_atomic

if TYPE_CHECKING:
    from dflash_stream.store import Store

log = get_logger(__name__)


def save_resolved_config(cfg: Config) -> None:
    """OUTPUT/config.yaml: the config as this run resolved it (read back by `audit`, `status` and `plan`)."""
    run = RunDir(cfg.output_dir)
    run.root.mkdir(parents=True, exist_ok=True)
    write_atomic(run.config, dump_config(cfg))


def check_host_memory(cfg: Config, extractors: int, world: int, rank: int, single: bool = False) -> None:
    """The first process of each machine warns when the processes of this launch on it may hold more hidden states
    (and trainer 0's checkpoint snapshot) in RAM than the machine has available (sizing.host_memory). Ranks
    0..`extractors`-1 of the launch extract and the others train; `single`: one process plays both roles."""
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return
    from dflash_stream.sizing.host_memory import check_machine, run_host_memory
    from dflash_stream.target_model import target_shape

    host = run_host_memory(cfg, target_shape(cfg.target, download=True, hints=False, count=False))
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    warning = check_machine(host, extractors, world, per_machine, rank // per_machine, single)
    if warning:
        log.warning("host memory: %s", warning)


def _source_text(source: dict[str, Any]) -> str:
    """One source as a user wrote it: its path and the keys that differ from their defaults."""
    defaults = {"subset": None, "split": "train", "format": "auto", "limit": None, "weight": 1.0, "name": None}
    extra = [f"{k}={v}" for k, v in source.items() if k != "path" and defaults.get(k) != v]
    return " ".join([source["path"], *extra])


def data_spec_detail(cfg: Config) -> dict[str, Any]:
    """The data spec in readable form, so that a store made from other data can say what differs."""
    spec = data_spec(cfg)
    return {**spec, "sources": [_source_text(s) for s in spec["sources"]]}


def store_layout(cfg: Config) -> tuple[list[int], int]:
    """(layer ids, hidden size) of the states this run stores, from the target's config alone: the drafter's
    layers, then the verifier's last layer when the run stores it (`target_model.stored_layer_ids`)."""
    from dflash_stream.target_model import stored_layer_ids, target_shape

    shape = target_shape(cfg.target, download=True, hints=False, count=False)
    return stored_layer_ids(shape.num_layers, cfg.target, cfg.verifier_states), shape.hidden_size


def store_fingerprint(cfg: Config, layer_ids: list[int], hidden_size: int) -> dict[str, Any]:
    """What produced a store; reopening it with any field different is refused. `layer_ids` are the stored ones
    (`store_layout`); with the verifier's state the last of them is it, which `verifier_layer` records (absent
    without: stores made before it reopen unchanged)."""
    target = f"{cfg.target.model}{'/' + cfg.target.gguf_file if cfg.target.gguf_file else ''}"
    verifier = {"verifier_layer": layer_ids[-1]} if cfg.verifier_states else {}
    return {
        "target": target,
        "layer_ids": list(layer_ids),
        "hidden_size": hidden_size,
        "max_length": cfg.data.max_length,
        # The tokenizer always comes with the target; its revision pins it.
        "tokenizer": f"{target}@{cfg.target.revision or 'default'}",
        "codec": cfg.store.codec,
        "data_spec": data_spec_digest(cfg),
        "data_spec_detail": data_spec_detail(cfg),  # words for a mismatch; compared only through data_spec
        # States computed by vLLM servers differ from the extractor's own in the last bf16 bit: one store holds
        # one engine's (absent for engine hf, as in the stores made before vLLM extraction existed).
        **({"extract_engine": "vllm"} if cfg.extract.engine == "vllm" else {}),
        **verifier,
    }


def max_segment_raw_bytes(cfg: Config, num_layers_captured: int, hidden_size: int) -> int:
    """A segment is filled to `store.segment_bytes`, but one sample of `max_length` tokens may exceed that."""
    from dflash_stream.store import sizes

    return sizes.max_segment_raw_bytes(int(cfg.store.segment_bytes), cfg.data.max_length,
                                       num_layers_captured * hidden_size)


def open_store(cfg: Config, layer_ids: list[int], hidden_size: int, create: bool = True):
    """Open (or create) the run's store with its fingerprint and budget checks."""
    from dflash_stream.store import Store

    return Store.open(
        cfg.store.path,
        budget=int(cfg.store.budget),
        codec=cfg.store.codec,
        reuse=cfg.store.reuse,
        fingerprint=store_fingerprint(cfg, layer_ids, hidden_size),
        max_segment_raw_bytes=max_segment_raw_bytes(cfg, len(layer_ids), hidden_size),
        create=create,
        keep_free=int(cfg.store.keep_free),
    )


def log_store_event(metrics, store, **fields: Any) -> None:
    """A `store` metrics event: the buffer's fill as the store itself accounts it (for status, report, peak)."""
    st = store.status()
    metrics.log(
        "store", used_bytes=st["used_bytes"], reserved_bytes=st["reserved_bytes"], budget_bytes=st["budget_bytes"],
        ready=st["segments"]["ready"], claimed=st["segments"]["claimed"],
        segments_released=st["segments"]["released"], **fields,
    )


def pass_order(items: list, seed: int, pass_index: int) -> list:
    """The order of a pass: the data's own for the first, a fresh seeded shuffle for each later one (so that
    extracting every epoch anew, `train.epoch_source: reextract`, reshuffles the whole data every epoch). The same
    for every run of the same config, so a resumed pass extracts what it lacks in the same order."""
    if pass_index == 0:
        return list(items)
    return [items[i] for i in np.random.default_rng([seed, pass_index]).permutation(len(items))]


REDO_POLL_S = 0.2
"""How often an extraction pass that has finished its data looks for work sent back, and for the end of training:
the launch's summary waits for this rank to leave, so a long poll costs every launch its length at the end."""


def stay_for_redo(store: Store, redo: Callable[[], int], training_over: Callable[[], bool],
                  staying: str | None = None) -> None:
    """After an extraction pass's data: run `redo` (extract again what a trainer quarantined or a crash rolled back;
    the count it did) until the store is drained or `training_over()` (a trainer that stops at train.max_steps
    leaves segments unconsumed). `staying`: a line to log once, if the pass does stay."""
    while not (store.drained() or training_over()):
        if staying:
            log.info("%s", staying)
            staying = None
        if not redo():
            time.sleep(REDO_POLL_S)
