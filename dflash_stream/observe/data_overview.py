"""`dflash-stream data`: prepare the data with the target's tokenizer alone (no model, no regeneration) and show
what each source keeps, why rows are skipped, how long samples are, and rendered samples with their supervised
spans marked: a look at the data before the GPUs start.

It writes OUTPUT/data/summary.json (`plan` can read it: samples after filtering, mean tokens per sample) and
nothing else; the run's own data reports are left alone.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from dflash_stream.config import Config, load_config
from dflash_stream.data.spec import data_spec_digest
from dflash_stream.rundir import RunDir, write_atomic
from dflash_stream.target_model.loading import load_tokenizer

SUPERVISED_OPEN, SUPERVISED_CLOSE = "⟦", "⟧"
"""How `--show` marks the tokens the drafter is trained on (the loss mask)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="what each data source keeps and why, sample lengths, rendered samples "
                                    "(tokenizer only: no model, no GPU)")
    p.add_argument("--config", required=True)
    p.add_argument("--show", type=int, default=0, metavar="N", help="print N rendered samples with the supervised "
                                                                     f"tokens between {SUPERVISED_OPEN} {SUPERVISED_CLOSE}")
    p.add_argument("--json", action="store_true", help="one JSON object: rows, kept, sources, tokens, samples")
    p.set_defaults(func=_data, overrides=[])


def _stats(values: list[int]) -> dict[str, Any]:
    if not values:
        return {"count": 0}
    a = np.asarray(values, dtype=np.float64)
    return {"count": len(values), "min": int(a.min()), "mean": round(float(a.mean()), 1),
            "p50": int(np.percentile(a, 50)), "p90": int(np.percentile(a, 90)), "max": int(a.max()),
            "total": int(a.sum())}


def marked_text(tokenizer, ids: np.ndarray, mask: np.ndarray) -> str:
    """The sample's text with each supervised run of tokens between the markers."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tokenizer.decode(ids[start:i].tolist())
            out.append(f"{SUPERVISED_OPEN}{text}{SUPERVISED_CLOSE}" if mask[start] else text)
            start = i
    return "".join(out)


def data_overview(cfg: Config, tokenizer, show: int = 0) -> dict[str, Any]:
    """The whole data as one shard would prepare it: counts per source, lengths, and `show` samples."""
    from dflash_stream.data.prepare import prepare_samples

    started = time.perf_counter()
    samples, report = prepare_samples(cfg, tokenizer, 0, 1)
    seconds = time.perf_counter() - started
    lengths = [s.num_tokens for s in samples]
    regenerate = cfg.data.regenerate
    if regenerate:
        # The target writes the responses; the dataset's own answers (up to max_new_tokens) stand in for them.
        # Prompt-only rows have no answer: they count the mean answer of the rows that have one.
        new = cfg.data.generation.max_new_tokens
        known = [s.reference_tokens for s in samples if s.reference_tokens]
        fallback = int(np.mean(known)) if known else new
        answers = [min(s.reference_tokens or fallback, new) for s in samples]
        estimate = [min(s.num_tokens + a, cfg.data.max_length) for s, a in zip(samples, answers, strict=True)]
        supervised = [e - s.num_tokens for s, e in zip(samples, estimate, strict=True)]
    else:
        estimate = lengths
        supervised = [int(s.loss_mask.sum()) for s in samples]
    overview: dict[str, Any] = {
        "rows": report.rows, "kept": report.kept,
        "sources": [{k: v for k, v in s.items()} for s in report.source_dicts()],
        "skipped": dict(report.skipped.most_common()),
        "truncated": report.truncated,
        "special_token_text": report.special_text,
        "regenerate": regenerate,
        "chat_template": cfg.data.chat_template and ("inline" if "{" in cfg.data.chat_template
                                                     else cfg.data.chat_template),
        "chat_template_kwargs": dict(cfg.data.chat_template_kwargs),
        "tokens": _stats(estimate),
        "supervised_tokens": _stats(supervised),
        "seconds": round(seconds, 2),
    }
    if regenerate:
        overview["prompt_tokens"] = _stats(lengths)
    overview["samples"] = [
        {"origin": s.origin, "tokens": s.num_tokens, "supervised": int(s.loss_mask.sum()),
         "text": marked_text(tokenizer, s.input_ids, s.loss_mask)}
        for s in samples[:show]
    ]
    return overview


def summary_for_plan(overview: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """OUTPUT/data/summary.json: what `plan` needs, and where it came from."""
    return {
        "samples": overview["kept"], "rows": overview["rows"],
        "mean_tokens": overview["tokens"].get("mean"),
        "mean_tokens_basis": ("prompts + the dataset's own answers capped at data.generation.max_new_tokens "
                              "(regeneration replaces them)" if overview["regenerate"] else "prepared samples"),
        "regenerate": overview["regenerate"], "max_length": cfg.data.max_length,
        # `plan` uses these counts only for a config that makes the same samples.
        "data_spec": data_spec_digest(cfg),
        "sources": [{k: s[k] for k in ("name", "rows", "kept", "skipped")} for s in overview["sources"]],
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def render_overview(o: dict[str, Any]) -> str:
    lines = [f"data: {o['rows']} rows, {o['kept']} kept, {o['rows'] - o['kept']} skipped "
             f"({o['truncated']} truncated to data.max_length; prepared in {o['seconds']} s)"]
    template = o["chat_template"] or "the target tokenizer's"
    kwargs = f" with {json.dumps(o['chat_template_kwargs'])}" if o["chat_template_kwargs"] else ""
    lines.append(f"chat template: {template}{kwargs}")
    width = max([len(s["name"]) for s in o["sources"]] + [6])
    lines.append(f"  {'source':<{width}}  {'rows':>8}  {'kept':>8}  {'kept %':>6}  skipped")
    for s in o["sources"]:
        share = f"{100 * s['kept'] / s['rows']:.0f}%" if s["rows"] else "-"
        skipped = ", ".join(f"{r} {n}" for r, n in s["skipped"].items()) or "-"
        flag = "  <- under half kept" if s["rows"] and s["kept"] < s["rows"] / 2 else ""
        lines.append(f"  {s['name']:<{width}}  {s['rows']:>8}  {s['kept']:>8}  {share:>6}  {skipped}{flag}")
        for reason, examples in s["examples"].items():
            lines.append(f"  {'':<{width}}    {reason}: {examples[0]}")
    if o["special_token_text"]:
        lines.append(f"{o['special_token_text']} kept rows spell a special token in their text: tokenized as text, "
                     "not as the control token")
    t, m = o["tokens"], o["supervised_tokens"]
    if t.get("count"):
        basis = " (prompt + the dataset's answer as a stand-in for the target's)" if o["regenerate"] else ""
        lines.append(f"tokens per sample{basis}: mean {t['mean']}, min {t['min']}, p50 {t['p50']}, p90 {t['p90']}, "
                     f"max {t['max']}; {t['total']} in all")
        lines.append(f"supervised tokens per sample: mean {m['mean']}, min {m['min']}, max {m['max']}")
    if o["regenerate"] and o.get("prompt_tokens", {}).get("count"):
        p = o["prompt_tokens"]
        lines.append(f"prompt tokens (data.regenerate: the target writes the answers): mean {p['mean']}, "
                     f"max {p['max']}")
    for s in o["samples"]:
        what = ("the prompt; the target writes the answer" if o["regenerate"]
                else f"{s['supervised']} supervised {SUPERVISED_OPEN}...{SUPERVISED_CLOSE}")
        lines += ["", f"--- {s['origin']}: {s['tokens']} tokens, {what}", s["text"]]
    return "\n".join(lines)


def _data(args: argparse.Namespace) -> int:
    from dflash_stream.log import setup_logging

    cfg = load_config(args.config, args.overrides)
    setup_logging()
    tokenizer = load_tokenizer(cfg.target)
    overview = data_overview(cfg, tokenizer, args.show)
    run = RunDir(cfg.output_dir)
    path = run.data / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(summary_for_plan(overview, cfg), indent=2))
    print(json.dumps(overview, indent=2, ensure_ascii=False) if args.json else render_overview(overview))
    if not args.json:
        print(f"\nsummary for `plan`: {path}")
    return 0 if overview["kept"] else 1
