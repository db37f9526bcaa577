"""`dflash-stream run`: one launch that extracts and trains at once.

Under `accelerate launch` the ranks split into extractors and trainers (see roles.py); with one process the run
alternates: extract until the buffer is full, train on what is ready, release, repeat.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash_stream.config import Config, load_config, served_engine
from dflash_stream.diskfull import retry_when_full
from dflash_stream.errors import DFlashError
from dflash_stream.log import get_logger, setup_logging
from dflash_stream.observe.metrics import MetricsWriter, TrainingTracker, peak_store_bytes
from dflash_stream.observe.summary import (
    missing_parts,
    part_name,
    read_parts,
    read_summary,
    role_figures,
    summary_table,
)
from dflash_stream.pipeline import checkpoint as ckpt
from dflash_stream.pipeline.common import check_host_memory, open_store, save_resolved_config, store_layout
from dflash_stream.pipeline.guard import hold_output, stop_with_launcher
from dflash_stream.pipeline.roles import (
    RoleInfo,
    assign_role,
    init_distributed,
    leave_process_group,
    resolve_launch,
)
from dflash_stream.preflight import check_run_paths
from dflash_stream.rundir import RunDir, write_atomic
from dflash_stream.store import WriterStopped, lease
from dflash_stream.target_model import resolve_device
from dflash_stream.units import fmt_duration

log = get_logger("run")

def register(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="extract and train in one launch (the main job)")
    run.add_argument("--config", required=True, help="run config YAML")
    run.set_defaults(func=run_command, overrides=[])


def _first_rank_opens_store(cfg: Config, role: RoleInfo, layer_ids: list[int], hidden_size: int):
    """Rank 0 takes the output directory, then creates or recovers the store before anyone else touches it; its
    error (a live run holds them, a bad store) stops every rank. Returns (store, this launch's id): rank 0 draws
    it and clears an earlier launch's "training is over" marker first."""
    shared: list[str | None] = [None, None]  # rank 0's error, the launch id
    store = None
    if role.global_rank == 0:
        single = role.role == "single"
        try:
            hold_output(cfg, ("extract", "train"))
            RunDir(cfg.output_dir).training_over.unlink(missing_ok=True)
            shared[1] = uuid.uuid4().hex
            save_resolved_config(cfg)
            from dflash_stream.sizing.disk import check_run_disk
            from dflash_stream.target_model import target_shape

            # Old checkpoints an earlier launch could not delete go first: the disk check below counts this
            # run's files as free, and one that cannot be deleted stops the run here, naming it.
            ckpt.prune(cfg.output_dir, cfg.train.keep_checkpoints)
            # The whole footprint (store budget, checkpoints, export, data, metrics) against the free disk.
            check_run_disk(cfg, target_shape(cfg.target, download=True, hints=False, count=False), layer_ids)
            store = open_store(cfg, layer_ids, hidden_size)
            # A trainer's own claims survive: its checkpoint may record a half-trained segment it resumes.
            trainers = [f"trainer-{i}" for i in range(1 if single else cfg.roles.trainers)]
            report = store.recover(keep_consumers=trainers)
            if any(report.values()):
                log.info("recovered the store after an earlier stop: %s", report)
            store.set_expected_writers(1 if single else role.world_size - cfg.roles.trainers)
        except DFlashError as err:  # every rank must learn of it, or the others wait forever
            lease.release_all()
            shared[0] = str(err)
    if role.world_size > 1:
        dist.broadcast_object_list(shared, src=0)
    error, launch = shared
    if error is not None:
        raise DFlashError(error)
    return (store if store is not None else open_store(cfg, layer_ids, hidden_size, create=False)), launch


def training_is_over(cfg: Config, launch: str) -> bool:
    """Trainer 0 of launch `launch` said training is over (a marker of an earlier launch does not count)."""
    try:
        return json.loads(RunDir(cfg.output_dir).training_over.read_text()).get("launch") == launch
    except (OSError, ValueError):
        return False


def _say_training_is_over(cfg: Config, launch: str, trainer) -> None:
    """Trainer 0: the extractors of this launch may leave now, blocked on a full buffer or not (train.max_steps
    stops training with data still coming), before the export and eval that follow."""
    write_atomic(RunDir(cfg.output_dir).training_over, json.dumps({"launch": launch, "step": trainer.steps}))


SUMMARY_WAIT_S = 300.0
"""How long trainer 0 waits for the other ranks' summary parts. An extractor leaves within a second of trainer 0's
"training is over" marker (it looks for it between re-extractions and while a write waits for room), so this
only runs out when a rank died or hangs."""


def _write_summary_part(output: Path, role: RoleInfo, fields: dict[str, Any]) -> None:
    path = RunDir(output).summary_part(role.role, role.index)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The CPU time of every thread of this process (the checkpoint writer's, the store's decoders'): where a
    # CPU-only run's time went, rank by rank.
    usage = resource.getrusage(resource.RUSAGE_SELF)
    # `written` tells this launch's parts from those an earlier launch of the same folder left.
    write_atomic(path, json.dumps({**fields, "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1),
                                   "written": time.time()}))


def expected_parts(cfg: Config, role: RoleInfo) -> list[str]:
    """The summary parts one launch writes: one per rank."""
    if role.role == "single":
        return [part_name("single", 0)]
    extractors = role.world_size - cfg.roles.trainers
    return [part_name("extractor", i) for i in range(extractors)] + [
        part_name("trainer", i) for i in range(cfg.roles.trainers)]


def _wait_for_parts(run: RunDir, expected: list[str], started: float, wait_s: float) -> list[dict[str, Any]]:
    """This launch's parts once all of `expected` exist, or those there are after `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        parts = read_parts(run.summary_part_files(), since=started)
        missing = missing_parts(parts, expected)
        if not missing or time.monotonic() >= deadline:
            return parts
        if not said:
            log.info("waiting up to %s for the summary part(s) of %s (an extractor stays until training is over)",
                     fmt_duration(wait_s), ", ".join(missing))
            said = True
        time.sleep(0.2)


def write_summary(cfg: Config, store, started: float, expected: list[str],
                  wait_s: float = SUMMARY_WAIT_S) -> dict[str, Any]:
    """OUTPUT/summary.json from every rank's part and the store's records, and a closing table. Waits up to
    `wait_s` for the parts in `expected`; those that did not come are listed in `missing_parts`."""
    run = RunDir(cfg.output_dir)
    parts = _wait_for_parts(run, expected, started, wait_s)
    # Counted from the store's records, so a resumed run reports the whole run, not only its last launch.
    published = store.published()
    figures = role_figures(parts, expected)
    summary = {
        "samples_extracted": sum(len(info.sample_ids) for info in published),
        "tokens_extracted": sum(info.num_tokens for info in published),
        "samples_trained": figures.pop("samples_trained"),
        "steps": figures.pop("steps"),
        "budget_bytes": int(cfg.store.budget),
        "peak_store_bytes": peak_store_bytes(run.root),
        "wall_seconds": round(time.time() - started, 2),
        **figures,
    }
    write_atomic(run.summary, json.dumps(summary, indent=2))
    if summary["missing_parts"]:
        log.warning("summary.json lacks the figures of %s: no summary part after %s (that rank died or still runs);"
                    " `status` adds them if they come later", ", ".join(summary["missing_parts"]),
                    fmt_duration(wait_s))
    lines = summary_table(summary)
    print("\nrun summary (" + str(run.summary) + ")\n" + "\n".join(lines), flush=True)
    return summary


def _complete_summary(cfg: Config) -> None:
    """A rank that finished after trainer 0 gave up waiting for it adds its figures to summary.json itself. (No
    summary yet: trainer 0 is still waiting and reads this rank's part itself.)"""
    run = RunDir(cfg.output_dir)
    summary = read_summary(run)
    if summary is not None and summary != json.loads(run.summary.read_text()):
        write_atomic(run.summary, json.dumps(summary, indent=2))


def _finish_training(cfg: Config, role: RoleInfo, trainer) -> dict[str, Any]:
    """Export the drafter and measure its acceptance on held-out prompts (trainer index 0 only)."""
    fields: dict[str, Any] = {}
    if role.index != 0:
        return fields
    run = RunDir(cfg.output_dir)
    export = retry_when_full(f"the drafter export {run.drafter}", run.root, lambda: trainer.export(run.drafter))
    fields["export"] = str(export)
    if cfg.eval.prompts:
        from dflash_stream.drafter.evaluate import ENGINE_NAMES, evaluate, run_summary

        if cfg.eval.engine == "vllm" and not cfg.eval.endpoint:
            log.info("eval.engine vllm without eval.endpoint: the end-of-run eval stays ours (a local vLLM server "
                     "would compete with this run's processes); `dflash-stream eval --engine vllm --drafter %s` "
                     "measures vLLM's tau after the run", export)
        if cfg.eval.engine == "sglang":  # vLLM's start time is checked against the export's (served.py)
            log.warning("eval.endpoint %s: its figures are this drafter's only if that SGLang server was started on "
                        "%s after this export (it reads its draft model once, at start)", cfg.eval.endpoint, export)
        result = evaluate(cfg, export, cfg.eval.prompts, cfg.eval.max_new_tokens,
                          engine=served_engine(cfg.eval.engine, cfg.eval.endpoint) if cfg.eval.endpoint else "ours",
                          endpoint=cfg.eval.endpoint)
        run.eval.write_text(json.dumps(result, indent=2))
        fields["eval"] = run_summary(result)
        log.info(
            "held-out acceptance length tau = %.3f (matches target: %s, speedup %.2fx)",
            result["acceptance_length"], result["matches_target"], result.get("speedup", float("nan")),
        )
        served = fields["eval"].get("engine")
        if served and served["acceptance_length"] is not None:
            log.info("held-out tau in %s = %.3f (%+.2f %% against ours)", ENGINE_NAMES[served["name"]],
                     served["acceptance_length"], 100 * (served["relative_difference"] or 0.0))
    return fields


def _trainer_fields(trainer) -> dict[str, Any]:
    return {
        "samples_trained": trainer.samples_trained,
        "steps": trainer.steps,
        "final_loss": trainer.final_loss,
        "train_seconds": trainer.train_seconds,
        "data_wait_seconds": trainer.data_wait_seconds,
        "checkpoints": trainer.checkpoints,
        "checkpoint_stall_seconds": trainer.checkpoint_stall_seconds,
        "checkpoint_write_seconds": trainer.checkpoint_write_seconds,
    }


def _extractor_fields(extractor) -> dict[str, Any]:
    summary = extractor.summary()
    regenerated = summary.get("regenerate")  # engine openai: the servers' answers for this shard
    return {
        "extract_seconds": extractor.extract_seconds,
        # Writes held back by the full buffer, and how much of that reached the target's forward loop.
        "backpressure_seconds": extractor.writer.waited_seconds,
        "stall_seconds": extractor.backpressure_seconds,
        # In-process regeneration (engine hf), and the part of it done ahead while the buffer was full.
        "generate_seconds": summary.get("generate_seconds", 0.0),
        "generate_ahead_seconds": summary.get("generate_ahead_seconds", 0.0),
        **({"regenerate": regenerated} if regenerated else {}),
    }


def run_single(cfg: Config, role: RoleInfo, store, metrics: MetricsWriter, device: torch.device) -> tuple[dict, bool]:
    """One process: extract until the buffer is full, train on what is ready, release, repeat."""
    from dflash_stream.pipeline.extract_command import make_extractor
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


def run_role(cfg: Config, role: RoleInfo, store, metrics: MetricsWriter, device: torch.device, launch: str
             ) -> tuple[dict, bool]:
    """(summary fields, finished): False when a trainer was stopped by a signal after its checkpoint. `launch`:
    this launch's id, which trainer 0's "training is over" marker names."""
    if role.role == "extractor":
        from dflash_stream.pipeline.extract_command import make_extractor

        over = partial(training_is_over, cfg, launch)
        with store.heartbeat(f"extractor-{role.index}"):  # from before the target loads
            extractor = make_extractor(cfg, role, store, metrics, device)
            extractor.writer.stop_when = over  # a write waiting for room ends when training is over
            try:
                extractor.run()
                # Stay to extract again what a trainer finds damaged, until training is over.
                extractor.serve_redo(over)
            except WriterStopped:
                if not over():
                    raise
                log.info("training is over: extractor %d leaves with part of its data not extracted", role.index)
        return _extractor_fields(extractor), True
    from dflash_stream.pipeline.trainer import Trainer

    trainer = Trainer(cfg, role, store, metrics, device)
    if not trainer.run():
        return _trainer_fields(trainer), False
    if role.index == 0:
        _say_training_is_over(cfg, launch, trainer)
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
    single = role.role == "single"
    check_host_memory(cfg, 0 if single else role.world_size - cfg.roles.trainers, role.world_size,
                      role.global_rank, single)
    layer_ids, hidden_size = store_layout(cfg)
    output = Path(cfg.output_dir)
    if role.global_rank == 0:
        log.info(
            "run: %d process(es), %s; layers %s of the target, store %s (budget %s, codec %s)",
            role.world_size, "single-process" if role.role == "single" else f"{role.count} {role.role}(s) here",
            layer_ids, cfg.store.path, cfg.store.budget.human_readable(), cfg.store.codec,
        )
    store, launch = _first_rank_opens_store(cfg, role, layer_ids, hidden_size)
    metrics = (
        TrainingTracker(output, role.role, role.index, tensorboard=cfg.metrics.tensorboard)
        if role.role in ("trainer", "single") else MetricsWriter(output, role.role, role.index)
    )
    metrics.log("start", config=cfg.model_dump(mode="json"))
    try:
        if role.role == "single":
            fields, finished = run_single(cfg, role, store, metrics, device)
        else:
            fields, finished = run_role(cfg, role, store, metrics, device, launch)
        if not finished:
            log.info("stopped by a signal after a durable checkpoint; run the same command again to resume")
            return 143
        _write_summary_part(output, role, {"role": role.role, "index": role.index, **fields})
        status = 0
        if role.role in ("single", "trainer") and role.index == 0:
            summary = write_summary(cfg, store, started, expected_parts(cfg, role))
            metrics.log("end", summary=summary)
            unanswered = (summary.get("regenerate") or {}).get("errors", 0)
            if unanswered:  # the launch's last word, once every rank's part is in: the exit status says it
                log.error("regeneration is incomplete: %d sample(s) got no answer from the servers (each named "
                          "above); the drafter trained without them; run the same command again to ask for them",
                          unanswered)
                status = 1
        else:
            _complete_summary(cfg)
    finally:
        metrics.close()
        lease.release_all()
    # Extractors leave at once: their devices are free for trainer 0's eval.
    leave_process_group(role.trainer_group)
    return status


def _check_memory(cfg: Config, role: RoleInfo, device: torch.device) -> None:
    """Refuse a role whose estimated peak exceeds its GPU, warn when it leaves little headroom (sizing.memory).
    On CPU the roles share the host's RAM and nothing is checked."""
    if device.type != "cuda":
        return
    from dflash_stream.sizing.memory import startup_check

    total = torch.cuda.get_device_properties(device).total_memory
    warning = startup_check(cfg, role.role, int(cfg.roles.device_memory or total))
    if warning:
        log.warning("GPU memory: %s", warning)


def _device(cfg: Config) -> torch.device:
    """`target.device`, or the device accelerate gives this rank (cuda:LOCAL_RANK, or cpu)."""
    return init_distributed() if cfg.target.device == "auto" else resolve_device(cfg.target)
