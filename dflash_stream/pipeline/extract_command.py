"""The `extract` command: the extractor a config asks for, on every process of the launch.

Three kinds fill the store: the target's own forward in this process (`Extractor`), vLLM servers' forwards
(`ServedExtractor`, extract.engine vllm), or the replay of a kept store (`StoreReplay`, extract.from_store). This
module sits above all three, so none of them imports another to pick.
"""

from __future__ import annotations

import argparse

import torch

from dflash_stream.config import Config, load_config
from dflash_stream.log import get_logger, setup_logging
from dflash_stream.observe.metrics import MetricsWriter
from dflash_stream.pipeline.common import check_host_memory, open_store, save_resolved_config, store_layout
from dflash_stream.pipeline.extractor import Extractor
from dflash_stream.pipeline.guard import hold_output, stop_with_launcher
from dflash_stream.pipeline.replay import StoreReplay
from dflash_stream.pipeline.roles import RoleInfo, assign_uniform, leave_process_group
from dflash_stream.pipeline.served_extractor import ServedExtractor
from dflash_stream.preflight import check_run_paths
from dflash_stream.store import Store, lease
from dflash_stream.target_model import resolve_device

log = get_logger(__name__)


def make_extractor(cfg: Config, role: RoleInfo, store: Store, metrics: MetricsWriter, device: torch.device
                   ) -> Extractor | StoreReplay:
    """The target's extractor (its own forward, or vLLM servers' with extract.engine vllm), or the replay of a
    kept store when extract.from_store names one."""
    if cfg.extract.from_store:
        return StoreReplay(cfg, role, store, metrics)
    if cfg.extract.engine == "vllm":
        return ServedExtractor(cfg, role, store, metrics, device)
    return Extractor(cfg, role, store, metrics, device)


def extract_command(args: argparse.Namespace) -> int:
    stop_with_launcher()
    cfg = load_config(args.config, args.overrides)
    check_run_paths(cfg)  # before anything is written
    role = assign_uniform("extractor")
    setup_logging("extractor", role.index, show_bar=role.speaks_for_role)
    device = resolve_device(cfg.target)
    check_host_memory(cfg, role.world_size, role.world_size, role.global_rank)  # every process extracts
    layer_ids, hidden_size = store_layout(cfg)
    if role.index == 0:
        hold_output(cfg, ("extract",))
    store = open_store(cfg, layer_ids, hidden_size)
    if role.index == 0:
        store.set_expected_writers(role.count)
        save_resolved_config(cfg)
    metrics = MetricsWriter(cfg.output_dir, "extractor", role.index)
    metrics.log("start", config=cfg.model_dump(mode="json"))
    # From before the target loads: a trainer waiting on the store sees this extractor alive.
    with store.heartbeat(f"extractor-{role.index}"):
        extractor = make_extractor(cfg, role, store, metrics, device)
        extractor.run()
        # While a trainer runs beside this launch, stay to extract again any segment it finds damaged.
        extractor.serve_redo(lambda: not store.consumers_alive())
    summary = extractor.summary()
    metrics.log("end", summary=summary)
    metrics.close()
    lease.release_all()
    log.info("extracted %d samples, %d tokens in %.1f s (%.0f tok/s, %.1f s waiting on the store)",
             summary["samples"], summary["tokens"], summary["extract_seconds"], summary["tok_s"],
             summary["backpressure_seconds"])
    leave_process_group()
    return 0


def register(sub) -> None:
    parser = sub.add_parser("extract", help="extract hidden states into the store (every process of the launch)")
    parser.add_argument("--config", required=True, help="run config (YAML); --section.key=value overrides follow")
    parser.set_defaults(func=extract_command, overrides=[])
