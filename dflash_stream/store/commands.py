"""`dflash-stream store status`, `store dump` and `store verify`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_stream.errors import DFlashError


def register(sub: argparse._SubParsersAction) -> None:
    store = sub.add_parser("store", help="inspect a hidden-state store")
    cmds = store.add_subparsers(dest="store_command", required=True, metavar="ACTION")
    status = cmds.add_parser("status", help="budget, bytes used and reserved, segments per state, samples, tokens")
    status.add_argument("path")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=_status)
    dump = cmds.add_parser("dump", help="write one stored sample to a safetensors file")
    dump.add_argument("path")
    dump.add_argument("--sample-id", type=int, required=True)
    dump.add_argument("--out", required=True, help="FILE.safetensors")
    dump.set_defaults(func=_dump)
    verify = cmds.add_parser("verify", help="check every chunk's checksum; report damaged segments, change nothing")
    verify.add_argument("path")
    verify.add_argument("--json", action="store_true", help="print {segments, damaged, ok}")
    verify.set_defaults(func=_verify)


def _status(args: argparse.Namespace) -> int:
    from dflash_stream.store.store import Store

    status = Store.attach(args.path).status()
    if args.json:
        print(json.dumps(status))
        return 0
    seg = status["segments"]
    print(f"store {status['path']} (codec {status['codec']}, reuse {status['reuse']})")
    print(f"  budget    {status['budget_bytes']:>16,} bytes")
    print(f"  used      {status['used_bytes']:>16,} bytes")
    print(f"  reserved  {status['reserved_bytes']:>16,} bytes")
    print(f"  segments  ready {seg['ready']}, claimed {seg['claimed']}, being written {seg['writing']}, "
          f"released {seg['released']}")
    print(f"  inside    {status['samples']:,} samples, {status['tokens']:,} tokens")
    print(f"  writers   {status['writers_finished']} finished, {status['writers_waiting']} waiting for space")
    print(f"  end of data: {'yes' if status['end_of_data'] else 'no'}")
    return 0


def _dump(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from dflash_stream.preflight import probe_writable
    from dflash_stream.store.segment import read_segment
    from dflash_stream.store.store import Store

    store = Store.attach(args.path)
    segment_id = store._find_sample(args.sample_id)
    sample = next(s for s in read_segment(segment_id, store.path / "segments" / segment_id)
                  if s.sample_id == args.sample_id)
    out = Path(args.out)
    probe_writable(out.parent, "store dump --out")
    if out.is_dir():
        raise DFlashError(f"store dump --out {out} is a folder; name a FILE.safetensors")
    try:
        save_file({"input_ids": sample.input_ids, "loss_mask": sample.loss_mask,
                   "hidden_states": sample.hidden_states.contiguous()}, str(out),
                  metadata={"sample_id": str(args.sample_id), "segment": segment_id})
    except SafetensorError as err:  # the disk filled up, or the folder vanished meanwhile
        raise DFlashError(f"store dump --out {out}: {str(err).splitlines()[0]}") from None
    print(f"sample {args.sample_id} ({len(sample.input_ids)} tokens, segment {segment_id}) -> {args.out}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Exit 0 only if every live segment reads back with intact checksums."""
    from dflash_stream.store.store import Store

    report = Store.attach(args.path).verify()
    if args.json:
        print(json.dumps(report))
    else:
        print(f"store {args.path}: {report['segments']} segment(s) checked, "
              + (f"{len(report['damaged'])} damaged: {', '.join(report['damaged'])}" if report["damaged"] else "all intact"))
    return 0 if report["ok"] else 1
