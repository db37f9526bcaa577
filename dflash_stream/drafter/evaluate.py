"""`evaluate`: acceptance length, acceptance histogram and speedup of an exported drafter on held-out prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dflash_stream.config import Config, ConfigError
from dflash_stream.data.formats import RowError, split_for_regeneration, to_messages
from dflash_stream.data.template import ChatEncoder
from dflash_stream.drafter.export import load_drafter
from dflash_stream.drafter.head import TargetHead
from dflash_stream.drafter.speculative import Generation, greedy_generate, speculative_generate
from dflash_stream.log import get_logger, progress
from dflash_stream.target_model.loading import load_target, resolve_device, stop_token_ids

log = get_logger(__name__)

Row = dict[str, Any]


def read_prompts(path: str | Path) -> list[Row]:
    """Rows of a jsonl file: chat `messages` (or any row format the data part reads) or plain `prompt`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prompts file not found: {path}")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{number}: a row must be a JSON object with 'messages' or 'prompt'")
        rows.append(row)
    if not rows:
        raise ConfigError(f"prompts file {path} holds no rows")
    return rows


def render_prompt(tokenizer: Any, row: Row, data: Any = None) -> list[int]:
    """Token ids of the row's prompt (everything before its last assistant turn) plus the generation prompt,
    rendered exactly as the data pipeline renders prompts for regeneration (with `data`'s chat_template and
    chat_template_kwargs when given)."""
    try:
        messages = split_for_regeneration(to_messages(row))
        encoder = ChatEncoder.from_config(tokenizer, data) if data is not None else ChatEncoder(tokenizer)
        return encoder.encode_prompt(messages).tolist()
    except (RowError, ValueError) as err:
        raise ConfigError(f"prompt row {json.dumps(row)[:80]}: {err}") from None


class Evaluator:
    """The target loaded once for many drafters: each prompt's target-only greedy output and its timing are
    computed on first use and reused, so comparing drafters costs only their speculative decoding."""

    def __init__(self, cfg: Config, prompts: str | Path | list[Row]) -> None:
        rows = read_prompts(prompts) if isinstance(prompts, str | Path) else prompts
        rows = rows[: cfg.eval.num_prompts] if cfg.eval.num_prompts else rows
        if not rows:
            raise ConfigError("eval: no prompts to evaluate")
        self.device = resolve_device(cfg.target)
        self.target, tokenizer = load_target(cfg.target, self.device)
        self.head = TargetHead.from_model(self.target)
        self.stops = stop_token_ids(self.target, tokenizer)
        self.encoded = [torch.tensor([render_prompt(tokenizer, row, cfg.data)], device=self.device) for row in rows]
        self._baseline: dict[tuple[int, int], Generation] = {}
        self._warm = False

    def _reference(self, index: int, max_new_tokens: int) -> Generation:
        key = (index, max_new_tokens)
        if key not in self._baseline:
            self._baseline[key] = greedy_generate(self.target, self.encoded[index], max_new_tokens, self.stops)
        return self._baseline[key]

    def evaluate(self, drafter_dir: str | Path, max_new_tokens: int) -> dict[str, Any]:
        """Greedy speculative decoding vs the target alone on each prompt; figures as a JSON-ready dict.

        `acceptance_length` (tau) = tokens emitted per target verification step over all prompts, and
        `acceptance_stderr` its standard error over the prompts;
        `acceptance_histogram[n]` = verification steps that accepted n drafted tokens (n = 0 .. B-1);
        `speedup` = wall-clock of target-only greedy decoding / speculative decoding, both with a KV cache.
        """
        drafter, spec = load_drafter(drafter_dir, self.device)
        drafter.eval()
        if spec.vocab_size != self.head.embed_weight.shape[0]:
            raise ConfigError(
                f"drafter {drafter_dir} was built for a vocabulary of {spec.vocab_size}, "
                f"target.model has {self.head.embed_weight.shape[0]}"
            )
        if not self._warm:  # one short untimed run of each decoder: one-off start-up costs land in neither timing
            greedy_generate(self.target, self.encoded[0], 2, self.stops)
            speculative_generate(self.target, drafter, self.head, self.encoded[0], 2, self.stops)
            self._warm = True

        per_prompt, histogram = [], [0] * spec.block_size
        base_s = spec_s = 0.0
        emitted: list[int] = []
        steps: list[int] = []
        for index, ids in enumerate(progress(iterable=self.encoded, desc="eval", unit="prompt")):
            base = self._reference(index, max_new_tokens)
            fast = speculative_generate(self.target, drafter, self.head, ids, max_new_tokens, self.stops)
            base_s, spec_s = base_s + base.seconds, spec_s + fast.seconds
            for n in fast.accepted:
                histogram[n] += 1
            emitted.append(len(fast.tokens) - 1)
            steps.append(len(fast.accepted))
            per_prompt.append({
                "index": index,
                "prompt_tokens": ids.shape[1],
                "new_tokens": len(fast.tokens),
                "verify_steps": len(fast.accepted),
                "acceptance_length": fast.acceptance_length,
                "matches_target": fast.tokens == base.tokens,
                "target_s": round(base.seconds, 4),
                "speculative_s": round(fast.seconds, 4),
            })
        result = {
            "acceptance_length": sum(emitted) / sum(steps) if sum(steps) else None,
            "acceptance_stderr": _stderr(emitted, steps),
            "acceptance_histogram": histogram,
            "matches_target": all(p["matches_target"] for p in per_prompt),
            "speedup": base_s / spec_s if spec_s else None,
            "target_s": round(base_s, 4),
            "speculative_s": round(spec_s, 4),
            "block_size": spec.block_size,
            "max_new_tokens": max_new_tokens,
            "device": str(self.device),
            "prompts": per_prompt,
        }
        log.info(
            "eval: tau %.2f, speedup %.2fx, output %s the target's on %d prompts",
            result["acceptance_length"] or 0.0, result["speedup"] or 0.0,
            "matches" if result["matches_target"] else "DIFFERS from", len(per_prompt),
        )
        return result


def _stderr(emitted: list[int], steps: list[int]) -> float | None:
    """Standard error of tau over the prompts (tau is a ratio of sums and the prompts are the independent
    units): how far another set of prompts of this size could move it."""
    n, total = len(steps), sum(steps)
    if n < 2 or not total:
        return None
    tau = sum(emitted) / total
    residual = sum((e - tau * s) ** 2 for e, s in zip(emitted, steps, strict=True))
    return (n / (n - 1) * residual) ** 0.5 / total


def evaluate(
    cfg: Config, drafter_dir: str | Path, prompts: str | Path | list[Row], max_new_tokens: int
) -> dict[str, Any]:
    """One drafter on `prompts` (see `Evaluator.evaluate`)."""
    return Evaluator(cfg, prompts).evaluate(drafter_dir, max_new_tokens)
