"""`dflash-stream bench quality`: is a drafter trained from the bounded stream as good as one trained offline?

The data are extracted once (the real target, responses regenerated) into a kept store whose budget holds all
of it, and the held-out prompts likewise into a second one. Every variant is then a real `dflash-stream run`
that replays the kept store (`extract.from_store`) into a store of its own budget, codec and epoch order, with
the same seeds and the same number of optimizer steps, so the variants differ only in what they are meant to:

- `offline`: budget above the whole dump, and every epoch a fresh shuffle of all samples (epoch_source reextract);
- `streamed`: the ring buffer at 10 % of the dump, epoch_source reuse (the default);
- `reextract`: the ring buffer at 10 %, every epoch a fresh shuffle replayed again;
- `fp8`: as streamed, coded in fp8 (its budget 10 % of its own, smaller, dump);
- `streamed+kl`: as streamed, trained with train.loss kl (KL to the target's own distribution, from the verifier's
  state the kept store then holds for every variant: extract.verifier_states on);
- `dflash2`: as streamed, a DFlash2 drafter (drafter.kind dflash2: convolutions and the candidate selector).

Each exported drafter is scored the same way on the held-out samples' states: the decay-weighted loss and the
per-slot accuracy over every eligible anchor (no sampling, so the score has no noise of its own), and the
acceptance length tau of `eval` on every held-out prompt (the target loaded once in this process, its own
greedy outputs computed once for all drafters). The held-out loss is the head's cross-entropy on the data for
every variant (whatever it trained on; a DFlash2 drafter's selector loss left out), the accuracy the drafter's own
pick (a DFlash2 drafter's: the selector's). The window sweep trains `streamed` at other budgets.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_stream.config import Config, config_from_dict, dump_config, load_config
from dflash_stream.errors import DFlashError

VARIANTS = ("offline", "streamed", "reextract", "fp8", "streamed+kl", "dflash2")
NEEDS_VERIFIER = frozenset({"streamed+kl"})
"""Variants whose training reads the verifier's state: with any of them the kept stores hold it."""
STREAMED_LIKE = ("streamed+kl", "dflash2")
"""Variants that differ from `streamed` in one thing each, judged against it too."""
STREAMED_FRACTION = 0.1
SWEEP = (0.1, 0.02)
OFFLINE_HEADROOM = 1.25
"""The offline variant's budget over the dump: all of it fits, and the next epoch's first segments beside it."""
HELDOUT_PROMPTS = "dflash_stream/demo_data/heldout_prompts.jsonl"
HELDOUT_COPIES = 4
"""Sampled responses per held-out prompt: the held-out states the loss is measured on."""
STEP_MARGIN = 0.97
"""Every variant stops at this share of the fewest steps its data can give, so all take the same number."""


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quality", help="held-out loss and tau of drafters trained offline vs from the bounded stream")
    p.add_argument("--config", default="configs/quality.yaml", help="base run config of every variant")
    p.add_argument("--keep", metavar="DIR", help="keep everything here: DIR/<variant>/drafter/ and config.yaml, the "
                   "kept dump (reused by a later run with the same DIR), the window-sweep PNG")
    p.add_argument("--seeds", type=int, default=2, help="training seeds per variant (the spread is over them)")
    p.add_argument("--sweep", default=",".join(map(str, SWEEP)),
                   help="budget fractions of the dump for the window sweep (of the streamed variant)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="which variants to train")
    p.add_argument("--png", help="where the window-sweep plot goes (default DIR/window_sweep.png with --keep, else "
                   "bench-quality-window.png)")
    p.add_argument("--jobs", type=int, default=2, help="training runs at once, each on cores/jobs threads: on a "
                   "small CPU two one-thread runs train faster than one two-thread run (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=bench_quality, overrides=[])


def say(message: str) -> None:
    print(f"[bench quality] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ configs


def _config(base: Config, out: Path, **sections: dict[str, Any]) -> Config:
    """`base` with its output and store under `out` and the given keys of each section replaced."""
    tree = base.model_dump(mode="json")
    tree["output_dir"] = str(out)
    tree["store"]["path"] = str(out / "store")
    for section, values in sections.items():
        tree[section].update(values)
    if tree["train"]["epoch_source"] == "reextract":
        tree["store"]["reuse"] = 1
    elif tree["store"]["reuse"] == 1:
        tree["store"]["reuse"] = tree["train"]["epochs"]
    return config_from_dict(tree)


def _launch(command: str, cfg: Config, threads: int | None = None) -> float:
    """`dflash-stream COMMAND --config OUT/config.yaml` as a user runs it, on `threads` CPU threads (default: all
    cores); its output goes to OUT/COMMAND.log."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(dump_config(cfg))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    started = time.monotonic()
    with open(out / f"{command}.log", "w") as log:
        code = subprocess.call([sys.executable, "-m", "dflash_stream", command, "--config", str(path)],
                               stdout=log, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        tail = (out / f"{command}.log").read_text().splitlines()[-15:]
        raise DFlashError(f"`dflash-stream {command}` for {out} exited with {code}:\n" + "\n".join(tail))
    return time.monotonic() - started


def _extract_once(cfg: Config) -> Path:
    """The kept store of `cfg`, extracted now unless a finished one is there already."""
    from dflash_stream.store import Store

    store = Path(cfg.store.path)
    if (store / "store.json").is_file() and Store.attach(store).end_of_data:
        say(f"reusing the kept store {store}")
        return store
    say(f"extracting into the kept store {store} (the target regenerates the responses)")
    seconds = _launch("extract", cfg)
    say(f"extracted in {seconds:.0f} s")
    return store


# ------------------------------------------------------------------------------------------------ the data


@dataclass
class Dump:
    """What the bench needs to know of a kept store: its size in each codec, its samples' token counts, and the
    held-out scoring set's states when it is the held-out one."""

    path: Path
    bytes: dict[str, int]
    """Bytes of its first pass in each codec asked for: as stored, or encoded here in memory as the store would
    write them (whole blocks per file, one per directory, as `du` counts them)."""
    samples: list  # StoredSample, states dropped unless kept

    @classmethod
    def read(cls, path: Path, keep_states: bool, codecs: tuple[str, ...] = ()) -> Dump:
        from dflash_stream.pipeline.replay import as_sample
        from dflash_stream.store import Store, StoredSample
        from dflash_stream.store.segment import encode_segment, read_segment

        store = Store.attach(path)
        infos = sorted((i for i in store.published() if i.pass_index == 0), key=lambda i: i.segment_id)
        coded = {store.codec: sum(i.bytes for i in infos), **{c: 0 for c in codecs if c != store.codec}}
        samples = []
        for info in infos:
            stored = read_segment(info.segment_id, path / "segments" / info.segment_id)
            for codec in coded.keys() - {store.codec}:
                files = encode_segment([as_sample(s) for s in stored], codec, store.layer_ids, store.hidden_size)
                dirs = {"", *(key.rpartition("/")[0] for key in files)}
                coded[codec] += sum(-(-len(data) // store.block) * store.block for data in files.values())
                coded[codec] += len(dirs) * store.block
            for s in stored:
                states = s.hidden_states.clone() if keep_states else torch.empty(0)
                samples.append(StoredSample(s.sample_id, s.input_ids, s.loss_mask, states))
        return cls(path, coded, samples)


def natural_steps(cfg: Config, samples: list) -> int:
    """Optimizer steps the trainer's batcher cuts from `samples` in extraction order, every epoch: the fewest
    any variant takes (smaller windows leave more batches part-filled)."""
    from dflash_stream.drafter.batches import TokenBatcher
    from dflash_stream.drafter.shapes import ShapePlan

    batcher = TokenBatcher(ShapePlan.from_config(cfg))
    batches = 0
    for epoch in range(cfg.train.epochs):
        for i in range(0, len(samples), 8):
            batcher.add(f"{epoch}.{i}", samples[i:i + 8])
            while batcher.full_batch_ready():
                batcher.next_batch()
                batches += 1
    while batcher.next_batch():
        batches += 1
    return max(1, batches // cfg.train.grad_accum)


def unigram_loss(train: list, heldout: list) -> float:
    """Held-out cross-entropy of the training responses' token frequencies (add-one smoothed), over the
    positions the drafter is scored on: the level a drafter that ignores its context would reach."""
    ids = torch.cat([s.input_ids[s.loss_mask] for s in train])
    vocab = int(max(ids.max(), max(int(s.input_ids.max()) for s in heldout))) + 1
    counts = torch.bincount(ids, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    labels = torch.cat([s.input_ids[1:][s.loss_mask[1:] & s.loss_mask[:-1]] for s in heldout])
    return float(-logp[labels].mean())


# ------------------------------------------------------------------------------------------------ scoring


def heldout_score(drafter_dir: Path | None, head, heldout: list, cfg: Config) -> dict[str, Any]:  # noqa: ANN001
    """Decay-weighted loss and per-slot accuracy of a drafter (None: untrained, seeded) on every eligible
    anchor of the held-out samples; deterministic, the same for every variant."""
    from dflash_stream.drafter import DFlashDrafter, build_spec, dflash_loss
    from dflash_stream.drafter.batches import Member, collate
    from dflash_stream.drafter.export import load_drafter
    from dflash_stream.drafter.loss import Objective
    from dflash_stream.target_model import resolve_layer_ids, target_shape

    if drafter_dir is None:
        target = target_shape(cfg.target, count=False)
        torch.manual_seed(0)
        spec = build_spec(cfg, target, resolve_layer_ids(target.num_layers, cfg.target))
        drafter = DFlashDrafter(spec, attention="sdpa")
    else:
        drafter, spec = load_drafter(drafter_dir, "cpu")
    drafter.eval()
    # The cross-entropy on the data, whatever the variant trained on: the one objective every drafter can be
    # scored by (a DFlash2 drafter's selector loss left out; its accuracy is still its selector's pick).
    cross_entropy = Objective(ce_weight=1.0, kl_weight=0.0, selector_weight=0.0)
    ordered = sorted(heldout, key=lambda s: len(s.input_ids))
    loss_sum = weight = 0.0
    correct = torch.zeros(spec.block_size - 1)
    count = torch.zeros(spec.block_size - 1)
    with torch.no_grad():
        start = 0
        while start < len(ordered):
            end = start + 1
            while end < len(ordered) and (end + 1 - start) * len(ordered[end].input_ids) <= cfg.train.batch_tokens:
                end += 1
            batch = collate([Member("heldout", s) for s in ordered[start:end]], torch.device("cpu"))
            out = dflash_loss(drafter, head, batch, num_anchors=cfg.data.max_length, gamma=cfg.train.gamma,
                              generator=torch.Generator().manual_seed(0), chunk_rows=cfg.train.loss_chunk_rows,
                              objective=cross_entropy)
            loss_sum += float(out.loss * out.weight)
            weight += float(out.weight)
            correct += out.correct
            count += out.count
            start = end
    return {"loss": loss_sum / weight, "acc": (correct / count.clamp_min(1)).tolist()}


# ------------------------------------------------------------------------------------------------ the runs


@dataclass
class Run:
    name: str
    """Variant name, or `window-<fraction>` for a sweep point."""
    seed: int
    fraction: float
    """Budget over the dump in the run's own codec."""
    train: dict[str, Any]
    store: dict[str, Any]
    evaluate: bool
    drafter: dict[str, Any] = field(default_factory=dict)

    @property
    def folder(self) -> str:
        return self.name if self.seed == 0 else f"{self.name}-seed{self.seed}"


def plan_runs(variants: list[str], seeds: int, sweep: list[float]) -> list[Run]:
    runs = []
    for seed in range(seeds):
        for v in variants:
            source = "reextract" if v in ("offline", "reextract") else "reuse"
            fraction = OFFLINE_HEADROOM if v == "offline" else STREAMED_FRACTION
            runs.append(Run(v, seed, fraction, {"epoch_source": source, "seed": seed,
                                                **({"loss": "kl"} if v == "streamed+kl" else {})},
                            {"codec": "fp8" if v == "fp8" else "lossless"}, evaluate=True,
                            drafter={"kind": "dflash2"} if v == "dflash2" else {}))
    for seed in range(seeds):
        for f in sweep:
            if not (math.isclose(f, STREAMED_FRACTION) and "streamed" in variants):
                runs.append(Run(f"window-{f:g}", seed, f, {"epoch_source": "reuse", "seed": seed},
                                {"codec": "lossless"}, evaluate=False))
    return runs


def _train(run: Run, base: Config, work: Path, kept: Path, budget: int, steps: int, threads: int | None
           ) -> dict[str, Any]:
    """One variant as a user runs it: `dflash-stream run` replaying the kept store."""
    out = work / run.folder
    shutil.rmtree(out, ignore_errors=True)
    cfg = _config(base, out, extract={"from_store": str(kept)},
                  store={**run.store, "budget": budget}, drafter=run.drafter,
                  train={**run.train, "total_steps": steps, "max_steps": steps},
                  eval={"prompts": None})  # tau: the bench's Evaluator, once the drafter is out
    seconds = _launch("run", cfg, threads)
    summary = json.loads((out / "summary.json").read_text())

    shutil.rmtree(out / "store", ignore_errors=True)  # what is left of it: the summary counts it
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return {"seconds": seconds, "summary": summary, "budget_bytes": budget, "drafter": out / "drafter"}


def _spread(values: list[float]) -> float:
    return max(values) - min(values) if len(values) > 1 else 0.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def bench_quality(args: argparse.Namespace) -> int:
    from dflash_stream.drafter.evaluate import Evaluator
    from dflash_stream.store import sizes

    started = time.monotonic()
    temporary = args.keep is None
    work = Path(tempfile.mkdtemp(prefix="dflash-quality-")) if temporary else Path(args.keep)
    work.mkdir(parents=True, exist_ok=True)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise DFlashError(f"--variants: unknown {unknown}; allowed: {', '.join(VARIANTS)}")
    verifier = bool(NEEDS_VERIFIER & set(variants))
    # One stream for every variant: with a KL variant the kept stores hold the verifier's state for all of them
    # (in folders of their own, so a kept dump without it is not replayed into runs that need it).
    base = load_config(args.config, [*args.overrides, *(["--extract.verifier_states=on"] if verifier else [])])
    dumps = "+verifier" if verifier else ""
    sweep = [float(f) for f in args.sweep.split(",") if f]
    if args.seeds < 1 or args.jobs < 1 or any(not 0 < f <= 1 for f in sweep):
        raise DFlashError("--seeds and --jobs must be >= 1 and --sweep fractions in (0, 1]")
    try:
        kept = _extract_once(_config(base, work / f"dump{dumps}"))
        heldout_cfg = _config(base, work / f"heldout{dumps}",
                              data={"sources": [{"path": HELDOUT_PROMPTS, "weight": HELDOUT_COPIES}]})
        heldout_store = _extract_once(heldout_cfg)

        dump = Dump.read(kept, keep_states=False, codecs=("lossless", "fp8"))
        heldout = Dump.read(heldout_store, keep_states=True).samples
        steps = max(1, int(natural_steps(base, dump.samples) * STEP_MARGIN))
        codec_bytes = dump.bytes
        evaluator = Evaluator(base, base.eval.prompts or HELDOUT_PROMPTS)
        head = evaluator.head
        tokens = sum(len(s.input_ids) for s in dump.samples)
        say(f"dump: {len(dump.samples)} samples, {tokens:,} tokens, {codec_bytes['lossless']:,} bytes in the store "
            f"(fp8: {codec_bytes['fp8']:,}); held-out: {len(heldout)} samples; {steps} optimizer steps per run")
        unigram = unigram_loss(dump.samples, heldout)
        untrained = heldout_score(None, head, heldout, base)

        results: dict[str, list[dict[str, Any]]] = {}
        runs = plan_runs(variants, args.seeds, sweep)
        smallest = {codec: sizes.smallest_budget(work, sizes.max_segment_raw_bytes(
            int(base.store.segment_bytes), base.data.max_length, _width(kept)), _width(kept), codec)
            for codec in codec_bytes}
        budgets = [max(int(run.fraction * codec_bytes[run.store["codec"]]), smallest[run.store["codec"]])
                   for run in runs]
        threads = max(1, (os.cpu_count() or 1) // args.jobs)
        torch.set_num_threads(threads)  # this process scores and evaluates beside the runs
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = {}
            for n, (run, budget) in enumerate(zip(runs, budgets, strict=True), 1):
                codec = run.store["codec"]
                say(f"[{n}/{len(runs)}] {run.folder}: budget {budget:,} bytes ({budget / codec_bytes[codec]:.1%} of "
                    f"the {codec} dump), {run.train['epoch_source']}" + (" (queued)" if n > args.jobs else ""))
                futures[pool.submit(_train, run, base, work, kept, budget, steps, threads)] = run
            # Each finished run is scored here while the next ones train.
            for future in as_completed(futures):
                run, result = futures[future], future.result()
                score = heldout_score(result["drafter"], head, heldout, base)
                tau = tau_stderr = None
                if run.evaluate:
                    found = evaluator.evaluate(result["drafter"], base.eval.max_new_tokens)
                    (work / run.folder / "eval.json").write_text(json.dumps(found, indent=2))
                    tau, tau_stderr = found["acceptance_length"], found["acceptance_stderr"]
                say(f"{run.folder}: {result['seconds']:.0f} s, {result['summary']['steps']} steps: held-out loss "
                    f"{score['loss']:.4f}" + (f", tau {tau:.3f} +- {tau_stderr:.3f}" if tau is not None else ""))
                results.setdefault(run.name, []).append({
                    **result, **score, "seed": run.seed, "tau": tau, "tau_stderr": tau_stderr,
                    "fraction": run.fraction, "dump_bytes": codec_bytes[run.store["codec"]]})
        for rs in results.values():
            rs.sort(key=lambda r: r["seed"])
        # Nominal, as `plan` counts it (padding makes real batches hold fewer): the window in optimizer steps.
        samples_per_step = base.train.batch_tokens * base.train.grad_accum / (tokens / len(dump.samples))
        report = _report(results, variants, sweep, steps, unigram, untrained, args.seeds,
                         len(dump.samples), len(heldout), started, samples_per_step)
        png = Path(args.png) if args.png else (work / "window_sweep.png" if not temporary
                                               else Path("bench-quality-window.png"))
        _plot(report, png)
        report["png"] = str(png)
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print("\n".join(_table(report)))
    return 0


def _width(kept: Path) -> int:
    from dflash_stream.store import Store

    return Store.attach(kept).width


def _report(results: dict[str, list[dict[str, Any]]], variants: list[str], sweep: list[float], steps: int,
            unigram: float, untrained: dict[str, Any], seeds: int, samples: int, heldout: int,
            started: float, samples_per_step: float) -> dict[str, Any]:
    out: dict[str, Any] = {"variants": {}}
    for v in variants:
        rs = results[v]
        losses = [r["loss"] for r in rs]
        taus = [r["tau"] for r in rs if r["tau"] is not None]
        errors = [r["tau_stderr"] for r in rs if r.get("tau_stderr") is not None]
        acc = [_mean([r["acc"][k] for r in rs]) for k in range(len(rs[0]["acc"]))]
        out["variants"][v] = {
            "heldout_loss": _mean(losses), "heldout_loss_spread": _spread(losses), "acc": acc,
            "tau": _mean(taus) if taus else None, "tau_spread": _spread(taus) if taus else None,
            # The eval's own noise, the standard error over the prompts; the seeds share the prompts, so their
            # mean is as uncertain as one of them.
            "tau_stderr": _mean(errors) if errors else None,
            "steps": rs[0]["summary"]["steps"], "budget_bytes": rs[0]["budget_bytes"],
            "dump_bytes": rs[0]["dump_bytes"], "per_seed_loss": losses, "per_seed_tau": taus,
            "run_seconds": _mean([r["seconds"] for r in rs]),
            # Equal steps, but a small window cuts smaller batches: what each variant saw in them.
            "samples_trained": _mean([r["summary"]["samples_trained"] for r in rs]),
            "samples_extracted": _mean([r["summary"]["samples_extracted"] for r in rs]),
        }
    window = []
    for f in sweep:
        name = "streamed" if math.isclose(f, STREAMED_FRACTION) and "streamed" in variants else f"window-{f:g}"
        rs = results[name]
        losses = [r["loss"] for r in rs]
        fraction = rs[0]["budget_bytes"] / rs[0]["dump_bytes"]
        window.append({"budget_fraction": fraction, "heldout_loss": _mean(losses),
                       "heldout_loss_spread": _spread(losses), "budget_bytes": rs[0]["budget_bytes"],
                       "window_samples": fraction * samples, "window_steps": fraction * samples / samples_per_step,
                       "samples_trained": _mean([r["summary"]["samples_trained"] for r in rs])})
    out["window_sweep"] = sorted(window, key=lambda w: -w["budget_fraction"])
    if "offline" in out["variants"]:
        ref = out["variants"]["offline"]
        out["parity"] = {v: _parity(out["variants"][v], ref) for v in variants if v != "offline"}
        for w in out["window_sweep"]:
            w["within_offline"] = _parity(w, ref, tau=False)["loss_within"]
    if "streamed" in out["variants"]:
        # Each of these changes one thing of `streamed` (the objective, the drafter): the same bar against it.
        out["versus_streamed"] = {v: _parity(out["variants"][v], out["variants"]["streamed"])
                                  for v in STREAMED_LIKE if v in out["variants"]}
    out.update({"seeds": list(range(seeds)), "minutes": round((time.monotonic() - started) / 60, 1),
                "steps": steps, "samples": samples, "samples_per_step": samples_per_step,
                "heldout_samples": heldout, "unigram_loss": unigram,
                "untrained_loss": untrained["loss"]})
    return out


def _parity(v: dict[str, Any], ref: dict[str, Any], tau: bool = True) -> dict[str, Any]:
    """The issue's bar: loss within max(2 %, 2 x the seed spread) of offline, tau within the tau spread; and
    whether the tau gap is within twice the eval's own standard error (what more prompts could move)."""
    tolerance = max(0.02 * ref["heldout_loss"], 2 * max(v["heldout_loss_spread"], ref["heldout_loss_spread"]))
    gap = v["heldout_loss"] - ref["heldout_loss"]
    verdict = {"loss_gap": gap, "loss_tolerance": tolerance, "loss_within": abs(gap) <= tolerance}
    if tau and v.get("tau") is not None and ref.get("tau") is not None:
        tau_tolerance = max(v["tau_spread"], ref["tau_spread"])
        verdict.update(tau_gap=v["tau"] - ref["tau"], tau_tolerance=tau_tolerance,
                       tau_within=abs(v["tau"] - ref["tau"]) <= tau_tolerance)
        if v.get("tau_stderr") is not None and ref.get("tau_stderr") is not None:
            noise = 2 * math.hypot(v["tau_stderr"], ref["tau_stderr"])
            verdict.update(tau_noise=noise, tau_within_noise=abs(v["tau"] - ref["tau"]) <= noise)
    return verdict


def _table(report: dict[str, Any]) -> list[str]:
    lines = [f"{'variant':<11} {'held-out loss':>14} {'spread':>8} {'acc slots 1-3':>17} {'tau':>7} {'tau spread':>10} "
             f"{'tau stderr':>10} {'budget/dump':>11}"]
    for name, v in report["variants"].items():
        tau = f"{v['tau']:.3f}" if v["tau"] is not None else "-"
        tau_spread = f"{v['tau_spread']:.3f}" if v["tau_spread"] is not None else "-"
        tau_stderr = f"{v['tau_stderr']:.3f}" if v["tau_stderr"] is not None else "-"
        acc = "/".join(f"{a:.3f}" for a in v["acc"][:3])
        lines.append(f"{name:<11} {v['heldout_loss']:>14.4f} {v['heldout_loss_spread']:>8.4f} {acc:>17} "
                     f"{tau:>7} {tau_spread:>10} {tau_stderr:>10} {v['budget_bytes'] / v['dump_bytes']:>11.1%}")
    for name, verdict in report.get("versus_streamed", {}).items():
        tau = (f", tau gap {verdict['tau_gap']:+.3f} (noise {verdict['tau_noise']:.3f})"
               if "tau_noise" in verdict else "")
        lines.append(f"{name} vs streamed: loss gap {verdict['loss_gap']:+.4f} (tolerance "
                     f"{verdict['loss_tolerance']:.4f}){tau}")
    lines.append(f"unigram level {report['unigram_loss']:.4f}, untrained drafter {report['untrained_loss']:.4f}; "
                 f"{report['steps']} steps per run, seeds {report['seeds']}, {report['minutes']} minutes")
    lines.append("window sweep (streamed, epoch_source reuse): " + ", ".join(
        f"{w['budget_fraction']:.1%} ({w['window_steps']:.1f} steps): {w['heldout_loss']:.4f} +- "
        f"{w['heldout_loss_spread']:.4f}"
        for w in report["window_sweep"]))
    return lines


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = report["window_sweep"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.errorbar([w["budget_fraction"] * 100 for w in sweep], [w["heldout_loss"] for w in sweep],
                yerr=[w["heldout_loss_spread"] / 2 for w in sweep], marker="o", capsize=3, label="streamed (reuse)")
    if "offline" in report["variants"]:
        off = report["variants"]["offline"]
        ax.axhline(off["heldout_loss"], color="gray", linestyle="--", label="offline")
        ax.axhspan(off["heldout_loss"] - off["heldout_loss_spread"] / 2,
                   off["heldout_loss"] + off["heldout_loss_spread"] / 2, color="gray", alpha=0.2)
    ax.set_xscale("log")
    ax.set_xticks([w["budget_fraction"] * 100 for w in sweep],
                  [f"{w['budget_fraction']:.0%}\n{w['window_steps']:.1f} steps" for w in sweep])
    ax.minorticks_off()
    ax.set_xlabel("store budget (% of the dump) and its window (optimizer steps), log")
    ax.set_ylabel("held-out weighted loss")
    ax.set_title(f"window sweep: {report['samples']} samples, {report['steps']} steps, seeds {report['seeds']}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
