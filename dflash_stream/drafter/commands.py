"""`dflash-stream export` (trainer checkpoint -> z-lab drafter) and `dflash-stream eval` (acceptance, speedup)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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


def _export(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError

    from dflash_stream.drafter.export import export_drafter, load_checkpoint_drafter
    from dflash_stream.preflight import probe_writable

    ckpt = _checkpoint_dir(Path(args.checkpoint))
    try:
        drafter, spec = load_checkpoint_drafter(ckpt)
    except FileNotFoundError as err:
        raise DFlashError(f"export: {err}") from err
    probe_writable(args.out, "export --out")
    try:
        out = export_drafter(drafter, spec, args.out)
    except SafetensorError as err:  # the disk filled up meanwhile
        raise DFlashError(f"export --out {args.out}: {str(err).splitlines()[0]}") from None
    print(f"exported {ckpt} -> {out} ({spec.num_layers} layers, block {spec.block_size}, "
          f"target layers {spec.target_layer_ids})")
    return 0


def _num(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _format(result: dict) -> str:
    hist = result["acceptance_histogram"]
    lines = [
        f"acceptance length tau  {_num(result['acceptance_length'], 3)} tokens per target step",
        f"speedup                {_num(result['speedup'], 2)}x  (target alone {result['target_s']:.2f} s, "
        f"speculative {result['speculative_s']:.2f} s, {result['device']})",
        f"output == target's     {result['matches_target']}",
        "accepted drafts/step   " + "  ".join(f"{n}:{c}" for n, c in enumerate(hist) if c),
    ]
    for p in result["prompts"]:
        lines.append(f"  prompt {p['index']:>3}  {p['new_tokens']:>4} tokens  tau {_num(p['acceptance_length'], 2)}"
                     f"  {'ok' if p['matches_target'] else 'DIFFERS'}")
    return "\n".join(lines)


def _eval(args: argparse.Namespace) -> int:
    from dflash_stream.config import load_config
    from dflash_stream.drafter.evaluate import evaluate
    from dflash_stream.log import setup_logging

    setup_logging("eval", 0)
    cfg = load_config(args.config, args.overrides)
    try:
        result = evaluate(cfg, args.drafter, args.prompts, args.max_new_tokens or cfg.eval.max_new_tokens)
    except FileNotFoundError as err:
        raise DFlashError(f"eval: {err}") from err
    print(json.dumps(result, indent=2) if args.json else _format(result))
    return 0 if result["matches_target"] else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a trainer checkpoint as a z-lab DFlash drafter (vLLM/SGLang)")
    p.add_argument("checkpoint", help="checkpoint directory (checkpoints/step-N), or a run folder (latest)")
    p.add_argument("--out", required=True, help="output folder (config.json + model.safetensors)")
    p.set_defaults(func=_export)

    p = sub.add_parser("eval", help="greedy speculative decoding: acceptance length and speedup vs the target")
    p.add_argument("--drafter", required=True, help="an exported drafter folder")
    p.add_argument("--config", required=True, help="run config (its target section names the target)")
    p.add_argument("--prompts", required=True, help="jsonl of chat `messages` or plain `prompt` rows")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: eval.max_new_tokens")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.set_defaults(func=_eval, overrides=[])
