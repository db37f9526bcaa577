"""`dflash-stream export` (trainer checkpoint -> z-lab drafter) and `dflash-stream eval` (acceptance, speedup)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_stream.config import EVAL_ENGINES
from dflash_stream.errors import DFlashError


def _checkpoint_dir(path: Path) -> Path:
    """A checkpoint directory itself, or a run's output folder (its latest complete checkpoint)."""
    from dflash_stream.drafter.export import SPEC
    from dflash_stream.rundir import RunDir

    if (path / SPEC).is_file():
        return path
    latest = RunDir(path).latest_checkpoint() if path.is_dir() else None
    if latest is None:
        raise DFlashError(f"{path}: neither a trainer checkpoint (drafter_spec.json) nor a run with one")
    return latest


def _own_embedding(config: str | Path | None, ckpt: Path):
    """The target's embedding table as the target scales it, for `--embedding own`: the target of `config`, else
    of the run the checkpoint belongs to (its config.yaml)."""
    import torch

    from dflash_stream.config import load_config
    from dflash_stream.drafter.head import load_target_head
    from dflash_stream.rundir import RunDir

    parents = ckpt.resolve().parents  # a checkpoint's run: OUTPUT/checkpoints/step-N
    path = Path(config) if config else RunDir(parents[min(1, len(parents) - 1)]).config
    if not path.is_file():
        raise DFlashError(f"export --embedding own: {path} not found; name the run config with --config (its "
                          "target's embedding table is copied into the export)")
    head = load_target_head(load_config(path, []).target, "cpu")
    return head.embed(torch.arange(head.embed_weight.shape[0]))


def export_checkpoint(checkpoint: str | Path, out: str | Path, embedding: str = "shared",
                      config: str | Path | None = None) -> str:
    """`dflash-stream export`: a trainer checkpoint (or a run's latest) as a z-lab drafter in `out`; `embedding`
    own copies the target's scaled embedding table in (`config` names the target, default the run's). Returns
    the line the command prints."""
    from safetensors import SafetensorError

    from dflash_stream.drafter.export import export_drafter, load_checkpoint_drafter
    from dflash_stream.preflight import probe_writable

    ckpt = _checkpoint_dir(Path(checkpoint))
    try:
        drafter, spec = load_checkpoint_drafter(ckpt)
    except FileNotFoundError as err:
        raise DFlashError(f"export: {err}") from err
    table = _own_embedding(config, ckpt) if embedding == "own" else None
    if table is not None and table.shape != (spec.vocab_size, spec.hidden_size):
        raise DFlashError(f"export --embedding own: the target's table is {list(table.shape)}, the drafter was "
                          f"trained for [{spec.vocab_size}, {spec.hidden_size}]: --config names another target")
    probe_writable(out, "export --out")
    try:
        written = export_drafter(drafter, spec, out, table)
    except SafetensorError as err:  # the disk filled up meanwhile
        raise DFlashError(f"export --out {out}: {str(err).splitlines()[0]}") from None
    return (f"exported {ckpt} -> {written} ({spec.num_layers} layers, block {spec.block_size}, target layers "
            f"{spec.target_layer_ids}{', with its own embedding' if table is not None else ''})")


def _export(args: argparse.Namespace) -> int:
    print(export_checkpoint(args.checkpoint, args.out, args.embedding, args.config))
    return 0


def _num(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _format(result: dict) -> str:
    hist = result["acceptance_histogram"]
    speedup = f"{_num(result['speedup'], 2)}x  (target alone {result['target_s']:.2f} s, " \
              f"speculative {result['speculative_s']:.2f} s, {result['device']})"
    lines = [
        f"acceptance length tau  {_num(result['acceptance_length'], 3)} tokens per target step",
        f"speedup                {speedup}",
        *([f"                       {result['speedup_note']}"] if result.get("speedup_note") else []),
        f"output == target's     {result['matches_target']}",
        "accepted drafts/step   " + "  ".join(f"{n}:{c}" for n, c in enumerate(hist) if c),
    ]
    for p in result["prompts"]:
        lines.append(f"  prompt {p['index']:>3}  {p['new_tokens']:>4} tokens  tau {_num(p['acceptance_length'], 2)}"
                     f"  {'ok' if p['matches_target'] else 'DIFFERS'}")
    if len(result["engines"]) > 1:
        lines += ["", *engine_table(result)]
    return "\n".join(lines)


def engine_table(result: dict) -> list[str]:
    """Each engine's τ as vLLM counts it, side by side, and whether its answers are the target's."""
    from dflash_stream.drafter.evaluate import on_engine_answers_line, same_answers_line

    prompts = len(result["prompts"])
    lines = [f"{'engine':<8}{'tau':>8}{'vs ours':>9}{'drafts':>8}{'accepted':>10}{'as target':>11}  accepted per "
             "draft position"]
    for name, e in result["engines"].items():
        if "acceptance_length" not in e:
            lines.append(f"{name:<8}{'-':>8}  not served: {e.get('error')}")
            continue
        diff = f"{100 * e['relative_difference']:+.2f}%" if "relative_difference" in e else ""
        as_target = e.get("answers_as_target", prompts if e["matches_target"] else "-")
        lines.append(f"{name:<8}{_num(e['acceptance_length'], 3):>8}{diff:>9}{e['drafts']:>8}"
                     f"{e['accepted_tokens']:>10}{f'{as_target}/{prompts}':>11}  "
                     + " ".join(str(c) for c in e["per_position"]))
        lines += [f"{'':<8}note: {note}" for note in e.get("notes", {}).values()]
    if result.get("engines_agree") is not None:
        lines.append(f"tau within 2 % of ours: {result['engines_agree']}")
    if line := same_answers_line(result.get("same_answers"), prompts):
        lines.append(line)
    if line := on_engine_answers_line(result.get("on_engine_answers")):
        lines.append(line)
    return lines


def _eval(args: argparse.Namespace) -> int:
    from dflash_stream.config import endpoint_base_url, load_config, served_engine
    from dflash_stream.drafter.evaluate import evaluate
    from dflash_stream.log import setup_logging

    setup_logging("eval", 0)
    cfg = load_config(args.config, args.overrides)
    try:
        endpoint = endpoint_base_url(args.endpoint) if args.endpoint else cfg.eval.endpoint
    except ValueError as err:
        raise DFlashError(f"eval --endpoint: {err}") from None
    try:
        engine = served_engine(args.engine or cfg.eval.engine, endpoint)
    except ValueError as err:
        raise DFlashError(f"eval --engine: {err}") from None
    try:
        result = evaluate(cfg, args.drafter, args.prompts, args.max_new_tokens or cfg.eval.max_new_tokens,
                          engine=engine, endpoint=endpoint, workdir=args.workdir)
    except FileNotFoundError as err:
        raise DFlashError(f"eval: {err}") from err
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2) if args.json else _format(result))
    return 0 if result["matches_target"] else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a trainer checkpoint as a z-lab DFlash drafter (vLLM/SGLang)")
    p.add_argument("checkpoint", help="checkpoint directory (checkpoints/step-N), or a run folder (latest)")
    p.add_argument("--out", required=True, help="output folder (config.json + model.safetensors)")
    p.add_argument("--embedding", choices=("shared", "own"), default="shared",
                   help="shared (z-lab's format: engines embed with the target's table) or own: the target's table "
                        "as the target scales it, copied in (vocab x hidden more; vLLM serves Gemma drafters right "
                        "only so: docs/engines.md)")
    p.add_argument("--config", default=None,
                   help="with --embedding own: the run config naming the target (default: the run's config.yaml)")
    p.set_defaults(func=_export)

    p = sub.add_parser("eval", help="greedy speculative decoding: acceptance length and speedup vs the target")
    p.add_argument("--drafter", required=True, help="an exported drafter folder")
    p.add_argument("--config", required=True, help="run config (its target section names the target)")
    p.add_argument("--prompts", required=True, help="jsonl of chat `messages` or plain `prompt` rows")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: eval.max_new_tokens")
    p.add_argument("--engine", choices=EVAL_ENGINES, default=None,
                   help="ours (our decoding loop), or vllm / sglang: also the drafter served as that engine's "
                        "DFlash speculator, its tau beside ours (default: eval.engine; sglang needs --endpoint)")
    p.add_argument("--endpoint", default=None, metavar="URL",
                   help="a vLLM (idle meanwhile) or SGLang server you started with this drafter as its speculator, "
                        "e.g. http://host:8000/v1; implies --engine vllm unless --engine sglang (default: "
                        "eval.endpoint; none: a local vLLM server)")
    p.add_argument("--workdir", default=None,
                   help="the local vLLM server's log and converted target (default: <output_dir>/engines)")
    p.add_argument("--out", default=None, help="also write the full result as JSON to this file")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.set_defaults(func=_eval, overrides=[])
