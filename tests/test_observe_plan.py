"""`plan` figures against hand computations, and the TensorBoard seam of the trainer's metrics."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
from pathlib import Path

import pytest
import yaml

from dflash_stream.cli import main
from dflash_stream.config import load_config
from dflash_stream.observe.metrics import TrainingTracker, read_metrics
from dflash_stream.observe.plan import build_plan, render_plan
from dflash_stream.units import fmt_bytes

MIB = 2**20


def _config(tmp_path: Path, tree: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_plan_headline_64_layers(tmp_path: Path, capsys) -> None:
    """Qwen3.6-27B class: 64 layers, hidden 5120, 5 layers, 914k samples of 1,000 tokens, 6 epochs (reuse)."""
    path = _config(tmp_path, {
        "output_dir": str(tmp_path / "out"),
        "target": {"model": "Qwen/Qwen3.6-27B", "num_layers": 64, "hidden_size": 5120},
        "data": {"sources": [{"path": "org/hub-dataset"}]},
        "store": {"path": str(tmp_path / "store"), "budget": "200GB", "codec": "lossless"},
        "train": {"epochs": 6},
        "roles": {"trainers": 1},
    })
    plan = build_plan(load_config(path), samples=914_000, mean_tokens=1000, processes=4)
    assert plan["target"]["layer_ids"] == [1, 16, 31, 46, 61]
    assert plan["target"]["source"].startswith("config")
    v = plan["volume"]
    assert v["raw_bytes_per_token"] == 51_200
    assert v["raw_bytes_per_sample"] == 51_200_000
    assert v["stored_bytes_per_token"] == pytest.approx(51_205 / 1.44)
    tokens = 914_000 * 1000
    assert v["full_dump_raw_bytes"] == pytest.approx(tokens * 51_205)  # 46.8 TB: states + ids + mask
    b = plan["buffer"]
    segment_stored = 64 * MIB / 1.44
    assert b["segments_in_budget"] == int(200e9 // segment_stored)
    assert b["segments_per_pass"] == math.ceil(tokens * 51_205 / (64 * MIB))
    assert b["wraps"] == pytest.approx(tokens * 51_205 / 1.44 / 200e9)
    # Four processes, one trainer as configured: three extractors stream beside it.
    t = plan["time"]
    assert t["overlapped"] and t["phases"]["extract"]["processes"] == 3
    assert t["total_seconds"] == max(t["phases"]["extract"]["seconds"], t["phases"]["train"]["seconds"])
    assert "estimated" in t["phases"]["extract"]["source"]
    e = plan["epochs"]
    assert e["reextract"]["extract_seconds"] == pytest.approx(6 * e["reuse"]["extract_seconds"])
    assert e["reextract"]["bytes_written"] == pytest.approx(6 * v["full_dump_stored_bytes"])

    assert main(["plan", "--config", str(path), "--samples", "914000", "--mean-tokens", "1000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["volume"]["raw_bytes_per_token"] == 51_200
    assert main(["plan", "--config", str(path), "--samples", "914000"]) == 0
    page = capsys.readouterr().out
    assert "51,200 B" in page and "[1, 16, 31, 46, 61]" in page and "docs/benchmarks.md" in page
    assert "DESIGN.md" not in page and "Blosc" not in page  # the project ships neither


def test_plan_local_model_local_data_and_tune(tmp_path: Path) -> None:
    """A local 28-layer, 2048-wide target; rows counted in a local jsonl; tune's measurements picked up."""
    from transformers import LlamaConfig

    model = tmp_path / "model"
    LlamaConfig(num_hidden_layers=28, hidden_size=2048, intermediate_size=6144, vocab_size=32000,
                num_attention_heads=16).save_pretrained(model)
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps({"messages": []}) + "\n" for _ in range(50)))
    out = tmp_path / "out"
    path = _config(tmp_path, {
        "output_dir": str(out),
        "target": {"model": str(model), "num_capture_layers": 3},
        "data": {"sources": [{"path": str(rows)}, {"path": str(rows), "limit": 20, "name": "again", "weight": 2}], "max_length": 2048},
        "store": {"path": str(tmp_path / "new" / "store"), "budget": "1GiB", "codec": "fp8",
                  "segment_bytes": "16MiB"},
    })
    cfg = load_config(path)
    out.mkdir()
    # Layer ids for 28 layers, 3 captured: start 1, end 25 -> [1, 13, 25].
    tune = {"layer_ids": [1, 13, 25], "hidden_size": 2048, "samples": 8, "tokens": 4000, "mean_tokens": 500.0,
            "compression": {"fp8": 2.5, "lossless": 1.5}, "extract_tok_s": 1000.0, "train_tok_s": 250.0,
            "device": "cpu"}
    (out / "tune.json").write_text(json.dumps(tune))

    plan = build_plan(cfg)
    assert plan["target"]["source"].endswith("config.json")
    assert plan["target"]["layer_ids"] == [1, 13, 25]
    assert plan["data"]["samples"] == 50 + 2 * 20 and "rows counted" in plan["data"]["samples_source"]
    assert plan["data"]["mean_tokens"] == 500.0 and "tune" in plan["data"]["mean_tokens_source"]
    v = plan["volume"]
    assert v["raw_bytes_per_token"] == 3 * 2048 * 2 == 12_288
    assert v["ratio"] == 2.5 and "tune" in v["ratio_source"]
    assert v["stored_bytes_per_token"] == pytest.approx(12_293 / 2.5)
    assert v["full_dump_raw_bytes"] == pytest.approx(90 * 500 * 12_293)
    assert plan["buffer"]["wraps"] == pytest.approx(90 * 500 * 12_293 / 2.5 / 2**30)
    # One process alternates extraction and training, so the phase times add up.
    t = plan["time"]
    assert t["phases"]["extract"]["seconds"] == pytest.approx(45_000 / 1000.0)
    assert t["phases"]["train"]["seconds"] == pytest.approx(45_000 / 250.0)
    assert t["total_seconds"] == pytest.approx(45.0 + 180.0)
    assert "tune" in t["phases"]["train"]["source"]
    # The store folder does not exist yet: free space is measured at its nearest existing parent.
    assert plan["disk"]["checked"] == str(tmp_path)
    assert plan["disk"]["headroom_bytes"] == pytest.approx(shutil.disk_usage(tmp_path).free - 2**30, rel=1e-3)

    (out / "tune.json").write_text(json.dumps({**tune, "layer_ids": [2, 13, 25]}))
    other = build_plan(cfg)
    assert other["volume"]["ratio"] == 2.4 and any("another target" in w for w in other["warnings"])
    # A tune measured without the verifier's layer does not size a run that stores it, nor the other way round.
    (out / "tune.json").write_text(json.dumps(tune))
    verifier_cfg = load_config(path, ["--extract.verifier_states=on"])
    assert build_plan(verifier_cfg)["volume"]["ratio"] == 2.4
    (out / "tune.json").write_text(json.dumps({**tune, "verifier_states": True}))
    assert build_plan(verifier_cfg)["volume"]["ratio"] == 2.5 and build_plan(cfg)["volume"]["ratio"] == 2.4


def test_plan_warns_on_small_budget_and_hub_model(tmp_path: Path, capsys) -> None:
    base = {"output_dir": str(tmp_path / "out"), "data": {"sources": [{"path": "org/data", "limit": 100}]},
            "store": {"path": str(tmp_path / "store"), "budget": "10MiB"}}
    tree = {**base, "target": {"model": "org/not-downloaded"}}
    assert main(["plan", "--config", str(_config(tmp_path, tree))]) == 2
    assert "target.num_layers" in capsys.readouterr().err
    tree = {**base, "target": {"model": "org/m", "num_layers": 36, "hidden_size": 4096}}
    plan = build_plan(load_config(_config(tmp_path, tree)))
    assert plan["target"]["layer_ids"] == [1, 9, 17, 25, 33]
    assert plan["data"]["samples"] == 100 and "limit" in plan["data"]["samples_source"]
    assert any("under the smallest workable budget" in w for w in plan["warnings"])


@pytest.mark.parametrize("codec", ["lossless", "fp8", "none"])
def test_plan_and_store_open_agree_on_the_smallest_budget(tmp_path: Path, codec: str) -> None:
    """One rule: the budget `plan` calls the smallest workable one is exactly where `Store.open` stops refusing."""
    from dflash_stream.pipeline.common import max_segment_raw_bytes, store_fingerprint
    from dflash_stream.store import BudgetTooSmall, Store

    tree = {"output_dir": str(tmp_path / "out"), "data": {"sources": [{"path": "org/data", "limit": 100}],
                                                          "max_length": 512},
            "target": {"model": "org/m", "num_layers": 8, "hidden_size": 64},
            "store": {"path": str(tmp_path / "store"), "budget": "1MiB", "codec": codec, "segment_bytes": "2MiB"}}
    cfg = load_config(_config(tmp_path, tree))
    plan = build_plan(cfg)
    smallest = plan["buffer"]["min_budget_bytes"]
    layers = plan["target"]["layer_ids"]
    assert any("under the smallest workable budget" in w for w in plan["warnings"])
    kwargs = {"codec": codec, "reuse": 1, "fingerprint": store_fingerprint(cfg, layers, 64),
              "max_segment_raw_bytes": max_segment_raw_bytes(cfg, len(layers), 64)}
    with pytest.raises(BudgetTooSmall, match=f"smallest workable budget is {smallest:,} bytes"):
        Store.open(cfg.store.path, budget=smallest - 1, **kwargs)
    Store.open(cfg.store.path, budget=smallest, **kwargs)
    cfg.store.budget = smallest
    assert not any("smallest workable" in w for w in build_plan(cfg)["warnings"])


def test_training_tracker_writes_jsonl_and_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = TrainingTracker(tmp_path, "trainer", 0, tensorboard=True)
    tracker.log("start", config={})
    for step in (10, 20):
        tracker.log("train", step=step, loss=3.0 / step, acc=[0.5, 0.25], tau=1.5, lr=1e-4, tokens=100 * step,
                    tok_s=50.0, data_wait_s=0.0, epoch=0)
    tracker.log("checkpoint", step=20, path="x", released=1)
    tracker.close()
    events = read_metrics(tmp_path)
    assert [e["event"] for e in events] == ["start", "train", "train", "checkpoint"]
    assert events[0]["pid"] == os.getpid() and events[0]["host"] == socket.gethostname()
    assert events[2]["acc"] == [0.5, 0.25]
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "trainer-0"))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("train/loss")] == [(10, pytest.approx(0.3)), (20, pytest.approx(0.15))]
    assert [s.value for s in acc.Scalars("acc/slot_02")] == [0.25, 0.25]
    assert "train/checkpoint" not in acc.Tags()["scalars"]
    # Other ranks write JSONL only.
    TrainingTracker(tmp_path, "trainer", 1, tensorboard=True).close()
    assert not (tmp_path / "tensorboard" / "trainer-1").exists()


def test_plan_counts_rows_like_the_data_loader(tmp_path: Path) -> None:
    """A folder of .json (a list, and JSON Lines under a .json name) and .jsonl files, and a parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "rows" / "nested"
    folder.mkdir(parents=True)
    (folder / "a.json").write_text(json.dumps([{"text": "x"}] * 3))
    (folder / "b.json").write_text(json.dumps({"text": "y"}) + "\n" + json.dumps({"text": "z"}) + "\n")
    (tmp_path / "rows" / "c.jsonl").write_text("".join(json.dumps({"text": i}) + "\n" for i in range(4)) + "\n")
    pq.write_table(pa.table({"text": ["p"] * 6}), tmp_path / "more.parquet")
    tree = {"output_dir": str(tmp_path / "out"),
            "target": {"model": "org/m", "num_layers": 36, "hidden_size": 4096},
            "data": {"sources": [{"path": str(tmp_path / "rows")}, {"path": str(tmp_path / "more.parquet")}]},
            "store": {"path": str(tmp_path / "store"), "budget": "10GiB"}}
    plan = build_plan(load_config(_config(tmp_path, tree)))
    assert plan["data"]["samples"] == 3 + 2 + 4 + 6


def test_plan_warns_when_the_reuse_window_is_below_what_bench_quality_found_good():
    from dflash_stream.config import load_config
    from dflash_stream.observe.plan import REUSE_WINDOW_STEPS_MEASURED, build_plan

    # The headline job: 0.12 % of its dump, but ~1,100 samples, several times the steps measured as enough.
    headline = build_plan(load_config("configs/qwen3.6-27b-4gpu.yaml"))
    assert headline["buffer"]["window_fraction"] < 0.01
    assert headline["buffer"]["window_steps"] > 2 * REUSE_WINDOW_STEPS_MEASURED
    assert not any("bench quality" in w for w in headline["warnings"])
    small = ["--store.budget=4GB"]  # ~70 samples: about two optimizer steps of 32 x 1,536 tokens
    tight = build_plan(load_config("configs/qwen3.6-27b-4gpu.yaml", small))
    assert tight["buffer"]["window_steps"] < REUSE_WINDOW_STEPS_MEASURED
    assert any("epoch_source=reextract" in w and "bench quality" in w for w in tight["warnings"])
    reshuffled = build_plan(load_config("configs/qwen3.6-27b-4gpu.yaml", [*small, "--train.epoch_source=reextract"]))
    assert not any("bench quality" in w for w in reshuffled["warnings"])


def test_plan_counts_the_host_memory_of_the_busiest_machine(monkeypatch):
    """Ranks 0..E-1 extract and the rest train; one machine holds its launch's share of them side by side, and only
    trainer 0 the checkpoint snapshot. Over this machine's RAM, plan warns naming the knobs."""
    from collections import namedtuple

    from dflash_stream.sizing import host_memory as host_module

    def plan_on(launch: str, ram: int, *overrides: str) -> dict:
        monkeypatch.setattr(host_module.psutil, "virtual_memory", lambda: namedtuple("Memory", "total")(ram))
        return build_plan(load_config("configs/qwen3.6-27b-4gpu.yaml", list(overrides)),
                          launch_file=f"launch/{launch}.yaml", gpu_memory=96 * 10**9)

    plan = plan_on("4gpu", 2**40)
    host = plan["host_memory"]
    extractor, trainer = host["extractor"]["total_bytes"], host["trainer"]["total_bytes"]
    snapshot = host["trainer"]["parts"]["checkpoint_snapshot"]
    assert (plan["roles"]["extractors"], plan["roles"]["trainers"]) == (2, 2)
    assert host["machine"] == {"extractors": 2, "trainers": 2, "trainer_0": True, "launch_trainers": 2,
                               "bytes": 2 * extractor + 2 * trainer - snapshot, "this_machine_bytes": 2**40}
    assert not any(w.startswith("host memory") for w in plan["warnings"])

    # 16 processes on 2 machines: auto takes 8 extractors (the first machine) and 8 trainers (the second).
    two = plan_on("2node-node0", 2**40)
    assert (two["roles"]["extractors"], two["roles"]["trainers"]) == (8, 8)
    assert two["host_memory"]["machine"]["bytes"] == 7 * (trainer - snapshot) + trainer > 8 * extractor
    assert two["host_memory"]["machine"]["trainer_0"] and two["host_memory"]["machine"]["extractors"] == 0
    mixed = plan_on("2node-node0", 2**40, "--roles.trainers=12")["host_memory"]  # ranks 4..7 of the first train
    assert (mixed["machine"]["extractors"], mixed["machine"]["trainers"], mixed["machine"]["trainer_0"]) == (4, 4, True)
    assert mixed["machine"]["bytes"] == 4 * mixed["extractor"]["total_bytes"] + 4 * mixed["trainer"]["total_bytes"] \
        - 3 * mixed["trainer"]["parts"]["checkpoint_snapshot"]

    small = plan_on("4gpu", 32 * 2**30)
    warning = next(w for w in small["warnings"] if w.startswith("host memory"))
    assert fmt_bytes(small["host_memory"]["machine"]["bytes"]) in warning and "extract.queue_size" in warning
    assert "machine    up to" in render_plan(small)


def test_run_warns_when_a_machines_share_exceeds_its_available_ram(monkeypatch):
    """The start check of `run`, `extract` and `train` (each machine's first process) counts the launch's processes
    on that machine, from the same figures as plan's, against the RAM available now."""
    from collections import namedtuple

    from dflash_stream.sizing import host_memory as host_module
    from dflash_stream.target_model import target_shape

    cfg = load_config("configs/qwen3.6-27b-4gpu.yaml")
    host = host_module.run_host_memory(cfg, target_shape(cfg.target))
    planned = build_plan(cfg, launch_file="launch/4gpu.yaml", gpu_memory=96 * 10**9)["host_memory"]
    assert host["extractor"]["parts"] == {k: v for k, v in planned["extractor"]["parts"].items() if k != "answers_index"}
    assert host["trainer"]["parts"]["checkpoint_snapshot"] == pytest.approx(
        planned["trainer"]["parts"]["checkpoint_snapshot"], rel=1e-3)

    def available(gib: int) -> None:
        monkeypatch.setattr(host_module.psutil, "virtual_memory",
                            lambda: namedtuple("Memory", "total available")(2**40, gib * 2**30))

    available(40)  # 2 extractors + 2 trainers (trainer 0 among them) on one machine: 65.7 GiB
    share = host_module.machine_share(host, 2, 4, 4, 0)
    warning = host_module.check_machine(host, 2, 4, 4, 0)
    assert warning and "2 extractor(s) and 2 trainer(s) of this launch on this machine" in warning
    assert fmt_bytes(share["bytes"]) in warning
    assert "checkpoint snapshot" in warning and "40.0 GiB is available" in warning and "extract.queue_size" in warning
    available(100)  # 16 processes on 2 machines, 8 extractors: the first holds 8 extractors, the second the trainers
    assert host_module.check_machine(host, 8, 16, 8, 0) is None
    second = host_module.check_machine(host, 8, 16, 8, 1)
    assert second and "0 extractor(s) and 8 trainer(s)" in second
    assert host_module.check_machine(host, 0, 1, 1, 0, single=True) is None


def test_plan_shows_the_host_memory_a_replay_holds():
    from dflash_stream.config import REPLAY_WINDOW_BYTES, load_config
    from dflash_stream.observe.plan import build_plan, render_plan

    plain = build_plan(load_config("configs/quality.yaml"))
    assert "replay" not in plain["buffer"]
    replaying = build_plan(load_config("configs/quality.yaml", ["--extract.from_store=/tmp/kept",
                                                                "--train.epoch_source=reextract"]))
    assert replaying["buffer"]["replay"] == {"from_store": "/tmp/kept", "host_bytes_per_extractor": REPLAY_WINDOW_BYTES}
    assert "of decoded states in host RAM per extractor" in render_plan(replaying)


def test_plan_counts_the_host_memory_of_each_role():
    """The headline job: an extractor holds queue_size + 2 forward batches of states, the segment it fills and
    that segment coded; a trainer whole decoded segments (see the store test that one sample keeps its
    segment). Both grow with the knobs the plan names."""
    from dflash_stream.config import HOLD_BATCHES, MAX_LENGTH_BUCKETS, READER_PREFETCH, load_config
    from dflash_stream.observe.plan import build_plan, render_plan

    cfg = load_config("configs/qwen3.6-27b-4gpu.yaml")
    plan = build_plan(cfg, processes=4)
    host, width = plan["host_memory"], 5 * 5120
    segment = int(cfg.store.segment_bytes)
    extractor = host["extractor"]["parts"]
    assert extractor["captured_batches"] == (cfg.extract.queue_size + 2) * cfg.extract.batch_tokens * 2 * width
    assert extractor["segment_being_filled"] == segment
    assert extractor["coded_segment"] == pytest.approx(segment / plan["volume"]["ratio"], rel=1e-6)
    trainer = host["trainer"]
    per_token = 2 * width + 5
    held = math.ceil((HOLD_BATCHES + 1) * cfg.train.batch_tokens * per_token / segment) + MAX_LENGTH_BUCKETS
    assert trainer["segments_held_by_batcher"] == held
    # train.async_checkpoint: trainer 0 keeps one checkpoint's state in host memory for its background write.
    snapshot = plan["time"]["checkpoints"]["bytes"]
    assert trainer["parts"]["checkpoint_snapshot"] == int(snapshot) > 0
    assert trainer["total_bytes"] == (READER_PREFETCH + 1 + held) * segment + int(snapshot)
    assert 10 * 2**30 < host["extractor"]["total_bytes"] < 12 * 2**30  # 11.2 GiB, mostly pinned batches
    text = render_plan(plan)
    assert "host memory per process" in text
    # Only trainer 0 writes the model and optimizer files: the other trainers hold no snapshot.
    assert re.search(rf"trainer 0 +up to +{re.escape(fmt_bytes(trainer['total_bytes']))} ", text)
    assert re.search(rf"trainer 1\+ +up to +{re.escape(fmt_bytes(trainer['total_bytes'] - int(snapshot)))} ", text)

    smaller = build_plan(load_config("configs/qwen3.6-27b-4gpu.yaml", ["--store.segment_bytes=256MiB",
                                                                       "--extract.queue_size=1"]))["host_memory"]
    assert smaller["extractor"]["total_bytes"] < host["extractor"]["total_bytes"] / 2
    def states(h: dict) -> int:  # the snapshot does not depend on the segment size
        return h["trainer"]["total_bytes"] - h["trainer"]["parts"]["checkpoint_snapshot"]

    assert states(smaller) < states(host) / 2


def test_headline_config_plans_the_real_target(capsys) -> None:
    """configs/qwen3.6-27b-4gpu.yaml is Qwen3.6-27B itself (issue 23's contract): its vocabulary, its 48 + 16
    layer types from transformers' own qwen3_5 rules, the kernels its GDN layers are planned with, and the
    published drafter's layout."""
    config = Path(__file__).parents[1] / "configs" / "qwen3.6-27b-4gpu.yaml"
    assert main(["plan", "--config", str(config), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    t = plan["target"]
    assert t["model_type"] == "qwen3_5" and t["num_layers"] == 64 and t["hidden_size"] == 5120
    assert t["vocab_size"] == 248_320
    assert t["layer_types"] == {"linear_attention": 48, "full_attention": 16}
    assert t["num_parameters"] == t["active_parameters"] == 27e9
    assert any("flash-linear-attention" in k and "dflash-stream[gpu]" in k for k in plan["kernels"])
    # Only the 16 attention layers hold a KV cache; the 48 linear ones a fixed-size state per sequence.
    parts = plan["memory"]["extractor"]["parts"]
    cfg = load_config(config)
    rows, length = cfg.data.generation.batch_size, cfg.data.max_length
    assert parts["regeneration_kv_cache"] == rows * length * 16 * 2 * 4 * 256 * 2
    assert parts["regeneration_linear_state"] > 0
    d = cfg.drafter
    assert d.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and d.sliding_window == 2048
    assert (d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.intermediate_size) == (32, 8, 128, 17408)
    assert d.mask_token_id == 248_070 and d.rope_theta == 1e7
    assert cfg.target.layer_ids == [1, 16, 31, 46, 61]


def test_plan_counts_the_checkpoints_the_release_rule_forces(tmp_path) -> None:
    """Issue 26's contract `time.checkpoints`: released after_checkpoint, at the headline's rates the budget, not
    train.checkpoint_every, sets how often trainers checkpoint; a smaller budget forces more of them and a large
    stall share warns."""
    headline = load_config(Path(__file__).parents[1] / "configs" / "qwen3.6-27b-4gpu.yaml",
                           ["--train.release=after_checkpoint"])
    plan = build_plan(headline, processes=4)
    c = plan["time"]["checkpoints"]
    assert set(c) >= {"bytes", "every_seconds", "write_seconds", "stall_fraction"}
    assert c["bytes"] * (headline.train.keep_checkpoints + 1) == plan["disk"]["parts"]["checkpoints"]
    assert "release rule" in c["forced_by"] and 0 < c["stall_fraction"] < 0.05
    assert c["write_seconds"] == pytest.approx(c["bytes"] / 1e9)
    assert not any("checkpoints stop training" in w for w in plan["warnings"])

    small = headline.model_copy(update={"store": headline.store.model_copy(update={"budget": 4 * 2**30})})
    tight = build_plan(small, processes=4)["time"]["checkpoints"]
    assert tight["every_seconds"] == pytest.approx(c["every_seconds"] * 4 * 2**30 / int(headline.store.budget))
    assert tight["count"] > 10 * c["count"] and tight["stall_fraction"] > 0.05
    assert any("checkpoints stop training" in w and "store.budget" in w and "train.release: on_use" in w
               for w in build_plan(small, processes=4)["warnings"])


def test_plan_shows_both_release_rules_and_the_headline_checkpoints_on_the_users_clock() -> None:
    """Issue 34: configs/qwen3.6-27b-4gpu-vllm.yaml (training the slower side) releases on use and checkpoints
    every 30 minutes: ~360 checkpoints, ~7 TB, under 0.5 % of training stopped, about an order of magnitude below
    what after_checkpoint's buffer forces (3,329, 2.6 %; 3.0 % before the training estimate counted the LM head's
    logits computed again in backward); one crash costs at most the interval (its write included) plus
    re-extracting what was released in it, under an hour; plan names the rule, says why, and shows both."""
    from dflash_stream.observe.plan import render_plan

    cfg = load_config(Path(__file__).parents[1] / "configs" / "qwen3.6-27b-4gpu-vllm.yaml")
    plan = build_plan(cfg, processes=4)
    c = plan["time"]["checkpoints"]
    on_use, after = c["rules"]["on_use"], c["rules"]["after_checkpoint"]
    assert c["rule"] == cfg.train.release == "on_use" and c["count"] == on_use["count"]
    assert on_use["every_seconds"] == cfg.train.checkpoint_every_s == 1800
    assert 330 <= on_use["count"] <= 390 and 6e12 < on_use["bytes_written"] < 8e12
    assert on_use["stall_fraction"] < 0.005 and after["stall_fraction"] > 0.025 and after["count"] > 3000
    assert after["bytes_written"] > 9 * on_use["bytes_written"] and after["count"] > 9 * on_use["count"]
    assert on_use["training_lost_seconds"] == pytest.approx(1800 + c["write_seconds"])
    assert 0 < on_use["reextract_seconds"] < on_use["training_lost_seconds"] and after["reextract_seconds"] == 0
    assert on_use["crash_seconds"] == pytest.approx(on_use["training_lost_seconds"] + on_use["reextract_seconds"])
    assert on_use["crash_seconds"] < 3600
    # What a crash extracts again: the interval's token-uses over the 6 uses per segment, plus the buffer's content.
    train = plan["time"]["phases"]["train"]
    uses = train["tok_s_per_process"] * train["processes"] * on_use["training_lost_seconds"]
    buffered = int(cfg.store.budget) / plan["volume"]["stored_bytes_per_token"]
    assert on_use["reextract_tokens"] == pytest.approx(uses / 6 + buffered)
    assert "9.2x fewer bytes" in c["why"]
    page = render_plan(plan)
    assert "release  train.release: on_use" in page
    assert re.search(r"-> on_use +362 +6\.8 TiB +0\.29% +30m 00s", page), page
    assert re.search(r" after_checkpoint +3,329 +62\.9 TiB +2\.59% +3m 15s", page), page
    assert not any("one crash may cost" in w for w in plan["warnings"])
    # A crash costing more than an hour warns, naming the knobs.
    slow = load_config(Path(__file__).parents[1] / "configs" / "qwen3.6-27b-4gpu-vllm.yaml",
                       ["--train.checkpoint_every_s=7200"])
    assert any("one crash may cost" in w and "train.checkpoint_every_s" in w and "after_checkpoint" in w
               for w in build_plan(slow, processes=4)["warnings"])


def test_plan_uses_the_counts_of_dflash_stream_data_for_the_same_data(tiny_target_dir, tmp_path, capsys) -> None:
    """Samples kept after filtering and their mean length, as `dflash-stream data` counted them; ignored once the
    config makes other samples."""
    from test_pipeline import write_run_config

    config = write_run_config(tmp_path, tiny_target_dir, rows=20)
    assert main(["data", "--config", str(config), "--json"]) == 0
    counted = json.loads(capsys.readouterr().out)
    cfg = load_config(config)
    data = build_plan(cfg)["data"]
    assert data["samples"] == counted["kept"] and "dflash-stream data" in data["samples_source"]
    assert data["mean_tokens"] == pytest.approx(counted["tokens"]["mean"], rel=1e-3)
    assert "dflash-stream data" in data["mean_tokens_source"]
    other = load_config(config, ["--data.sources.0.limit=5"])
    assert "dflash-stream data" not in build_plan(other)["data"]["samples_source"]


# ------------------------------------------------------------------------ regeneration on serving engines


def _regen_config(tmp_path: Path, engine: str = "openai", regenerate: bool = True, **generation) -> Path:
    """A 36-layer, 4096-wide dense target (hints, no download) with regeneration by `engine`."""
    gen = {"engine": engine, "max_new_tokens": 2048, **generation}
    if engine == "openai":
        gen.setdefault("endpoints", ["http://serve-0:8000/v1", "http://serve-1:8000/v1"])
    folder = tmp_path / f"config-{len(list(tmp_path.glob('config-*')))}"  # each config its own file
    folder.mkdir()
    return _config(folder, {
        "output_dir": str(tmp_path / "out"),
        "target": {"model": "org/m", "num_layers": 36, "hidden_size": 4096, "vocab_size": 151936,
                   "intermediate_size": 12288, "num_key_value_heads": 8, "head_dim": 128},
        "data": {"sources": [{"path": "org/data"}], "max_length": 4096, "regenerate": regenerate,
                 "generation": gen},
        "store": {"path": str(tmp_path / "store"), "budget": "50GB"},
        "train": {"epochs": 2, "checkpoint_every": 10**6},
        "roles": {"device_memory": "96GB"},
    })


def test_plan_openai_with_a_measured_rate_is_samples_x_response_over_the_endpoints(tmp_path: Path) -> None:
    """tokens_per_s set: all the answers take samples x response tokens / (tokens_per_s x endpoints), whatever the
    split of the launch, and the extraction side overlaps it (the slower of the two sets its pace)."""
    from dflash_stream.sizing.work import MEASURED_SERVER_RATE, PROMPT_SHARE

    samples, mean = 10_000, 1_500
    response = mean * (1 - PROMPT_SHARE)  # 1,000 tokens per answer
    endpoints = [f"http://serve-{i}:8000/v1" for i in range(4)]
    for n, rate in ((2, 500.0), (4, 500.0), (4, 50_000.0)):
        cfg = load_config(_regen_config(tmp_path, endpoints=endpoints[:n], tokens_per_s=rate))
        t = build_plan(cfg, samples=samples, mean_tokens=mean, processes=4)["time"]
        assert t["regenerate"]["tokens_per_s_source"] == MEASURED_SERVER_RATE
        assert "measured" in MEASURED_SERVER_RATE and "data.generation.tokens_per_s" in MEASURED_SERVER_RATE
        assert t["regenerate_seconds"] == pytest.approx(samples * response / (rate * n), rel=1e-12)
        assert t["phases"]["data"]["seconds"] == t["regenerate_seconds"]
        extract = t["phases"]["extract"]["seconds"]
        assert t["extract_side_seconds"] == max(t["regenerate_seconds"], extract)
        assert t["total_seconds"] == max(t["regenerate_seconds"], extract, t["phases"]["train"]["seconds"])
        assert f"regeneration on {n} endpoint(s) beside the launch, overlapped with extraction" in \
            t["phases"]["data"]["source"]
    # Slow servers (500 tok/s) set the pace: 10,000 x 1,000 / (500 x 4) = 5,000 s, longer than the launch's work.
    assert t["regenerate_seconds"] < t["phases"]["extract"]["seconds"]  # the fast case: extraction is slower
    slow = build_plan(load_config(_regen_config(tmp_path, endpoints=endpoints, tokens_per_s=1.0)),
                      samples=samples, mean_tokens=mean, processes=4)["time"]
    assert slow["regenerate_seconds"] == pytest.approx(samples * response / 4)
    assert slow["total_seconds"] == slow["extract_side_seconds"] == slow["regenerate_seconds"]


def test_plan_openai_estimate_falls_with_more_endpoints_and_is_labelled(tmp_path: Path) -> None:
    """No tokens_per_s: an estimate named as one; twice the endpoints halve the time; continuous batching at a
    higher concurrency generates more per endpoint; the server's memory caps the sequences decoded at once."""
    one = build_plan(load_config(_regen_config(tmp_path, endpoints=["http://a:8000/v1"])),
                     samples=10_000, mean_tokens=1_500, processes=4)["time"]
    three = build_plan(load_config(_regen_config(tmp_path, endpoints=[f"http://a{i}:8000/v1" for i in range(3)])),
                       samples=10_000, mean_tokens=1_500, processes=4)["time"]
    r = one["regenerate"]
    assert "estimated" in r["tokens_per_s_source"] and "bench regenerate" in r["tokens_per_s_source"]
    assert any("continuous batching" in a and "no padding to the longest answer" in a for a in r["assumptions"])
    assert three["regenerate_seconds"] == pytest.approx(one["regenerate_seconds"] / 3)
    assert three["regenerate"]["tokens_per_s"] == r["tokens_per_s"]  # per endpoint
    # Bandwidth bound: one step reads the weights, the running answers' mean paged cache (prompt 500 + half of a
    # 1,000-token answer = 1,000 tokens each), 64 sequences by default, at 2.4 TB/s.
    kv = 36 * 1_000 * 2 * 8 * 128 * 2
    assert r["running_sequences"] == 64 and r["kv_bytes_read_per_step"] == 64 * kv
    assert r["step_seconds"] == pytest.approx((r["weight_bytes"] + 64 * kv) / 2.4e12)
    assert r["tokens_per_s"] == pytest.approx(64 / r["step_seconds"])
    more = build_plan(load_config(_regen_config(tmp_path, endpoints=["http://a:8000/v1"], concurrency=128)),
                      samples=10_000, mean_tokens=1_500, processes=4)["time"]["regenerate"]
    # Twice the sequences per step for little more than the same weight read (16 GB against 9 GB of cache).
    assert more["tokens_per_s"] > 1.4 * r["tokens_per_s"]
    capped = build_plan(load_config(_regen_config(tmp_path, endpoints=["http://a:8000/v1"], concurrency=100_000)),
                        samples=10_000, mean_tokens=1_500, processes=4)["time"]["regenerate"]
    assert capped["running_sequences"] == capped["sequences_that_fit"] < 100_000
    assert any("holds only" in a for a in capped["assumptions"])


def test_plan_openai_split_excludes_regeneration(tmp_path: Path) -> None:
    """The extractors do not decode with engine openai: their work per sample and the chosen split are those of a
    run without regeneration, while engine hf adds the decoding to the extractors (and shifts the split)."""
    from dflash_stream.sizing.work import role_work
    from dflash_stream.target_model.shape import target_shape

    def work_and_split(cfg):
        shape = target_shape(cfg.target)
        layers = [1, 9, 17, 25, 33]
        plan = build_plan(cfg, samples=10_000, mean_tokens=1_500, processes=8)
        return role_work(cfg, shape, layers, 1_500, None)["extractor_seconds_per_sample"], plan["roles"]

    plain, plain_roles = work_and_split(load_config(_regen_config(tmp_path, regenerate=False)))
    served, served_roles = work_and_split(load_config(_regen_config(tmp_path)))
    local, local_roles = work_and_split(load_config(_regen_config(tmp_path, engine="hf")))
    assert served == plain and local > 2 * plain
    assert served_roles["trainers"] == plain_roles["trainers"] > local_roles["trainers"]
    assert served_roles["alternatives"] == plain_roles["alternatives"]


def test_plan_counts_the_serving_gpus_beside_the_launch(tmp_path: Path, capsys) -> None:
    endpoints = [f"http://serve-{i}:8000/v1" for i in range(3)]
    path = _regen_config(tmp_path, endpoints=endpoints, gpus_per_endpoint=2)
    plan = build_plan(load_config(path), samples=10_000, mean_tokens=1_500, processes=4)
    assert plan["time"]["gpus"] == {"launch": 4, "extraction_servers": 0, "regeneration_servers": 6, "serving": 6,
                                    "total": 10}
    hf = build_plan(load_config(_regen_config(tmp_path, engine="hf")), samples=10_000, mean_tokens=1_500,
                    processes=4)
    assert hf["time"]["gpus"] == {"launch": 4, "extraction_servers": 0, "regeneration_servers": 0, "serving": 0,
                                  "total": 4}
    # No regeneration: no servers asked, whatever the engine says.
    plain = build_plan(load_config(_regen_config(tmp_path, regenerate=False, endpoints=endpoints)), processes=4,
                       samples=10_000, mean_tokens=1_500)
    assert plain["time"]["gpus"]["serving"] == 0
    # Tensor parallel over 2 GPUs: twice the bandwidth at 80 % efficiency, so more tokens per endpoint.
    r, r1 = plan["time"]["regenerate"], build_plan(
        load_config(_regen_config(tmp_path, endpoints=endpoints)), samples=10_000, mean_tokens=1_500,
        processes=4)["time"]["regenerate"]
    assert r["bandwidth_bytes_per_s"] == pytest.approx(2 * 0.8 * r1["bandwidth_bytes_per_s"])
    assert r["tokens_per_s"] > r1["tokens_per_s"]

    assert main(["plan", "--config", str(path), "--processes", "4", "--samples", "10000", "--mean-tokens",
                 "1500"]) == 0
    page = capsys.readouterr().out
    assert "GPUs: 4 in the launch + 6 serving (3 endpoints x 2) = 10" in page
    assert "regeneration on 3 endpoint(s) beside the launch, overlapped with extraction" in page
    assert main(["plan", "--config", str(path), "--processes", "4", "--samples", "10000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["time"]["gpus"]["total"] == 10


def test_plan_warns_when_the_weights_do_not_fit_a_server(tmp_path: Path) -> None:
    path = _regen_config(tmp_path, endpoints=["http://a:8000/v1"])
    small = load_config(path, ["--roles.device_memory=4GB"])
    plan = build_plan(small, samples=1_000, mean_tokens=1_500, processes=2)
    assert plan["time"]["regenerate"]["weights_fit"] is False
    assert any("data.generation.gpus_per_endpoint" in w for w in plan["warnings"])
    assert not any("gpus_per_endpoint" in w for w in build_plan(load_config(path), samples=1_000, mean_tokens=1_500,
                                                                 processes=2)["warnings"])


def test_plan_checkpoints_follow_the_overlapped_extraction_side(tmp_path: Path) -> None:
    """With slow servers the extraction side's pace is regeneration's alone (not regeneration + extraction), and
    the release rule forces one checkpoint per budget's worth of states written at that pace."""
    # Checkpoints on steps alone: the buffer's rule, not the 30-minute clock, then sets after_checkpoint's pace.
    cfg = load_config(_regen_config(tmp_path, endpoints=["http://a:8000/v1"], tokens_per_s=5.0),
                      ["--train.checkpoint_every_s=null"])
    plan = build_plan(cfg, samples=10_000, mean_tokens=1_500, processes=4)
    t, c = plan["time"], plan["time"]["checkpoints"]
    assert t["extract_side_seconds"] == t["regenerate_seconds"] > t["phases"]["extract"]["seconds"]
    written = 10_000 * 1_500 * plan["volume"]["stored_bytes_per_token"] / t["regenerate_seconds"]
    forced = c["rules"]["after_checkpoint"]
    assert "extraction is the slower side" in forced["forced_by"]
    assert forced["every_seconds"] == pytest.approx(int(cfg.store.budget) / written)


def test_plan_hf_regeneration_figures_are_unchanged() -> None:
    """Engine hf (the headline config) keeps the figures it had before engine openai came: regeneration on the
    extractors, added to their extraction (934,449 s). Training, since its estimate counts the LM head's logits
    computed again in backward, is the slower side: it sets the total and after_checkpoint's pace."""
    plan = build_plan(load_config(Path(__file__).parents[1] / "configs" / "qwen3.6-27b-4gpu.yaml"),
                      samples=914_000, processes=4)
    t = plan["time"]
    assert t["regenerate"]["engine"] == "hf"
    assert t["regenerate"]["seconds_per_sample"] == pytest.approx(1.86278371328, rel=1e-9)
    assert t["regenerate_seconds"] == pytest.approx(851292.15696896, rel=1e-9)
    assert t["extract_side_seconds"] == pytest.approx(t["regenerate_seconds"] + t["phases"]["extract"]["seconds"])
    assert t["extract_side_seconds"] == pytest.approx(934448.604425216, rel=1e-9)
    assert t["total_seconds"] == t["phases"]["train"]["seconds"] == pytest.approx(975450.289471488, rel=1e-9)
    assert t["checkpoints"]["rules"]["after_checkpoint"]["every_seconds"] == pytest.approx(293.0954733951762, rel=1e-9)
    assert plan["roles"]["trainers"] == 2 and t["gpus"] == {"launch": 4, "extraction_servers": 0,
                                                                 "regeneration_servers": 0, "serving": 0, "total": 4}


def test_vllm_headline_config_plans_servers_beside_the_launch() -> None:
    """configs/qwen3.6-27b-4gpu-vllm.yaml: 4 endpoints of one GPU each beside the 4-GPU launch; the estimate is
    labelled as one (no measured figure in the config); the extractors' split ignores the decoding."""
    root = Path(__file__).parents[1] / "configs"
    cfg = load_config(root / "qwen3.6-27b-4gpu-vllm.yaml")
    assert cfg.data.generation.tokens_per_s is None and len(cfg.data.generation.endpoints) == 4
    plan = build_plan(cfg, samples=914_000, processes=4)
    t = plan["time"]
    assert t["gpus"] == {"launch": 4, "extraction_servers": 0, "regeneration_servers": 4, "serving": 4, "total": 8}
    assert "estimated" in t["regenerate"]["tokens_per_s_source"]
    assert t["regenerate"]["running_sequences"] == 128  # the configured concurrency fits a 96 GB server
    headline = build_plan(load_config(root / "qwen3.6-27b-4gpu.yaml"), samples=914_000, processes=4)
    assert t["total_seconds"] < headline["time"]["total_seconds"]
    assert plan["roles"]["trainers"] > headline["roles"]["trainers"]


def test_plan_shows_a_gguf_targets_conversion_beside_the_runs_footprint(tmp_path: Path, monkeypatch) -> None:
    """The demo's GGUF target is converted into the user's cache by the run's first load (`gguf_cache`): `plan`
    shows it (its size: the target's parameters in float32 on a CPU run) and whether it will be written, and keeps
    it out of the footprint `run` refuses on, since it is written only where it takes a tenth of the free space."""
    from dflash_stream.target_model import gguf_cache
    from dflash_stream.target_model.location import gguf_source

    monkeypatch.setenv("DFLASH_STREAM_CACHE", str(tmp_path / "cache"))
    cfg = load_config("configs/demo.yaml")
    plan = build_plan(cfg)
    conversion, disk = plan["disk"]["gguf_conversion"], plan["disk"]
    assert conversion["state"] == "written"
    assert conversion["bytes"] == pytest.approx(134.5e6 * 4, rel=0.01)  # SmolLM2-135M's weights in float32
    assert conversion["path"].startswith(str(tmp_path / "cache" / "gguf"))
    assert disk["total_bytes"] == sum(disk["parts"].values()) < conversion["bytes"]
    assert "the GGUF target's conversion" in render_plan(plan) and "written by the run's first load" in render_plan(plan)

    real_usage = shutil.disk_usage
    monkeypatch.setattr(gguf_cache.shutil, "disk_usage",
                        lambda path: real_usage(path)._replace(free=9 * conversion["bytes"]))
    assert build_plan(cfg)["disk"]["gguf_conversion"]["state"] == "skipped"
    monkeypatch.setattr(gguf_cache.shutil, "disk_usage", real_usage)

    folder = Path(conversion["path"])  # a finished conversion of this very file, as the first load leaves it
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\0" * 1000)
    (folder / gguf_cache.STAMP).write_text(json.dumps(gguf_cache._stamp(gguf_source(cfg.target))))
    there = build_plan(cfg)["disk"]["gguf_conversion"]
    assert there["state"] == "present" and there["bytes"] == 1000 + (folder / gguf_cache.STAMP).stat().st_size

    assert "gguf_conversion" not in build_plan(load_config("configs/qwen3.6-27b-4gpu-vllm.yaml"))["disk"]
