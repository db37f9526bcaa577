"""`evaluate`: acceptance length, acceptance histogram and speedup of an exported drafter on held-out prompts, in our
own decoding loop and, with engine vllm or sglang, in that engine serving it as its DFlash speculator (`served.py`,
`served_sglang.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dflash_stream.config import EVAL_ENGINES, Config, ConfigError, served_engine
from dflash_stream.data.formats import RowError, split_for_regeneration, to_messages
from dflash_stream.data.template import ChatEncoder
from dflash_stream.drafter.export import load_drafter
from dflash_stream.drafter.head import TargetHead
from dflash_stream.drafter.model import DFlashDrafter
from dflash_stream.drafter.served import (
    ServedEval,
    histogram_figures,
    vllm_eval,
)
from dflash_stream.drafter.served_sglang import sglang_eval
from dflash_stream.drafter.speculative import (
    Generation,
    greedy_generate,
    replay_generate,
    speculative_generate,
)
from dflash_stream.log import get_logger, progress
from dflash_stream.target_model.loading import load_target, resolve_device, stop_token_ids

log = get_logger(__name__)

Row = dict[str, Any]
AGREEMENT = 0.02
"""Relative τ difference within which an engine agrees with ours (greedy on both sides, the same prompts)."""
ENGINE_NAMES = {"ours": "ours", "vllm": "vLLM", "sglang": "SGLang"}
"""How each of EVAL_ENGINES is named in log lines and tables."""
SPEEDUP_SLACK = 1.1
"""A speedup above τ by more than this factor (timing noise) cannot come from drafting: flagged as not
meaningful."""


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
        self.cfg = cfg
        self.target, tokenizer = load_target(cfg.target, self.device)
        self.tokenizer = tokenizer
        self.head = TargetHead.from_model(self.target)
        self.stops = stop_token_ids(self.target, tokenizer)
        self.encoded = [torch.tensor([render_prompt(tokenizer, row, cfg.data)], device=self.device) for row in rows]
        self._baseline: dict[tuple[int, int, int], Generation] = {}
        self._warm = False

    def _reference(self, index: int, max_new_tokens: int, block_size: int) -> Generation:
        key = (index, max_new_tokens, block_size)
        if key not in self._baseline:
            self._baseline[key] = greedy_generate(self.target, self.encoded[index], max_new_tokens, self.stops,
                                                  verify_block=block_size)
        return self._baseline[key]

    def evaluate(self, drafter_dir: str | Path, max_new_tokens: int, engine: str = "ours",
                 endpoint: str | None = None, workdir: str | Path | None = None) -> dict[str, Any]:
        """Greedy speculative decoding vs the target alone on each prompt; figures as a JSON-ready dict.

        `acceptance_length` (tau) = tokens emitted per target verification step over all prompts, and
        `acceptance_stderr` its standard error over the prompts;
        `acceptance_histogram[n]` = verification steps that accepted n drafted tokens (n = 0 .. B-1);
        `speedup` = wall-clock of target-only greedy decoding / speculative decoding, both with a KV cache and the
        target called the same way (`greedy_generate`'s verify_block), `speedup_note` why it is not meaningful
        when it is not; `engines`: each engine's τ counted as vLLM counts it (`served.acceptance_figures`), ours
        always, vLLM's with engine vllm (a local server from .venv-vllm, or `endpoint`, a server the user started
        with this drafter; local files under `workdir`), SGLang's with engine sglang (at `endpoint`).
        """
        if engine not in EVAL_ENGINES:
            raise ConfigError(f"eval.engine: '{engine}'; allowed: {', '.join(EVAL_ENGINES)}")
        try:
            served_engine(engine, endpoint)
        except ValueError as err:
            raise ConfigError(str(err)) from None
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
        runs: list[Generation] = []
        base_steps = 0
        for index, ids in enumerate(progress(iterable=self.encoded, desc="eval", unit="prompt")):
            base = self._reference(index, max_new_tokens, spec.block_size)
            base_steps += len(base.tokens)
            fast = speculative_generate(self.target, drafter, self.head, ids, max_new_tokens, self.stops)
            runs.append(fast)
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
                "accepted": sum(fast.accepted),
                "acceptance_length": fast.acceptance_length,
                "matches_target": fast.tokens == base.tokens,
                "target_s": round(base.seconds, 4),
                "speculative_s": round(fast.seconds, 4),
            })
        tau = sum(emitted) / sum(steps) if sum(steps) else None
        speedup = base_s / spec_s if spec_s else None
        new_tokens = sum(p["new_tokens"] for p in per_prompt)
        ours = {**histogram_figures(histogram),
                "new_tokens": new_tokens, "matches_target": all(p["matches_target"] for p in per_prompt),
                "seconds": round(spec_s, 4), "tokens_per_s": round(new_tokens / spec_s, 2) if spec_s else None,
                "target_tokens_per_s": round(new_tokens / base_s, 2) if base_s else None}
        result = {
            "acceptance_length": tau,
            "acceptance_stderr": _stderr(emitted, steps),
            "acceptance_histogram": histogram,
            "matches_target": ours["matches_target"],
            "speedup": speedup,
            "speedup_note": speedup_note(speedup, ours["acceptance_length"], spec.block_size),
            "target_s": round(base_s, 4),
            "speculative_s": round(spec_s, 4),
            "target_step_ms": round(1e3 * base_s / base_steps, 3) if base_steps else None,
            "verify_step_ms": round(1e3 * spec_s / (sum(steps) + len(per_prompt)), 3) if per_prompt else None,
            "block_size": spec.block_size,
            "max_new_tokens": max_new_tokens,
            "device": str(self.device),
            "prompts": per_prompt,
            "engines": {"ours": ours},
        }
        log.info(
            "eval: tau %.2f, speedup %.2fx%s, output %s the target's on %d prompts",
            tau or 0.0, speedup or 0.0, " (not meaningful)" if result["speedup_note"] else "",
            "matches" if result["matches_target"] else "DIFFERS from", len(per_prompt),
        )
        if engine != "ours":
            served = self.served(engine, drafter_dir, spec.block_size, max_new_tokens, endpoint, workdir)
            difference = relative_difference(served.get("acceptance_length"), ours["acceptance_length"])
            if difference is not None:
                served["relative_difference"] = difference
            result["engines"][engine] = served
            result["engines_agree"] = None if difference is None else abs(difference) <= AGREEMENT
            if "prompts" in served:
                same = result["same_answers"] = same_answers(per_prompt, served["prompts"], engine)
                log.info("eval: on the %d prompts both engines answered as the target: tau %s ours, %s %s",
                         len(same["prompts"]), *(f"{t:.3f}" if t else "-" for t in (same["ours"], same[engine])),
                         ENGINE_NAMES[engine])
                mirrored = result["on_engine_answers"] = self.on_engine_answers(drafter, engine, served, runs,
                                                                                max_new_tokens)
                if mirrored["replayed"]:
                    log.info("eval: %s", on_engine_answers_line(mirrored))
        return result

    def on_engine_answers(self, drafter: DFlashDrafter, engine: str, served: dict[str, Any], runs: list[Generation],
                          max_new_tokens: int) -> dict[str, Any]:
        """Our τ on the engine's own answers, beside the engine's: where its answer parts from our loop's (a
        near-tie its kernels round the other way, bf16 targets above all), our drafter is replayed on its answer
        (`replay_generate`), so both τ are drafted on the same text and any difference left is the engine's
        drafting, not the target's kernels."""
        histogram, replayed = [0] * drafter.spec.block_size, 0
        for index, (row, ours) in enumerate(zip(served["prompts"], runs, strict=True)):
            if row["answer"] != ours.tokens:
                ours = replay_generate(self.target, drafter, self.head, self.encoded[index], row["answer"],
                                       max_new_tokens, self.stops)
                replayed += 1
            for n in ours.accepted:
                histogram[n] += 1
        mine = histogram_figures(histogram)
        difference = relative_difference(served["acceptance_length"], mine["acceptance_length"])
        return {"engine": engine, "prompts": len(runs), "replayed": replayed, "ours": mine,
                engine: {k: served[k] for k in ("acceptance_length", "per_position", "drafts", "accepted_tokens")},
                "relative_difference": difference,
                "agree": None if difference is None else abs(difference) <= AGREEMENT}

    def served(self, engine: str, drafter_dir: str | Path, block_size: int, max_new_tokens: int,
               endpoint: str | None, workdir: str | Path | None) -> dict[str, Any]:
        """The same prompts, budget and greedy decoding in `engine` serving the drafter (`served.vllm_eval`,
        `served_sglang.sglang_eval`)."""
        job = ServedEval(self.cfg.target, self.tokenizer, [ids[0].tolist() for ids in self.encoded],
                         [self._reference(i, max_new_tokens, block_size).tokens for i in range(len(self.encoded))],
                         self.stops, self.target)
        if engine == "sglang":
            entry = sglang_eval(job, endpoint, block_size, max_new_tokens)
        else:
            entry = vllm_eval(job, drafter_dir, block_size, max_new_tokens, endpoint,
                              workdir or Path(self.cfg.output_dir) / "engines")
        if "acceptance_length" in entry:
            log.info("eval: %s tau %.3f (%d drafts, %d accepted), %d of %d answers as the target's",
                     ENGINE_NAMES[engine], entry["acceptance_length"] or 0.0, entry["drafts"],
                     entry["accepted_tokens"], entry["answers_as_target"], len(job.prompts))
        return entry


def speedup_note(speedup: float | None, tau: float | None, block_size: int) -> str | None:
    """Why a measured speedup says nothing about the drafter, or None. Verifying a block costs at least a one-token
    step, so drafting gives at most τ; more means a one-token call costs more than a block's on this device and
    build (per-call overhead: docs/engines.md)."""
    if speedup is None or tau is None or speedup <= tau * SPEEDUP_SLACK:
        return None
    return (f"not meaningful: {speedup:.2f}x exceeds tau {tau:.2f}, the most drafting can give; a one-token forward "
            f"of this target costs more than a {block_size}-token one here (per-call overhead)")


def same_answers(ours: list[dict[str, Any]], served: list[dict[str, Any]], engine: str = "vllm") -> dict[str, Any]:
    """Both engines' τ over the prompts both answered as the target's own greedy answer. Where an engine's answer
    parts from it (a near-tie its kernels round the other way: bf16 targets), the drafter drafts on another text,
    and the two τ compare texts as much as engines; on the same answers they compare the engines alone."""
    both = [o["index"] for o, s in zip(ours, served, strict=True) if o["matches_target"] and s["as_target"]]
    taus = {}
    for name, rows in (("ours", ours), (engine, served)):
        drafts = sum(rows[i]["verify_steps"] for i in both)
        taus[name] = 1 + sum(rows[i]["accepted"] for i in both) / drafts if drafts else None
    return {"engine": engine, "prompts": both, **taus,
            "relative_difference": relative_difference(taus[engine], taus["ours"])}


def same_answers_line(same: dict[str, Any] | None, prompts: int) -> str | None:
    """`same_answers` in one line, when some answers parted from the target's (else it says nothing new)."""
    if not same or len(same["prompts"]) >= prompts:
        return None
    engine = same.get("engine", "vllm")
    taus = ("-" if t is None else f"{t:.3f}" for t in (same["ours"], same[engine]))
    return "on the {} prompts both engines answered as the target: tau {} ours, {} {}".format(
        len(same["prompts"]), *taus, ENGINE_NAMES[engine])


def on_engine_answers_line(mirrored: dict[str, Any] | None) -> str | None:
    """`on_engine_answers` in one line, when some prompt was replayed (else the engine table says it all)."""
    if not mirrored or not mirrored["replayed"]:
        return None
    engine = mirrored["engine"]
    taus = ("-" if t is None else f"{t:.3f}" for t in (mirrored["ours"]["acceptance_length"],
                                                        mirrored[engine]["acceptance_length"]))
    difference = mirrored["relative_difference"]
    within = "" if difference is None else f" ({100 * difference:+.2f} %, within 2 %: {mirrored['agree']})"
    return "on {}'s own answers ({} of {} prompts replayed): tau {} ours, {} {}{}".format(
        ENGINE_NAMES[engine], mirrored["replayed"], mirrored["prompts"], *taus, ENGINE_NAMES[engine], within)


def run_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of an eval result that the run summary (summary.json's `eval`) carries: our τ, and where an
    engine served the drafter (`eval.endpoint`) its τ beside ours, on its own answers too when some were replayed,
    so that the run's closing figures are the ones the user's engine gives."""
    fields = {k: result[k] for k in ("acceptance_length", "matches_target", "speedup") if k in result}
    for engine, served in result.get("engines", {}).items():
        if engine != "ours":
            fields["engine"] = {"name": engine, "acceptance_length": served.get("acceptance_length"),
                                "relative_difference": served.get("relative_difference"),
                                "agree": result.get("engines_agree"),
                                **({"error": served["error"]} if "error" in served else {})}
    mirrored = result.get("on_engine_answers")
    if mirrored and mirrored["replayed"]:
        fields["on_engine_answers"] = {"replayed": mirrored["replayed"], "prompts": mirrored["prompts"],
                                       "ours": mirrored["ours"]["acceptance_length"],
                                       mirrored["engine"]: mirrored[mirrored["engine"]]["acceptance_length"],
                                       "relative_difference": mirrored["relative_difference"],
                                       "agree": mirrored["agree"]}
    return fields


def relative_difference(tau: float | None, ours: float | None) -> float | None:
    """An engine's τ relative to ours (0.01 = 1 % higher); None when either has none."""
    return None if tau is None or not ours else round(tau / ours - 1, 5)


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
    cfg: Config, drafter_dir: str | Path, prompts: str | Path | list[Row], max_new_tokens: int,
    engine: str = "ours", endpoint: str | None = None, workdir: str | Path | None = None,
) -> dict[str, Any]:
    """One drafter on `prompts` (see `Evaluator.evaluate`)."""
    return Evaluator(cfg, prompts).evaluate(drafter_dir, max_new_tokens, engine, endpoint, workdir)
