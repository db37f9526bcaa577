"""Which process does what: the split of an `accelerate launch` into extractors and trainers.

Ranks `0 .. E-1` extract and ranks `E .. W-1` train, so the trainers form one contiguous data-parallel group
whose collectives never involve an extractor. `roles.trainers: auto` takes the split `plan` finds fastest
(`sizing.work.split_plan`): extractors and trainers stream side by side, so the slower side sets the pace.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from dflash_stream.config import Config
from dflash_stream.rundir import RunDir

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


def resolve_trainers(cfg: Config, world_size: int) -> tuple[int, str]:
    """(trainers, why) for a split launch of `world_size` (> 1) processes, resolving `roles.trainers: auto`.

    A run that resumes keeps the trainer count its latest checkpoint was written with (a checkpoint holds one
    part per trainer). Otherwise auto takes the split with the shortest estimated wall time, as `plan` does.
    """
    if cfg.roles.trainers != "auto":
        return cfg.roles.trainers, "roles.trainers in the config"
    if world_size <= 2:
        return 1, "roles.trainers: auto; the only split of 2 processes"
    resume = RunDir(cfg.output_dir).latest_checkpoint()
    parts = len(list(resume.glob("trainer-*.pt"))) if resume is not None else 0
    if 0 < parts < world_size:
        return parts, f"roles.trainers: auto; resuming {resume.name}, which {parts} trainer(s) wrote"
    from dflash_stream.sizing.work import plan_roles

    roles = plan_roles(cfg, world_size, allow_download=True)
    walls = ", ".join(f"{a['extractors']}+{a['trainers']}: {r:.2f}x" for a, r in
                      zip(roles["alternatives"], roles["alternatives_relative"], strict=True))
    return roles["trainers"], (f"roles.trainers: auto; shortest estimated wall time of the splits extractors+trainers "
                               f"(relative to the best: {walls}) [{roles['source']}]")


def resolve_launch(cfg: Config) -> str | None:
    """Turn `roles.trainers: auto` into this launch's number of trainers (in place, so that the resolved config
    and every rank agree) and say why; None when nothing was chosen (one process, single mode, a fixed number)."""
    _, world_size = world()
    if world_size == 1 or cfg.roles.mode == "single" or cfg.roles.trainers != "auto":
        return None
    trainers, why = resolve_trainers(cfg, world_size)
    cfg.roles.trainers = trainers
    return why


def init_distributed() -> torch.device:
    """Join the launch's process group through accelerate (gloo on CPU, nccl on GPU); this process's device."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available()).device


def leave_process_group(wait_for: dist.ProcessGroup | None = None) -> None:
    """Tear the launch's process group down before interpreter exit, where gloo can abort a rank that ended before
    another ("terminate called without an active exception", exit -6). Destroyed while trainer 0 still exported,
    a trainer aborted too (once in ~10 test runs), so ranks that finished together first wait for each other at a
    barrier of `wait_for`; a peer that died makes it fail at once."""
    if not dist.is_initialized():
        return
    if wait_for is not None:
        with contextlib.suppress(RuntimeError):
            dist.barrier(group=wait_for)
    with contextlib.suppress(RuntimeError):  # called in `finally` too: never hide the error that led here
        dist.destroy_process_group()


def assign_role(cfg: Config) -> RoleInfo:
    """This process's role in a combined run (`dflash-stream run`)."""
    rank, world_size = world()
    extractors, trainers = cfg.roles.split(world_size)
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
