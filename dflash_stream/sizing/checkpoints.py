"""How often trainers checkpoint, what that costs, and what a crash costs, under each release rule
(`train.release`): what `plan` shows side by side.

after_checkpoint: a finished segment leaves the buffer only at a durable checkpoint, so a small budget forces
checkpoints: when training is the slower side the buffer is full of ready segments and a checkpoint comes each
time finished ones reach HOLDING_SHARE of the budget; when extraction is slower, trainers keep up and the buffer
fills with finished segments, forcing one per budget's worth of extraction. A crash loses the training since the
latest checkpoint and extracts nothing again.

on_use: a segment use leaves once trained, so checkpoints follow the user's clock alone (`train.checkpoint_every`
steps, `train.checkpoint_every_s` seconds, whichever comes first). A crash loses the training since the latest
checkpoint and extracts again what was released since: the uses trained in that time, where consecutive uses of
one segment are extracted once (`pipeline/rollback.py`), so at most the interval's tokens over store.reuse plus
the buffer's content (the segments whose uses straddle the checkpoint). Regenerated answers are cached: only the
capture forward runs again.
"""

from __future__ import annotations

import math
from typing import Any

from dflash_stream.config import HOLDING_SHARE, Config
from dflash_stream.units import fmt_bytes, fmt_duration

# Effective write bandwidth of a checkpoint: rank 0 serialises the whole drafter and optimizer state, then fsyncs.
# Local NVMe sustains more, network filesystems (NFS, Lustre under load) often less.
ASSUMED_CHECKPOINT_WRITE = {"gpu": 1.0e9, "cpu": 0.5e9}
# With train.async_checkpoint training stops only while the state is copied to host memory: `bench checkpoint`
# measured 2.57 GB in 0.63 s beside a running optimizer on this project's 2-core CPU machine (~4 GB/s).
ASSUMED_SNAPSHOT_COPY = 4.0e9
CRASH_COST_WARN_SECONDS = 3600.0
"""`plan` warns when one crash may cost more than this (training lost + its re-extraction)."""
RULES = ("on_use", "after_checkpoint")


def checkpoint_costs(cfg: Config, *, checkpoint_bytes: float, kind: str, train_seconds: float | None,
                     train_tok_s: float | None, step_seconds: float | None, extract_side_seconds: float | None,
                     extract_tok_s: float | None, tokens: float | None, stored_bytes_per_token: float
                     ) -> dict[str, Any]:
    """The checkpoints of the configured rule (the keys `plan` has always shown: bytes, every_seconds,
    write_seconds, stall_seconds per checkpoint, stall_fraction, count, forced_by, source) beside `rule` (the
    configured one), `rules` (each rule's figures: count, every_seconds, bytes_written, stall_seconds in all,
    stall_fraction, forced_by, and one crash's training_lost_seconds, reextract_tokens, reextract_seconds,
    crash_seconds) and `why` (the configured rule against the other, in words). Rates are over all the
    processes of a role (tok/s); without them the figures are None."""
    tc = cfg.train
    bandwidth = ASSUMED_CHECKPOINT_WRITE[kind]
    write = checkpoint_bytes / bandwidth
    stall = checkpoint_bytes / ASSUMED_SNAPSHOT_COPY if tc.async_checkpoint else write
    out: dict[str, Any] = {
        "rule": tc.release, "bytes": checkpoint_bytes, "write_seconds": write, "stall_seconds": stall,
        "every_seconds": None, "stall_fraction": None, "count": None, "forced_by": None,
        "rules": {rule: None for rule in RULES}, "why": None,
        "source": f"write at an assumed {bandwidth / 1e9:g} GB/s effective (one rank serialises the state, then "
                  "fsync)" + (f", in the background; training stops for the host snapshot at an assumed "
                              f"{ASSUMED_SNAPSHOT_COPY / 1e9:g} GB/s (`bench checkpoint`)" if tc.async_checkpoint
                              else ""),
    }
    if not (tokens and train_seconds and train_tok_s and step_seconds and extract_side_seconds and extract_tok_s):
        return out
    # The user's clock: whichever of train.checkpoint_every (steps) and train.checkpoint_every_s comes first.
    scheduled, scheduled_by = tc.checkpoint_every * step_seconds, f"train.checkpoint_every {tc.checkpoint_every} steps"
    if tc.checkpoint_every_s is not None and tc.checkpoint_every_s < scheduled:
        scheduled, scheduled_by = tc.checkpoint_every_s, f"train.checkpoint_every_s {fmt_duration(tc.checkpoint_every_s)}"
    budget = int(cfg.store.budget)
    freed_bytes_s = train_tok_s * stored_bytes_per_token / cfg.store.reuse  # a segment is finished after its last use
    written_bytes_s = tokens * cfg.extraction_passes * stored_bytes_per_token / extract_side_seconds
    if written_bytes_s >= freed_bytes_s:
        forced, why = HOLDING_SHARE * budget / freed_bytes_s, "training is the slower side"
    else:
        forced, why = budget / written_bytes_s, "extraction is the slower side"
    intervals = {
        "on_use": (scheduled, scheduled_by),
        "after_checkpoint": (forced, f"the release rule at store.budget {fmt_bytes(budget)} ({why})")
        if forced < scheduled else (scheduled, scheduled_by),
    }
    buffer_tokens = budget / stored_bytes_per_token
    for rule, (every, forced_by) in intervals.items():
        count = math.ceil(train_seconds / every)
        lost = every + write  # a checkpoint is no fallback until its write ends
        # Released in that time: its token-uses; a segment all of whose uses fell in it is extracted once.
        uses = train_tok_s * lost
        again = min(uses, uses / cfg.store.reuse + buffer_tokens) if rule == "on_use" else 0.0
        out["rules"][rule] = {
            "every_seconds": every, "count": count, "bytes_written": count * checkpoint_bytes,
            "stall_seconds": count * stall, "stall_fraction": stall / (every + stall), "forced_by": forced_by,
            "training_lost_seconds": lost, "reextract_tokens": again, "reextract_seconds": again / extract_tok_s,
            "crash_seconds": lost + again / extract_tok_s,
        }
    chosen = out["rules"][tc.release]
    out.update({k: chosen[k] for k in ("every_seconds", "count", "stall_fraction", "forced_by")})
    out["why"] = _why(tc.release, out["rules"])
    return out


def _why(rule: str, rules: dict[str, dict[str, Any]]) -> str:
    """The configured rule against the other: what it buys and what it pays."""
    on_use, after = rules["on_use"], rules["after_checkpoint"]
    fewer = after["bytes_written"] / on_use["bytes_written"]
    if rule == "on_use":
        if fewer <= 1.0:
            return ("on_use: the buffer forces no extra checkpoint at this budget, so after_checkpoint would cost "
                    "no more checkpoints and would spare a crash its re-extraction")
        return (f"on_use: checkpoints on the user's clock write {fewer:,.1f}x fewer bytes than after_checkpoint "
                f"would ({after['count']:,} checkpoints forced by the buffer), for up to "
                f"{fmt_duration(on_use['reextract_seconds'])} of re-extraction after a crash")
    return (f"after_checkpoint: a crash extracts nothing again (on_use: up to {fmt_duration(on_use['reextract_seconds'])}"
            f" of extraction), for {fewer:,.1f}x the checkpoint bytes of on_use")
