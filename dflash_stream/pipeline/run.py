"""`dflash-stream run`: one launch that extracts and trains at once.

Under `accelerate launch` the ranks split into extractors and trainers (see roles.py); with one process the run
alternates: extract until the buffer is full, train on what is ready, release, repeat.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash_stream.config import Config, load_config
from dflash_stream.diskfull import retry_when_full
from dflash_stream.errors import DFlashError
from dflash_stream.log import get_logger, setup_logging
from dflash_stream.observe.metrics import MetricsWriter, TrainingTracker, peak_store_bytes
from dflash_stream.observe.summary import summary_table
from dflash_stream.pipeline.common import open_store, save_resolved_config, store_layout
from dflash_stream.pipeline.guard import hold_output, stop_with_launcher
from dflash_stream.pipeline.roles import RoleInfo, assign_role, init_distributed, resolve_launch
from dflash_stream.preflight import check_run_paths
from dflash_stream.rundir import RunDir, write_atomic
from dflash_stream.store import lease
from dflash_stream.target_model import resolve_device

log = get_logger("run")

def register(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="extract and train in one launch (the main job)")
    run.add_argument("--config", required=True, help="run config YAML")
    run.set_defaults(func=run_command, overrides=[])


def _first_rank_opens_store(cfg: Config, role: RoleInfo, layer_ids: list[int], hidden_size: int):
    """Rank 0 takes the output directory, then creates or recovers the store before anyone else touches it; its
    error (a live run holds them, a bad store) stops every rank."""
    error: list[str | None] = [None]
    store = None
    if role.global_rank == 0:
        single = role.role == "single"
        try:
            hold_output(cfg, ("extract", "train"))
            save_resolved_config(cfg)
            from dflash_stream.observe.disk import check_run_disk
            from dflash_stream.target_model import load_target_config

            # The whole footprint (store budget, checkpoints, export, data, metrics) against the free disk.
            check_run_disk(cfg, load_target_config(cfg.target), layer_ids)
            store = open_store(cfg, layer_ids, hidden_size)
            # A trainer's own claims survive: its checkpoint may record a half-trained segment it resumes.
            trainers = [f"trainer-{i}" for i in range(1 if single else cfg.roles.trainers)]
            report = store.recover(keep_consumers=trainers)
            if any(report.values()):
                log.info("recovered the store after an earlier stop: %s", report)
            store.set_expected_writers(1 if single else role.world_size - cfg.roles.trainers)
        except DFlashError as err:  # every rank must learn of it, or the others wait forever
            lease.release_all()
            error[0] = str(err)
    if role.world_size > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise DFlashError(error[0])
    return store if store is not None else open_store(cfg, layer_ids, hidden_size, create=False)


def _write_summary_part(output: Path, role: RoleInfo, fields: dict[str, Any]) -> None:
    path = RunDir(output).summary_part(role.role, role.index)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(fields))


def write_summary(cfg: Config, store, started: float) -> dict[str, Any]:
    """OUTPUT/summary.json from every rank's part and the store's records, and a closing table."""
    run = RunDir(cfg.output_dir)
    parts = [json.loads(p.read_text()) for p in run.summary_part_files()]
    extractors = [p for p in parts if p["role"] in ("extractor", "single")]
    trainers = [p for p in parts if p["role"] in ("trainer", "single")]
    lead = next((p for p in trainers if p["index"] == 0), {})
    # Counted from the store's records, so a resumed run reports the whole run, not only its last launch.
    published = store.published()
    summary = {
        "samples_extracted": sum(len(info.sample_ids) for info in published),
        "tokens_extracted": sum(info.num_tokens for info in published),
        "samples_trained": sum(p.get("samples_trained", 0) for p in trainers),
        "steps": lead.get("steps", 0),
        "budget_bytes": int(cfg.store.budget),
        "peak_store_bytes": peak_store_bytes(run.root),
        "wall_seconds": round(time.time() - started, 2),
        "extract_seconds": round(max((p.get("extract_seconds", 0.0) for p in extractors), default=0.0), 2),
        "train_seconds": round(max((p.get("train_seconds", 0.0) for p in trainers), default=0.0), 2),
        "trainer_data_wait_seconds": round(max((p.get("data_wait_seconds", 0.0) for p in trainers), default=0.0), 2),
        "extractor_backpressure_seconds": round(
            max((p.get("backpressure_seconds", 0.0) for p in extractors), default=0.0), 2
        ),
        "extractor_forward_stall_seconds": round(
            max((p.get("stall_seconds", 0.0) for p in extractors), default=0.0), 2
        ),
        "final_loss": lead.get("final_loss"),
        "checkpoint": lead.get("export"),
        "eval": lead.get("eval"),
    }
    write_atomic(run.summary, json.dumps(summary, indent=2))
    lines = summary_table(summary)
    print("\nrun summary (" + str(run.summary) + ")\n" + "\n".join(lines), flush=True)
    return summary


def _finish_training(cfg: Config, role: RoleInfo, trainer) -> dict[str, Any]:
    """Export the drafter and measure its acceptance on held-out prompts (trainer index 0 only)."""
    fields: dict[str, Any] = {}
    if role.index != 0:
        return fields
    run = RunDir(cfg.output_dir)
    export = retry_when_full(f"the drafter export {run.drafter}", run.root, lambda: trainer.export(run.drafter))
    fields["export"] = str(export)
    if cfg.eval.prompts:
        from dflash_stream.drafter import evaluate

        result = evaluate(cfg, export, cfg.eval.prompts, cfg.eval.max_new_tokens)
        run.eval.write_text(json.dumps(result, indent=2))
        fields["eval"] = {k: result[k] for k in ("acceptance_length", "matches_target", "speedup") if k in result}
        log.info(
            "held-out acceptance length tau = %.3f (matches target: %s, speedup %.2fx)",
            result["acceptance_length"], result["matches_target"], result.get("speedup", float("nan")),
        )
    return fields


def _trainer_fields(trainer) -> dict[str, Any]:
    return {
        "samples_trained": trainer.samples_trained,
        "steps": trainer.steps,
        "final_loss": trainer.final_loss,
        "train_seconds": trainer.train_seconds,
        "data_wait_seconds": trainer.data_wait_seconds,
    }


def _extractor_fields(extractor) -> dict[str, Any]:
    return {
        "extract_seconds": extractor.extract_seconds,
        # Writes held back by the full buffer, and how much of that reached the target's forward loop.
        "backpressure_seconds": extractor.writer.waited_seconds,
        "stall_seconds": extractor.backpressure_seconds,
    }


def run_single(cfg: Config, role: RoleInfo, store, metrics: MetricsWriter, device: torch.device) -> tuple[dict, bool]:
    """One process: extract until the buffer is full, train on what is ready, release, repeat."""
    from dflash_stream.pipeline.replay import make_extractor
    from dflash_stream.pipeline.trainer import Trainer

    extractor = make_extractor(cfg, role, store, metrics, device)
    trainer = Trainer(cfg, role, store, metrics, device)
    rounds = 0
    while not extractor.run(until_full=True):
        rounds += 1
        log.info("buffer full: training on the ready segments (round %d)", rounds)
        if trainer.run(until_idle=True) or trainer.stopped_by:  # train.max_steps reached, or a signal
            break
    finished = False
    # Train what is left, extracting again the samples of any segment found damaged on the way.
    while trainer.stopped_by is None and not finished:
        finished = trainer.run(until_idle=True)
        if not finished and not extractor.redo_quarantined():
            time.sleep(0.1)
    fields = {**_extractor_fields(extractor), **_trainer_fields(trainer)}
    return ({**fields, **_finish_training(cfg, role, trainer)} if finished else fields), finished


def run_role(cfg: Config, role: RoleInfo, store, metrics: MetricsWriter, device: torch.device) -> tuple[dict, bool]:
    """(summary fields, finished): False when a trainer was stopped by a signal after its checkpoint."""
    if role.role == "extractor":
        from dflash_stream.pipeline.replay import make_extractor

        with store.heartbeat(f"extractor-{role.index}"):  # from before the target loads
            extractor = make_extractor(cfg, role, store, metrics, device)
            extractor.run()
            # Stay to extract again what a trainer finds damaged, until training is over.
            extractor.serve_redo(lambda: RunDir(cfg.output_dir).summary_part("trainer", 0).exists())
        return _extractor_fields(extractor), True
    from dflash_stream.pipeline.trainer import Trainer

    trainer = Trainer(cfg, role, store, metrics, device)
    if not trainer.run():
        return _trainer_fields(trainer), False
    return {**_trainer_fields(trainer), **_finish_training(cfg, role, trainer)}, True


def run_command(args: argparse.Namespace) -> int:
    started = time.time()
    stop_with_launcher()
    cfg = load_config(args.config, args.overrides)
    check_run_paths(cfg)  # before anything is written
    chosen_by = resolve_launch(cfg)
    role = assign_role(cfg)
    setup_logging(role.role, role.index, show_bar=role.speaks_for_role)
    device = _device(cfg)
    if role.global_rank == 0 and role.role != "single":
        log.info("roles: %d extractor(s) + %d trainer(s) of %d processes (%s)", role.world_size - cfg.roles.trainers,
                 cfg.roles.trainers, role.world_size, chosen_by or "roles.trainers in the config")
    _check_memory(cfg, role, device)
    layer_ids, hidden_size = store_layout(cfg)
    output = Path(cfg.output_dir)
    if role.global_rank == 0:
        log.info(
            "run: %d process(es), %s; layers %s of the target, store %s (budget %s, codec %s)",
            role.world_size, "single-process" if role.role == "single" else f"{role.count} {role.role}(s) here",
            layer_ids, cfg.store.path, cfg.store.budget.human_readable(), cfg.store.codec,
        )
    store = _first_rank_opens_store(cfg, role, layer_ids, hidden_size)
    metrics = (
        TrainingTracker(output, role.role, role.index, tensorboard=cfg.metrics.tensorboard)
        if role.role in ("trainer", "single") else MetricsWriter(output, role.role, role.index)
    )
    metrics.log("start", config=cfg.model_dump(mode="json"))
    try:
        fields, finished = (run_single if role.role == "single" else run_role)(cfg, role, store, metrics, device)
        if not finished:
            log.info("stopped by a signal after a durable checkpoint; run the same command again to resume")
            return 143
        _write_summary_part(output, role, {"role": role.role, "index": role.index, **fields})
        if role.role in ("single", "trainer") and role.index == 0:
            summary = write_summary(cfg, store, started)
            metrics.log("end", summary=summary)
    finally:
        metrics.close()
        lease.release_all()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _check_memory(cfg: Config, role: RoleInfo, device: torch.device) -> None:
    """Refuse a role whose estimated peak exceeds its GPU, warn when it leaves little headroom (observe.memory).
    On CPU the roles share the host's RAM and nothing is checked."""
    if device.type != "cuda":
        return
    from dflash_stream.observe.memory import startup_check

    total = torch.cuda.get_device_properties(device).total_memory
    warning = startup_check(cfg, role.role, int(cfg.roles.device_memory or total))
    if warning:
        log.warning("GPU memory: %s", warning)


def _device(cfg: Config) -> torch.device:
    """`target.device`, or the device accelerate gives this rank (cuda:LOCAL_RANK, or cpu)."""
    return init_distributed() if cfg.target.device == "auto" else resolve_device(cfg.target)
