"""Regeneration through serving engines (data.generation.engine: openai): the target's answers to the prompts of
the data, from the servers at data.generation.endpoints, into the response cache.

`dflash-stream regenerate` runs the phase on its own; `run` and `extract` run it in each extractor, for its shard,
in a background thread, and extract every window of samples as soon as its answers are in: the servers' GPUs
generate while the launch's GPUs extract and train.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from dflash_stream.config import Config, ConfigError, load_config
from dflash_stream.data import PreparedSample
from dflash_stream.log import get_logger, progress
from dflash_stream.regenerate.cache import ResponseCache, answers_key, describe_other_caches, regenerate_part
from dflash_stream.regenerate.client import Answer, CompletionClient, Prompt
from dflash_stream.rundir import RunDir, write_atomic

log = get_logger(__name__)

PROGRESS_EVERY_S = 2.0
"""How often the phase reports its progress (an extractor writes it to its metrics for `status`)."""


def answer_budget(cfg: Config, prompt_tokens: int) -> int:
    """New tokens a prompt may get: data.generation.max_new_tokens, within data.max_length."""
    return max(1, min(cfg.data.generation.max_new_tokens, cfg.data.max_length - prompt_tokens))


class ServerRegenerator:
    """Asks the servers for the answers the cache lacks, in a background thread, and lets callers wait for some."""

    def __init__(self, cfg: Config, tokenizer, cache: ResponseCache, stop_ids: set[int],
                 concurrency: int | None = None, on_progress: Callable[[dict[str, Any]], None] | None = None
                 ) -> None:
        self.cfg, self.cache, self.on_progress = cfg, cache, on_progress
        self._reported = 0.0
        self.client = CompletionClient(cfg.data.generation, tokenizer, stop_ids, concurrency, target=cfg.target.model,
                                       max_length=cfg.data.max_length)
        self._ready = threading.Condition()
        self._asked: set[int] = set()
        self._answered: set[int] = set()
        self.counts: Counter[str] = Counter()
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None
        self._bar = None
        self._started = self._ended = 0.0

    def start(self, samples: list[PreparedSample]) -> int:
        """Ask, in this order, for the answers of `samples` the cache lacks; returns how many are asked."""
        todo = [s for s in samples if s.sample_id not in self.cache]
        self._asked = {s.sample_id for s in todo}
        prompts = [Prompt(s.sample_id, s.input_ids.tolist(), answer_budget(self.cfg, s.num_tokens)) for s in todo]
        if todo:
            urls = ", ".join(self.cfg.data.generation.endpoints)
            log.info("regeneration: %d answers to ask for (%d already in the cache) from %s, %d in flight per "
                     "endpoint", len(todo), len(samples) - len(todo), urls, self.client.concurrency)
            self._bar = progress(total=len(todo), unit="answer", desc="regenerate")
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(prompts,), name="regenerate", daemon=True)
        self._thread.start()
        return len(todo)

    def wait(self, sample_ids: list[int], stop_when: Callable[[], bool] | None = None) -> bool:
        """Block until each of `sample_ids` has an answer in the cache or an error (True), or `stop_when()` says
        to stop waiting (False); raises the phase's error."""
        with self._ready:
            while True:
                if self._fatal is not None:
                    raise self._fatal
                waiting = [i for i in sample_ids if i in self._asked and i not in self._answered]
                if not waiting or self._thread is None or not self._thread.is_alive():
                    break
                if stop_when is not None and stop_when():
                    return False
                self._ready.wait(timeout=1.0)
        if self._fatal is not None:
            raise self._fatal
        return True

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._fatal is not None:
            raise self._fatal

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self.cache.close()

    def _run(self, prompts: list[Prompt]) -> None:
        try:
            self.client.run(prompts, self._take)
        except BaseException as err:  # handed to the waiting thread
            self._fatal = err
        finally:
            self._ended = time.monotonic()
            self.cache.sync()
            with self._ready:
                self._ready.notify_all()

    def _take(self, answer: Answer) -> None:
        if answer.tokens is None:  # the client logged why
            self.counts["errors"] += 1
        else:
            self.cache.add({answer.key: answer.tokens}, {answer.key: answer.finish}, sync=False)
            self.counts["answers"] += 1
            self.counts["tokens"] += len(answer.tokens)
            self.counts["truncated"] += answer.finish == "length"
            self.counts["from_text"] += answer.from_text
            self.counts["retokenize_differs"] += answer.retokenize_differs
        with self._ready:
            self._answered.add(answer.key)
            self._ready.notify_all()
        now = time.monotonic()
        if self.on_progress is not None and (now - self._reported >= PROGRESS_EVERY_S
                                             or len(self._answered) == len(self._asked)):
            self._reported = now
            self.on_progress(self.progress())
        if self._bar is not None:
            elapsed = max(time.monotonic() - self._started, 1e-9)
            self._bar.set_postfix_str(f"{self.counts['tokens'] / elapsed:,.0f} tok/s"
                                      + (f", {self.counts['errors']} errors" if self.counts["errors"] else ""),
                                      refresh=False)
            self._bar.update(1)

    def progress(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        return {"asked": len(self._asked), "answered": len(self._answered), "tokens": self.counts["tokens"],
                "errors": self.counts["errors"], "tok_s": round(self.counts["tokens"] / elapsed, 1)}

    def summary(self) -> dict[str, Any]:
        seconds = (self._ended or time.monotonic()) - self._started if self._started else 0.0
        return {
            "asked": len(self._asked), "answers": self.counts["answers"], "tokens": self.counts["tokens"],
            "truncated": self.counts["truncated"], "errors": self.counts["errors"],
            "from_text": self.counts["from_text"], "retokenize_differs": self.counts["retokenize_differs"],
            "seconds": round(seconds, 2), "tokens_per_s": round(self.counts["tokens"] / max(seconds, 1e-9), 1),
            "endpoints": {ep.url: ep.stats() for ep in self.client.endpoints},
        }


def summary_lines(summary: dict[str, Any]) -> list[str]:
    s = summary
    lines = [f"regeneration: {s['answers']:,} answers, {s['tokens']:,} tokens in {s['seconds']:.1f} s "
             f"({s['tokens_per_s']:,.0f} tok/s); {s['truncated']:,} cut at data.generation.max_new_tokens, "
             f"{s['errors']:,} errors"]
    if s["from_text"]:
        lines.append(f"  {s['from_text']:,} answers came as text (the server returns no token ids) and were "
                     "tokenized with the target's tokenizer")
    if s["retokenize_differs"]:
        lines.append(f"  {s['retokenize_differs']:,} answers' ids differ from their text tokenized again: a "
                     "text-only server would have trained the drafter on other tokens there")
    for url, ep in s["endpoints"].items():
        malformed = f", {ep['malformed']} malformed" if ep.get("malformed") else ""
        dropped = f"; left the phase: {ep['dropped']}" if ep.get("dropped") else ""
        lines.append(f"  {url}: {ep['answers']:,} answers, {ep['tokens']:,} tokens, {ep['errors']} errors{malformed}, "
                     f"{ep['outages']} outages ({ep['dialect']}){dropped}")
    return lines


def regenerate_command(args: argparse.Namespace) -> int:
    from dflash_stream.data.prepare import prepare_samples
    from dflash_stream.log import setup_logging
    from dflash_stream.target_model.loading import load_tokenizer, target_stop_ids

    cfg = load_config(args.config, args.overrides)
    setup_logging("regenerate", 0, show_bar=True)
    if not cfg.data.regenerate:
        raise ConfigError("data.regenerate: false, so there is nothing to regenerate; set it to true")
    if cfg.data.generation.engine != "openai":
        raise ConfigError("data.generation.engine: hf regenerates inside the extractors of `run`; `regenerate` "
                          "asks servers: set engine openai and data.generation.endpoints")
    tokenizer = load_tokenizer(cfg.target)
    samples, report = prepare_samples(cfg, tokenizer, 0, 1)
    log.info(report.summary())
    stop_ids = target_stop_ids(cfg.target, tokenizer)
    key = answers_key(cfg, tokenizer, stop_ids)
    other = describe_other_caches(cfg.output_dir, key)
    if other:
        log.warning("%s", other)
    cache = ResponseCache(cfg.output_dir, key, regenerate_part())
    regen = ServerRegenerator(cfg, tokenizer, cache, stop_ids)
    regen.start(samples)
    try:
        regen.join()
    finally:
        regen.close()
    summary = regen.summary()
    missing = [s.sample_id for s in samples if s.sample_id not in cache]
    short = sum(1 for s in samples if s.sample_id in cache and int(
        s.with_response(cache.get(s.sample_id), cfg.data.max_length).loss_mask.sum()) < cfg.min_supervised_tokens)
    summary.update(samples=len(samples), missing=len(missing), short=short)
    path = RunDir(cfg.output_dir).data / "regenerate.json"
    write_atomic(path, json.dumps(summary, indent=2) + "\n", durable=True)
    for line in summary_lines(summary):
        log.info(line)
    if short:
        log.info("%d answers are shorter than the %d supervised tokens a sample needs: extraction leaves them out",
                 short, cfg.min_supervised_tokens)
    if missing:
        log.error("%d of %d samples have no answer yet (first: %s); run again to ask for them", len(missing),
                  len(samples), missing[:5])
        return 1
    log.info("every one of the %d samples has its answer; summary in %s", len(samples), path)
    return 0


def register(sub) -> None:
    parser = sub.add_parser("regenerate", help="have serving engines answer the data's prompts (engine: openai), "
                                               "resumable; `run` then extracts from the cached answers")
    parser.add_argument("--config", required=True, help="run config (YAML); --section.key=value overrides follow")
    parser.set_defaults(func=regenerate_command, overrides=[])
