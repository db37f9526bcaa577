"""Which process does what: the split of an `accelerate launch` into extractors and trainers.

Ranks `0 .. E-1` extract and ranks `E .. W-1` train, so the trainers form one contiguous data-parallel group
whose collectives never involve an extractor. `roles.trainers: auto` takes the split with the shortest wall
time: extractors and trainers stream side by side, so the slower side sets the pace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from dflash_stream.config import Config, ConfigError

Role = Literal["extractor", "trainer", "single"]


@dataclass(frozen=True)
class RoleInfo:
    role: Role
    index: int
    """Position among the processes of the same role (extractor shard index, or trainer data-parallel rank)."""
    count: int
    """Processes with this role."""
    global_rank: int
    world_size: int
    trainer_group: dist.ProcessGroup | None = None
    """The trainers' process group (None when one process trains)."""

    @property
    def speaks_for_role(self) -> bool:
        """The one process per role that draws bars and writes role-wide files."""
        return self.index == 0


def world() -> tuple[int, int]:
    """(rank, world size) as set by `accelerate launch` / torchrun, or (0, 1) for a plain process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def split_alternatives(world_size: int, extract_seconds: float, train_seconds: float) -> list[dict[str, Any]]:
    """Wall time of every split of `world_size` processes. `extract_seconds` and `train_seconds` are the
    whole run's work of each role on one process (regeneration included); a role's processes share it evenly
    (data shards for extractors, data parallelism for trainers), and the slower role sets the pace."""
    return [
        {"extractors": world_size - t, "trainers": t,
         "wall_seconds": max(extract_seconds / (world_size - t), train_seconds / t)}
        for t in range(1, world_size)
    ]


def best_split(alternatives: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest split; on a tie the one with fewer trainers (fewer ranks in the trainers' collectives)."""
    return min(alternatives, key=lambda a: (round(a["wall_seconds"], 6), a["trainers"]))


def resolve_trainers(cfg: Config, world_size: int) -> tuple[int, str]:
    """(trainers, why) for a split launch of `world_size` processes, resolving `roles.trainers: auto`.

    A run that resumes keeps the trainer count its latest checkpoint was written with (a checkpoint holds one
    part per trainer). Otherwise auto asks the planner for the split with the shortest wall time.
    """
    if cfg.roles.trainers != "auto":
        return cfg.roles.trainers, "roles.trainers in the config"
    if world_size <= 2:
        return 1, "roles.trainers: auto; the only split of 2 processes"
    from dflash_stream.pipeline.checkpoint import latest_checkpoint

    resume = latest_checkpoint(cfg.output_dir)
    parts = len(list(resume.glob("trainer-*.pt"))) if resume is not None else 0
    if 0 < parts < world_size:
        return parts, f"roles.trainers: auto; resuming {resume.name}, which {parts} trainer(s) wrote"
    from dflash_stream.observe.plan import plan_roles
    from dflash_stream.observe.units import fmt_duration

    roles = plan_roles(cfg, world_size, allow_download=True)
    others = ", ".join(f"{a['trainers']}: {fmt_duration(a['wall_seconds'])}" for a in roles["alternatives"])
    return roles["trainers"], (f"roles.trainers: auto; shortest estimated wall time among trainers = {others} "
                               f"[{roles['source']}]")


def split_roles(cfg: Config, world_size: int) -> tuple[int, int]:
    """(extractors, trainers) for this launch, validated before any work starts."""
    mode = cfg.roles.mode
    if mode == "auto":
        mode = "single" if world_size == 1 else "split"
    if mode == "single":
        if world_size != 1:
            raise ConfigError(f"roles.mode=single needs one process; the launch has {world_size}")
        return 0, 0
    trainers, _ = resolve_trainers(cfg, world_size)
    if trainers >= world_size:
        raise ConfigError(
            f"roles.trainers={trainers} leaves no extractor in a launch of {world_size} process(es); "
            f"allowed: 1..{world_size - 1} (or roles.mode=single with one process)"
        )
    return world_size - trainers, trainers


def init_distributed() -> torch.device:
    """Join the launch's process group through accelerate (gloo on CPU, nccl on GPU); this process's device."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available()).device


def assign_role(cfg: Config) -> RoleInfo:
    """This process's role in a combined run (`dflash-stream run`)."""
    rank, world_size = world()
    extractors, trainers = split_roles(cfg, world_size)
    if extractors == 0:
        return RoleInfo("single", 0, 1, rank, world_size)
    init_distributed()
    # Every rank must take part in creating a group, even the ranks outside it.
    group = dist.new_group(list(range(extractors, world_size))) if trainers > 1 else None
    if rank < extractors:
        return RoleInfo("extractor", rank, extractors, rank, world_size)
    return RoleInfo("trainer", rank - extractors, trainers, rank, world_size, group)


def assign_uniform(role: Role) -> RoleInfo:
    """All processes of this launch share one role (`dflash-stream extract` or `dflash-stream train`)."""
    rank, world_size = world()
    init_distributed()
    group = dist.group.WORLD if role == "trainer" and world_size > 1 else None
    return RoleInfo(role, rank, world_size, rank, world_size, group)
